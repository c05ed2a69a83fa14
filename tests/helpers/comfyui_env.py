"""Run a real ComfyUI for integration tests.

Three pieces, all calling ComfyUI's own code (nothing of ComfyUI is copied here):

* `comfyui_path_or_reason()` / `require_comfyui_path()`: find a ComfyUI ($COMFYUI_PATH, the
  ComfyUI the pack sits in, or the prepared archive from ../shared/comfyui/), or skip with the reason.
* `ComfyUIHarness`: ComfyUI loaded *in this process* (session-scoped in `comfyui_fixtures.py`),
  our pack loaded through `nodes.load_custom_node` exactly as ComfyUI does for custom_nodes/,
  with `run_prompt()`, `models_dir()` and `object_info()`.
* `run_comfyui_quick_test()` / `comfyui_server()`: ComfyUI's `main.py` in a subprocess, with our
  pack visible as a custom node through a temporary extra_model_paths.yaml (`custom_nodes:`),
  without touching the checkout (base, user, input, output and temp dirs and the database are
  temporary too).

torchvision/torchaudio are not installed on the test machine: the import-only stubs in
tests/comfy_stubs/ are put on sys.path / PYTHONPATH here, and only here, and only for a package
that is not really installed (a real torchvision/torchaudio is never shadowed).

Plain module (tests/ is on sys.path, not a package): `import comfyui_env`.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import hashlib
import importlib.util
import json
import logging
import os
import pathlib
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from typing import Any, Iterator

ENV_VAR = "COMFYUI_PATH"

TESTS_DIR = pathlib.Path(__file__).resolve().parents[1]
REPO_ROOT = TESTS_DIR.parent
STUBS_DIR = TESTS_DIR / "comfy_stubs"
# The folder name users get from a git clone / the registry; ComfyUI names the module after it.
PACK_LINK_NAME = "comfy-metal"

_ANSI_RE = re.compile(r"\x1b\[[0-9;]*m")


# --------------------------------------------------------------------------------------------
# Finding ComfyUI
# --------------------------------------------------------------------------------------------

def missing_files(path: pathlib.Path) -> list[str]:
    from comfy_metal.nodes.common.comfyui import missing_comfyui_files  # the pack's one ComfyUI check

    return missing_comfyui_files(path)


# The archive of ComfyUI's source that sits beside the project (../shared/comfyui/), unpacked once
# into a cache folder outside the repository by tests/tools/prepare_comfyui.py (tests/run.sh runs it).
ARCHIVE_DIR = REPO_ROOT.parent / "shared" / "comfyui"
ARCHIVE_GLOB = "ComfyUI-*.tar.gz"
READY_MARKER = ".comfy-metal-ready"  # + "-<environment>": written once ComfyUI's requirements are installed


def shared_archive() -> pathlib.Path | None:
    """The newest ComfyUI source archive beside the project, if any."""
    found = sorted(ARCHIVE_DIR.glob(ARCHIVE_GLOB)) if ARCHIVE_DIR.is_dir() else []
    return found[-1] if found else None


def environment_key() -> str:
    """This Python environment: its prefix (each venv has its own) and interpreter (two Pythons can
    share a prefix, each with its own site-packages)."""
    return hashlib.sha256(f"{sys.prefix}\n{sys.implementation.cache_tag}".encode()).hexdigest()[:16]


def ready_marker(unpacked: pathlib.Path) -> pathlib.Path:
    """The file saying ComfyUI's requirements (of the ComfyUI unpacked at `unpacked`) are installed in
    this Python environment: one per environment, beside the unpacked tree shared by all of them."""
    return unpacked.parent / f"{READY_MARKER}-{environment_key()}"


def cache_dir() -> pathlib.Path:
    """$COMFY_METAL_CACHE, else $XDG_CACHE_HOME/comfy-metal, else ~/.cache/comfy-metal."""
    raw = os.environ.get("COMFY_METAL_CACHE", "").strip()
    if raw:
        return pathlib.Path(raw).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    return (pathlib.Path(xdg) if xdg else pathlib.Path.home() / ".cache") / "comfy-metal"


def unpacked_archive_path(archive: pathlib.Path) -> pathlib.Path:
    """Where `archive` is unpacked: <cache>/<archive name without .tar.gz>/ComfyUI."""
    return cache_dir() / archive.name[: -len(".tar.gz")] / "ComfyUI"


def enclosing_comfyui() -> pathlib.Path | None:
    """The ComfyUI this pack sits in (<ComfyUI>/custom_nodes/<pack>), where users install it."""
    from comfy_metal.nodes.common.comfyui import comfyui_in_custom_nodes

    return comfyui_in_custom_nodes(pack_dirs=(REPO_ROOT,))


def comfyui_path_or_reason() -> tuple[pathlib.Path | None, str | None]:
    """(path, None) for the ComfyUI the tests use, else (None, the reason to skip).

    In order: $COMFYUI_PATH; the ComfyUI the pack sits in; the archive beside the project once
    tests/tools/prepare_comfyui.py unpacked it and installed its requirements into this Python."""
    raw = os.environ.get(ENV_VAR, "").strip()
    if raw:
        path = pathlib.Path(raw).expanduser().resolve()
        missing = missing_files(path)
        if missing:
            return None, (f"COMFYUI_PATH={raw!r} is not a ComfyUI checkout (missing {', '.join(missing)}): "
                          "ComfyUI integration tests skipped")
        return path, None
    enclosing = enclosing_comfyui()
    if enclosing is not None:
        return enclosing, None
    archive = shared_archive()
    if archive is None:
        return None, (f"COMFYUI_PATH is unset, the pack is not inside a ComfyUI/custom_nodes folder, and no "
                      f"{ARCHIVE_GLOB} is in {ARCHIVE_DIR}: ComfyUI integration tests skipped")
    unpacked = unpacked_archive_path(archive)
    if missing_files(unpacked) or not ready_marker(unpacked).is_file():
        return None, (f"{archive.name} is not prepared for this Python ({sys.prefix}) yet (run "
                      f"`python tests/tools/prepare_comfyui.py`, which tests/run.sh does): ComfyUI "
                      f"integration tests skipped")
    return unpacked, None


def require_comfyui_path() -> pathlib.Path:
    """The ComfyUI checkout, or pytest.skip() with the reason (also printed, for -s / CI logs)."""
    path, reason = comfyui_path_or_reason()
    if path is None:
        import pytest

        print(reason, file=sys.stderr)
        pytest.skip(reason)
    return path


def strip_ansi(text: str) -> str:
    return _ANSI_RE.sub("", text)


def make_pack_link(parent: pathlib.Path, name: str = PACK_LINK_NAME) -> pathlib.Path:
    """Create parent/<name> -> repo root (as a user's custom_nodes/comfy-metal would be)."""
    parent.mkdir(parents=True, exist_ok=True)
    link = parent / name
    if link.is_symlink() or link.exists():
        if link.is_symlink() and pathlib.Path(os.readlink(link)) == REPO_ROOT:
            return link
        raise FileExistsError(f"{link} exists and is not a symlink to {REPO_ROOT}")
    link.symlink_to(REPO_ROOT, target_is_directory=True)
    return link


STUBBED_PACKAGES = ("torchvision", "torchaudio")


def _really_installed(name: str) -> bool:
    spec = importlib.util.find_spec(name)
    if spec is None:
        return False
    locations = list(spec.submodule_search_locations or []) + [spec.origin or ""]
    return not any(loc and pathlib.Path(loc).resolve().is_relative_to(STUBS_DIR) for loc in locations)


def stubs_path() -> pathlib.Path | None:
    """A directory holding the stubs of those STUBBED_PACKAGES that are not really installed.

    None when all are installed (then no stub may shadow them); STUBS_DIR when none is (this
    machine); else a temp dir of symlinks to just the missing ones.
    """
    missing = [n for n in STUBBED_PACKAGES if not _really_installed(n)]
    if not missing:
        return None
    if len(missing) == len(STUBBED_PACKAGES):
        return STUBS_DIR
    d = pathlib.Path(tempfile.mkdtemp(prefix="comfy-stubs-"))
    for name in (*missing, "_comfy_stub_util.py"):
        (d / name).symlink_to(STUBS_DIR / name)
    return d


def checkout_import_code(root: pathlib.Path = REPO_ROOT) -> str:
    """Python source that imports the checkout at `root` as the package `comfy_metal` (installed or
    not, whatever the folder is called), for `python -c` subprocesses."""
    return (f"import sys, importlib.util; spec = importlib.util.spec_from_file_location('comfy_metal', "
            f"{str(root / '__init__.py')!r}, submodule_search_locations=[{str(root)!r}]); "
            "m = importlib.util.module_from_spec(spec); sys.modules['comfy_metal'] = m; spec.loader.exec_module(m)\n")


def pack_command(*argv: str, root: pathlib.Path = REPO_ROOT) -> list[str]:
    """`python -m comfy_metal ARGV...` run against the checkout at `root`, installed or not."""
    return [sys.executable, "-c", checkout_import_code(root) + "import runpy; sys.argv = ['comfy_metal'] + "
            "sys.argv[1:]; runpy.run_module('comfy_metal', run_name='__main__')", *argv]


def comfy_subprocess_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """os.environ plus the needed stubs (see stubs_path) on PYTHONPATH, after anything already there."""
    env = dict(os.environ)
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    stubs = stubs_path()
    if stubs is not None and str(stubs) not in parts:
        parts.append(str(stubs))
    env["PYTHONPATH"] = os.pathsep.join(parts)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")  # never reach for a hub from a test
    env.setdefault("DO_NOT_TRACK", "1")
    if extra:
        env.update(extra)
    return env


# --------------------------------------------------------------------------------------------
# Subprocess: main.py
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass
class CustomNodeImport:
    seconds: float
    failed: bool
    path: str


@dataclasses.dataclass
class ComfyStartup:
    """Result of a `main.py` run: its command, exit code and log (stdout+stderr, ANSI stripped)."""

    cmd: list[str]
    returncode: int
    log: str
    raw_log: str
    pack_link: pathlib.Path
    seconds: float

    @property
    def custom_node_imports(self) -> list[CustomNodeImport]:
        return parse_custom_node_import_times(self.log)

    @property
    def pack_import(self) -> CustomNodeImport | None:
        """Our line in the "Import times for custom nodes" block, if any."""
        for entry in self.custom_node_imports:
            if os.path.basename(entry.path.rstrip("/")) == self.pack_link.name:
                return entry
        return None

    def problem_lines(self, needles: tuple[str, ...] | None = None) -> list[str]:
        """WARNING/ERROR/CRITICAL log lines (plus traceback text) that mention the pack."""
        needles = needles or (self.pack_link.name, str(self.pack_link), str(REPO_ROOT), "comfy_metal")
        out = []
        in_problem = False
        for line in self.log.splitlines():
            m = re.match(r"^\[(DEBUG|DETAIL|INFO|WARNING|ERROR|CRITICAL)\]", line)
            if m:
                in_problem = m.group(1) in ("WARNING", "ERROR", "CRITICAL")
            elif line.startswith("Traceback"):
                in_problem = True
            if in_problem and any(n in line for n in needles):
                out.append(line)
        return out


def parse_custom_node_import_times(log: str) -> list[CustomNodeImport]:
    """Entries of ComfyUI's "Import times for custom nodes:" block(s)."""
    entries = []
    lines = strip_ansi(log).splitlines()
    for i, line in enumerate(lines):
        if "Import times for custom nodes" not in line:
            continue
        for entry in lines[i + 1:]:
            m = re.search(r"^\s*(?:\[\w+\]\s*)?\s*([0-9.]+) seconds( \(IMPORT FAILED\))?: (.+?)\s*$", entry)
            if not m:
                if entry.strip() and not re.fullmatch(r"\s*(\[\w+\])?\s*", entry):
                    break
                continue
            entries.append(CustomNodeImport(float(m.group(1)), bool(m.group(2)), m.group(3)))
    return entries


def _write_extra_paths_yaml(path: pathlib.Path, custom_nodes_dir: pathlib.Path) -> None:
    # One section of ComfyUI's extra_model_paths.yaml format (utils/extra_config.py).
    path.write_text("comfy_metal_tests:\n"
                    f"    custom_nodes: {json.dumps(str(custom_nodes_dir))}\n", encoding="utf-8")


def _main_py_command(comfyui_path: pathlib.Path, work: pathlib.Path, extra_args: list[str]) -> tuple[list[str], pathlib.Path]:
    base = work / "base"
    for d in ("custom_nodes", "models", "input", "output", "temp", "user"):
        (base / d).mkdir(parents=True, exist_ok=True)
    nodes_dir = work / "custom_nodes"
    link = make_pack_link(nodes_dir)
    yaml_path = work / "extra_model_paths.yaml"
    _write_extra_paths_yaml(yaml_path, nodes_dir)
    cmd = [sys.executable, str(comfyui_path / "main.py"), "--cpu",
           "--base-directory", str(base),
           "--extra-model-paths-config", str(yaml_path),
           "--database-url", "sqlite:///:memory:",
           "--disable-auto-launch",
           *extra_args]
    return cmd, link


def run_comfyui_quick_test(comfyui_path: pathlib.Path | str, work_dir: pathlib.Path | str | None = None,
                           extra_args: list[str] | tuple[str, ...] = (), timeout: float = 600) -> ComfyStartup:
    """`python main.py --cpu --quick-test-for-ci` with our pack as a custom node; returns the log.

    --quick-test-for-ci makes main.py load every node (built-ins, API nodes, custom nodes), set up
    the server object and exit(0) before listening.
    """
    comfyui_path = pathlib.Path(comfyui_path)
    work = pathlib.Path(work_dir) if work_dir else pathlib.Path(tempfile.mkdtemp(prefix="comfyui-quick-"))
    cmd, link = _main_py_command(comfyui_path, work, ["--quick-test-for-ci", *extra_args])
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=comfyui_path, env=comfy_subprocess_env(), stdin=subprocess.DEVNULL,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout)
    raw = proc.stdout.decode("utf-8", "replace")
    return ComfyStartup(cmd, proc.returncode, strip_ansi(raw), raw, link, time.monotonic() - t0)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass
class ComfyServer:
    url: str
    process: subprocess.Popen
    log_path: pathlib.Path
    pack_link: pathlib.Path

    def log(self) -> str:
        return strip_ansi(self.log_path.read_text("utf-8", "replace"))

    def get_json(self, route: str, timeout: float = 30) -> Any:
        with urllib.request.urlopen(self.url + route, timeout=timeout) as r:
            return json.loads(r.read())

    def post_json(self, route: str, payload: Any, timeout: float = 30) -> Any:
        req = urllib.request.Request(self.url + route, data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())


@contextlib.contextmanager
def comfyui_server(comfyui_path: pathlib.Path | str, work_dir: pathlib.Path | str | None = None,
                   extra_args: list[str] | tuple[str, ...] = (), startup_timeout: float = 300) -> Iterator[ComfyServer]:
    """A real ComfyUI server on 127.0.0.1:<free port> for the duration of the `with` block."""
    comfyui_path = pathlib.Path(comfyui_path)
    work = pathlib.Path(work_dir) if work_dir else pathlib.Path(tempfile.mkdtemp(prefix="comfyui-server-"))
    port = free_port()
    cmd, link = _main_py_command(comfyui_path, work, ["--listen", "127.0.0.1", "--port", str(port),
                                                      "--disable-api-nodes", *extra_args])
    log_path = work / "server.log"
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(cmd, cwd=comfyui_path, env=comfy_subprocess_env(), stdin=subprocess.DEVNULL,
                                stdout=log_file, stderr=subprocess.STDOUT)
    server = ComfyServer(f"http://127.0.0.1:{port}", proc, log_path, link)
    try:
        deadline = time.monotonic() + startup_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"ComfyUI exited with {proc.returncode} during startup:\n{server.log()[-8000:]}")
            try:
                server.get_json("/system_stats", timeout=5)
                break
            except (urllib.error.URLError, ConnectionError, OSError):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"ComfyUI did not answer within {startup_timeout}s:\n{server.log()[-8000:]}")
                time.sleep(0.5)
        yield server
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


# --------------------------------------------------------------------------------------------
# In-process harness
# --------------------------------------------------------------------------------------------

class ComfyPromptError(RuntimeError):
    """A prompt failed validation or execution; the message is ComfyUI's own error text."""

    def __init__(self, message: str, details: dict | None = None):
        super().__init__(message)
        self.details = details or {}


class _RecordCollector(logging.Handler):
    def __init__(self, level=logging.WARNING):
        super().__init__(level)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


@dataclasses.dataclass
class PromptResult:
    prompt_id: str
    outputs: dict          # node id -> UI output dict (what /history/<id> calls "outputs")
    meta: dict
    node_outputs: dict     # node id -> list of the node's return values (from the output cache)
    status_messages: list  # (event, data) as PromptExecutor records them
    messages: list         # (event, data, sid) sent through PromptServer.send_sync

    @property
    def history(self) -> dict:
        """Shaped like an entry of GET /history."""
        return {"outputs": self.outputs, "meta": self.meta,
                "status": {"status_str": "success", "completed": True, "messages": self.status_messages}}


class ComfyUIHarness:
    """ComfyUI imported into this process, built-in nodes loaded, then our pack as a custom node.

    ComfyUI keeps global state (module-level registries, cli args parsed once at import), so there
    can be only one per process: use the session fixture `comfyui`.
    """

    def __init__(self, comfyui_path: pathlib.Path | str, base_dir: pathlib.Path | str,
                 init_api_nodes: bool = False):
        self.comfyui_path = pathlib.Path(comfyui_path).resolve()
        self.base_dir = pathlib.Path(base_dir)
        self.init_api_nodes = init_api_nodes
        self.loop: asyncio.AbstractEventLoop | None = None
        self.server = None
        self.nodes = None
        self.execution = None
        self.folder_paths = None
        self.pack_link: pathlib.Path | None = None
        self.pack_module = None
        self.pack_loaded: bool | None = None
        self.pack_load_log: list[logging.LogRecord] = []
        self.builtin_node_names: set[str] = set()
        self.pack_node_names: list[str] = []
        self.startup_seconds: float | None = None
        self._worker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="comfy-prompt")
        self.messages: list = []

    # -- startup -----------------------------------------------------------------------------

    def start(self) -> "ComfyUIHarness":
        t0 = time.monotonic()
        for d in ("models", "input", "output", "temp", "user", "custom_nodes"):
            (self.base_dir / d).mkdir(parents=True, exist_ok=True)
        if str(self.comfyui_path) not in sys.path:
            sys.path.insert(0, str(self.comfyui_path))  # ComfyUI's top-level modules: nodes, server, ...
        # Last on sys.path: a really installed torchvision/torchaudio always wins over a stub.
        if str(STUBS_DIR) not in sys.path:
            sys.path.append(str(STUBS_DIR))

        self._parse_args()

        import folder_paths

        folder_paths.set_output_directory(str(self.base_dir / "output"))
        folder_paths.set_input_directory(str(self.base_dir / "input"))
        folder_paths.set_temp_directory(str(self.base_dir / "temp"))
        folder_paths.set_user_directory(str(self.base_dir / "user"))
        self.folder_paths = folder_paths

        import execution
        import nodes
        import server

        self.execution, self.nodes = execution, nodes
        self.loop = asyncio.new_event_loop()
        self.server = server.PromptServer(self.loop)
        self.loop.run_until_complete(nodes.init_extra_nodes(init_custom_nodes=False,
                                                            init_api_nodes=self.init_api_nodes))
        self.builtin_node_names = set(nodes.NODE_CLASS_MAPPINGS)

        custom_nodes_dir = self.base_dir / "custom_nodes"
        folder_paths.add_model_folder_path("custom_nodes", str(custom_nodes_dir), is_default=True)
        self.pack_link = make_pack_link(custom_nodes_dir)
        collector = _RecordCollector(logging.WARNING)
        root = logging.getLogger()
        root.addHandler(collector)
        try:
            # As nodes.init_external_custom_nodes() does for each folder in custom_nodes/.
            self.pack_loaded = self.loop.run_until_complete(
                nodes.load_custom_node(str(self.pack_link), self.builtin_node_names, module_parent="custom_nodes"))
        finally:
            root.removeHandler(collector)
        self.pack_load_log = collector.records
        # load_custom_node registers a directory module in sys.modules under its path, '.' -> '_x_'.
        self.pack_module = sys.modules.get(str(self.pack_link).replace(".", "_x_"))
        self.pack_node_names = [n for n in nodes.NODE_CLASS_MAPPINGS if n not in self.builtin_node_names]
        self.startup_seconds = time.monotonic() - t0
        return self

    def _parse_args(self) -> None:
        wanted = ["--cpu", "--base-directory", str(self.base_dir), "--database-url", "sqlite:///:memory:",
                  "--disable-auto-launch"]
        if "comfy.cli_args" in sys.modules:
            args = sys.modules["comfy.cli_args"].args
            if not args.cpu:
                raise RuntimeError("comfy.cli_args was imported before the harness without --cpu; "
                                   "start the `comfyui` fixture before importing ComfyUI modules")
            return
        import comfy.options

        saved = sys.argv
        sys.argv = [str(self.comfyui_path / "main.py"), *wanted]
        try:
            comfy.options.enable_args_parsing()
            import comfy.cli_args  # noqa: F401  (parses sys.argv once, at import)
        finally:
            sys.argv = saved

    def pack_load_problems(self) -> list[str]:
        """Warnings/errors logged while our pack loaded (formatted)."""
        return [f"{r.levelname}: {r.getMessage()}" for r in self.pack_load_log]

    def close(self) -> None:
        self._worker.shutdown(wait=True)
        if self.loop is not None and not self.loop.is_closed():
            self.loop.close()

    # -- models ------------------------------------------------------------------------------

    def models_dir(self, kind: str) -> pathlib.Path:
        """A temp folder registered first for folder_paths kind `kind` ("checkpoints", "vae", ...).

        Drop test model files there; ComfyUI's loaders (folder_paths.get_filename_list /
        get_full_path) see them immediately.
        """
        path = self.base_dir / "models" / kind
        path.mkdir(parents=True, exist_ok=True)
        self.folder_paths.add_model_folder_path(kind, str(path), is_default=True)
        self.refresh_models()
        return path

    def refresh_models(self) -> None:
        self.folder_paths.filename_list_cache.clear()

    # -- node info ---------------------------------------------------------------------------

    def _route_handler(self, method: str, path: str):
        for route in self.server.routes:
            if getattr(route, "method", None) == method and getattr(route, "path", None) == path:
                return route.handler
        raise LookupError(f"ComfyUI has no {method} {path} route")

    def object_info(self, node_class: str | None = None) -> dict:
        """What GET /object_info (or /object_info/<node_class>) returns, via the server's own handler."""
        from aiohttp.test_utils import make_mocked_request

        if node_class is None:
            handler = self._route_handler("GET", "/object_info")
            request = make_mocked_request("GET", "/object_info")
        else:
            handler = self._route_handler("GET", "/object_info/{node_class}")
            request = make_mocked_request("GET", f"/object_info/{node_class}",
                                          match_info={"node_class": node_class})
        response = self.loop.run_until_complete(handler(request))
        return json.loads(response.body)

    # -- prompts -----------------------------------------------------------------------------

    def run_prompt(self, prompt: dict, *, execute: list[str] | None = None,
                   extra_data: dict | None = None, prompt_id: str | None = None) -> PromptResult:
        """Validate then execute an API-format prompt, as POST /prompt + the prompt worker would.

        By default the prompt's output nodes (OUTPUT_NODE) are executed, after
        execution.validate_prompt. With `execute=[node ids]` those nodes are validated
        (execution.validate_inputs) and executed instead, output nodes or not: their return
        values are in result.node_outputs[node_id].
        Raises ComfyPromptError with ComfyUI's error text if validation or execution fails.
        """
        execution = self.execution
        prompt_id = prompt_id or str(uuid.uuid4())
        if execute is None:
            ok, error, targets, node_errors = self.loop.run_until_complete(
                execution.validate_prompt(prompt_id, prompt, None))
            if not ok:
                raise ComfyPromptError(_format_validation_error(error, node_errors),
                                       {"error": error, "node_errors": node_errors})
        else:
            targets = list(execute)
            validated: dict = {}
            for node_id in targets:
                if node_id not in prompt:
                    raise ComfyPromptError(f"node {node_id!r} is not in the prompt")
                valid, reasons, _ = self.loop.run_until_complete(
                    execution.validate_inputs(prompt_id, prompt, node_id, validated))
                if valid is not True:
                    node_errors = {nid: {"errors": r[1], "class_type": prompt[nid]["class_type"]}
                                   for nid, r in validated.items() if r[0] is not True and r[1]}
                    raise ComfyPromptError(_format_validation_error(
                        {"message": f"Node {node_id} failed validation", "details": ""}, node_errors),
                        {"node_errors": node_errors})

        executor = execution.PromptExecutor(self.server, cache_type=execution.CacheType.CLASSIC,
                                            cache_args={"lru": 0, "ram": 0, "ram_inactive": 0})

        async def run():
            await executor.execute_async(prompt, prompt_id, dict(extra_data or {}), targets)
            node_outputs = {}
            if executor.success:
                for node_id in prompt:
                    entry = await executor.caches.outputs.get(node_id)
                    if entry is not None:
                        node_outputs[node_id] = entry.outputs
            return node_outputs

        # Like ComfyUI's prompt_worker: asyncio.run(...) on a thread of its own.
        node_outputs = self._worker.submit(asyncio.run, run()).result()
        messages = self._drain_messages()
        if not executor.success:
            raise ComfyPromptError(_format_execution_error(executor.status_messages),
                                   {"status_messages": executor.status_messages})
        history = getattr(executor, "history_result", {"outputs": {}, "meta": {}})
        return PromptResult(prompt_id, history["outputs"], history["meta"], node_outputs,
                            list(executor.status_messages), messages)

    def _drain_messages(self) -> list:
        # send_sync() queues via loop.call_soon_threadsafe; run those callbacks, then empty the queue.
        self.loop.run_until_complete(asyncio.sleep(0))
        out = []
        while not self.server.messages.empty():
            out.append(self.server.messages.get_nowait())
        self.messages.extend(out)
        return out


def _format_validation_error(error: dict | None, node_errors: dict | None) -> str:
    lines = []
    if error:
        lines.append(f"{error.get('message', '')}: {error.get('details', '')}".rstrip(": "))
    for node_id, info in (node_errors or {}).items():
        for reason in info.get("errors", []):
            lines.append(f"  node {node_id} ({info.get('class_type')}): "
                         f"{reason.get('message')}: {reason.get('details')}")
    return "\n".join(lines) or "prompt failed validation"


def _format_execution_error(status_messages: list) -> str:
    for event, data in status_messages:
        if event == "execution_error":
            tb = "".join(data.get("traceback") or [])
            return (f"node {data.get('node_id')} ({data.get('node_type')}) raised "
                    f"{data.get('exception_type')}: {data.get('exception_message')}\n{tb}")
        if event == "execution_interrupted":
            return f"execution interrupted at node {data.get('node_id')} ({data.get('node_type')})"
    return f"execution failed: {status_messages!r}"
