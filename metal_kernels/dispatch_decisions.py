"""The measured dispatch's decisions on disk: a Mac times each kernel and shape class once, not at every
start (dispatch.measured_choice reads and writes them).

One small JSON file, `decisions_path()`:
  $COMFY_METAL_DECISIONS if set; inside ComfyUI <user directory>/__comfy_metal/measured-dispatch.json (a
  ComfyUI system-user folder, which its server never serves); elsewhere (doctor, bench, scripts) the
  per-user cache folder: ~/Library/Caches/comfy-metal/ on macOS, $XDG_CACHE_HOME or ~/.cache/comfy-metal/.

    {"format": 1,
     "environment": {"device": "Apple M2 Max", "os": "macOS 15.1", "torch": "2.15.0",
                     "pack": "0.1.0+<digest of every kernel source>"},
     "decisions": [{"kernel", "shape_class", "candidates", "choice", "times_ms", "reason", "device",
                    "measured_at"}, ...]}

Decisions made in another environment (another chip, macOS, torch or pack version; the pack's entry
changes with any kernel source) are not used, and the next decision replaces them. A file that cannot be
read (not JSON, another format, a malformed record) is ignored with one log line and replaced likewise.
A write goes to a temporary file in the same folder, renamed over the old one: a reader never sees half
a file, and a failed write leaves the old one as it was.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import pathlib
import platform
import subprocess
import sys
import tempfile

log = logging.getLogger("comfy_metal")

FORMAT = 1
ENV_VAR = "COMFY_METAL_DECISIONS"
FILE_NAME = "measured-dispatch.json"
COMFYUI_SYSTEM_USER = "comfy_metal"      # <ComfyUI user directory>/__comfy_metal/
KERNEL_DIR = pathlib.Path(__file__).resolve().parent
RECORD_FIELDS = ("kernel", "shape_class", "candidates", "choice", "times_ms", "reason", "device", "measured_at")

_logged: set = set()


def _log_once(key, level, message):
    if key not in _logged:
        _logged.add(key)
        log.log(level, message)


def _comfyui_user_directory() -> pathlib.Path | None:
    """ComfyUI's system-user folder for the pack, when running inside ComfyUI (folder_paths imported)."""
    folder_paths = sys.modules.get("folder_paths")
    if folder_paths is None or not hasattr(folder_paths, "get_user_directory"):
        return None
    try:
        system_dir = getattr(folder_paths, "get_system_user_directory", None)
        if system_dir is not None:
            return pathlib.Path(system_dir(COMFYUI_SYSTEM_USER))
        return pathlib.Path(folder_paths.get_user_directory()) / f"__{COMFYUI_SYSTEM_USER}"
    except Exception as e:                      # an odd ComfyUI: the cache folder instead
        _log_once(("user-dir", str(e)), logging.DEBUG, f"comfy_metal: no ComfyUI user directory ({e})")
        return None


def _cache_directory() -> pathlib.Path:
    if sys.platform == "darwin":
        return pathlib.Path.home() / "Library" / "Caches" / "comfy-metal"
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    return (pathlib.Path(xdg) if xdg else pathlib.Path.home() / ".cache") / "comfy-metal"


def decisions_path() -> pathlib.Path:
    raw = os.environ.get(ENV_VAR, "").strip()
    if raw:
        return pathlib.Path(raw).expanduser()
    return (_comfyui_user_directory() or _cache_directory()) / FILE_NAME


@functools.lru_cache(maxsize=None)
def device_name() -> str:
    """The chip the decisions were measured on: "Apple M2 Max" on a Mac (sysctl), else the CPU's name."""
    if sys.platform == "darwin":
        try:
            name = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True,
                                  timeout=10).stdout.strip()
            if name:
                return name
        except (OSError, subprocess.SubprocessError):
            pass
    return platform.processor() or platform.machine() or "unknown"


def _os_version() -> str:
    mac = platform.mac_ver()[0]
    return f"macOS {mac}" if mac else f"{platform.system()} {platform.release()}"


@functools.lru_cache(maxsize=None)
def pack_version() -> str:
    """The pack's version and a digest of every kernel source (.metal and the Python launch code), so a
    changed kernel is measured again even where the version number stayed."""
    try:
        from .. import __version__ as version
    except ImportError:
        version = "unknown"
    digest = hashlib.sha256()
    for path in sorted(KERNEL_DIR.rglob("*")):
        rel = path.relative_to(KERNEL_DIR)
        if path.suffix in (".metal", ".py") and rel.parts[0] not in ("emulator", "__pycache__"):
            digest.update(str(rel).encode() + b"\0" + path.read_bytes() + b"\0")
    return f"{version}+{digest.hexdigest()[:12]}"


def environment() -> dict:
    import torch

    return {"device": device_name(), "os": _os_version(), "torch": torch.__version__, "pack": pack_version()}


def _as_tuple(value):
    return tuple(_as_tuple(v) for v in value) if isinstance(value, list) else value


def _as_list(value):
    return [_as_list(v) for v in value] if isinstance(value, (tuple, list)) else value


def _valid_record(r) -> bool:
    return (isinstance(r, dict) and isinstance(r.get("kernel"), str) and isinstance(r.get("shape_class"), list)
            and isinstance(r.get("candidates"), list) and all(isinstance(c, str) for c in r["candidates"])
            and r.get("choice") in r["candidates"] and isinstance(r.get("times_ms"), dict)
            and all(isinstance(t, (int, float)) for t in r["times_ms"].values())
            and isinstance(r.get("reason"), str))


def _read(path: pathlib.Path) -> tuple[dict | None, str | None]:
    """(the file's content, None), (None, None) when there is no file, or (None, what is wrong with it)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None, None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return None, f"{type(e).__name__}: {e}"
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        return None, f"expected a JSON object with \"format\": {FORMAT}"
    if not isinstance(data.get("environment"), dict) or not isinstance(data.get("decisions"), list):
        return None, "expected \"environment\" (an object) and \"decisions\" (a list)"
    bad = [i for i, r in enumerate(data["decisions"]) if not _valid_record(r)]
    if bad:
        return None, f"decision {bad[0]} is malformed"
    return data, None


def load(path: pathlib.Path | None = None) -> list[dict]:
    """The decisions saved for this environment (shape classes as tuples), [] when there are none, when
    the file is another environment's, or when it cannot be read (one log line)."""
    path = path or decisions_path()
    data, problem = _read(path)
    if problem is not None:
        _log_once(("corrupt", str(path), problem), logging.WARNING,
                  f"comfy_metal: ignoring the saved dispatch decisions in {path} ({problem}); "
                  "kernels are measured again and the file is rewritten")
        return []
    if data is None:
        return []
    env = environment()
    if data["environment"] != env:
        changed = ", ".join(f"{k} {data['environment'].get(k)!r} -> {v!r}" for k, v in env.items()
                            if data["environment"].get(k) != v)
        _log_once(("stale", str(path)), logging.INFO,
                  f"comfy_metal: the saved dispatch decisions in {path} were measured elsewhere ({changed}): "
                  "kernels are measured again")
        return []
    return [{**r, "shape_class": _as_tuple(r["shape_class"])} for r in data["decisions"]]


def save(records: list[dict], path: pathlib.Path | None = None) -> bool:
    """Write `records` (this environment's decisions) atomically; the decisions another process saved
    for this environment meanwhile are kept unless `records` has the same (kernel, shape class). False
    (with one log line) where the file cannot be written: the decisions then hold for this process."""
    path = path or decisions_path()
    ours = []
    for r in records:
        entry = {k: _as_list(r[k]) for k in RECORD_FIELDS if k in r}
        try:
            json.dumps(entry)
        except (TypeError, ValueError):
            continue                             # a shape class JSON cannot hold stays in memory only
        ours.append(entry)
    keys = {(e["kernel"], json.dumps(e["shape_class"])) for e in ours}
    kept = [e for e in load(path) if (e["kernel"], json.dumps(_as_list(e["shape_class"]))) not in keys]
    data = {"format": FORMAT, "environment": environment(),
            "decisions": [{**e, "shape_class": _as_list(e["shape_class"])} for e in kept] + ours}
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)
            f.write("\n")
        os.replace(tmp, path)
        return True
    except OSError as e:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        _log_once(("unwritable", str(path)), logging.WARNING,
                  f"comfy_metal: could not save the dispatch decisions to {path} ({e}); they hold for this "
                  "process only")
        return False


def forget_logged() -> None:
    """Log the next problem again (tests)."""
    _logged.clear()
