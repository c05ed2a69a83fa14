"""`python -m comfy_metal run WORKFLOW.json`: execute an API-format workflow without the browser.

The workflow runs through ComfyUI's own executor, in this process: ComfyUI is imported from
`--comfyui PATH`, `$COMFYUI_PATH`, or the ComfyUI whose `custom_nodes/` folder holds this pack; its
built-in nodes load, then this pack is loaded by `nodes.load_custom_node` exactly as ComfyUI does;
`execution.validate_prompt` checks the workflow and `execution.PromptExecutor` runs it. Outputs land
in `--out` (ComfyUI's output directory for the run; SaveImage & co. write there) next to
`summary.json`: per node its class, seconds, peak memory (process RSS; on MPS the tensor and the
driver memory; on CUDA max allocated) and the backend its Comfy Metal kernels used. A progress bar goes to stderr.

Exit codes: 0 success, 1 the workflow failed validation or execution, 2 bad invocation (file
missing, not JSON, UI-format workflow, no ComfyUI found).
"""
from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import logging
import os
import pathlib
import shlex
import shutil
import sys
import tempfile
import threading
import time
import uuid
from typing import Any

from ..common.comfyui import COMFYUI_ENV, PACK_ROOT, comfyui_in_custom_nodes, missing_comfyui_files

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
CLIENT_ID = "comfy-metal-run"

log = logging.getLogger("comfy_metal")


class RunError(Exception):
    def __init__(self, message: str, code: int = EXIT_USAGE):
        super().__init__(message)
        self.code = code


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------

def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "run", help="execute an API-format workflow through ComfyUI's executor, without the browser",
        description="Execute an API-format workflow (ComfyUI: Workflow > Export (API)) through a real "
                    "ComfyUI's executor in this process, with this pack loaded. Writes the outputs and "
                    "summary.json (per node: seconds, peak memory, Comfy Metal backend) to --out.")
    p.add_argument("workflow", help="API-format workflow JSON")
    p.add_argument("--models", metavar="DIR",
                   help="a models folder laid out like ComfyUI's (checkpoints/, diffusion_models/, vae/, "
                        "text_encoders/, loras/, ...): each subfolder is searched first for that kind")
    p.add_argument("--out", metavar="DIR", default="comfy-metal-run",
                   help="output folder for this run and its summary.json (default: ./comfy-metal-run)")
    p.add_argument("--comfyui", metavar="PATH",
                   help=f"ComfyUI checkout to run with (default: ${COMFYUI_ENV}, else the ComfyUI whose "
                        "custom_nodes/ holds this pack)")
    p.add_argument("--cpu", action="store_true", help="run on the CPU even if a GPU is available")
    p.add_argument("--custom-nodes", action="store_true",
                   help="also load the other packs in ComfyUI's custom_nodes/ (default: only this pack)")
    p.add_argument("--comfy-args", metavar="ARGS", default="",
                   help="extra ComfyUI command-line options as one string, written with '=' because it starts "
                        "with --: --comfy-args=\"--force-fp16 --fp32-vae\"")
    p.add_argument("--verbose", action="store_true", help="show ComfyUI's INFO log lines")
    p.set_defaults(fn=run)
    return p


def run(args) -> int:
    try:
        workflow_path = pathlib.Path(args.workflow)
        prompt = load_api_workflow(workflow_path)
        comfyui = find_comfyui(args.comfyui)
        models = pathlib.Path(args.models).expanduser().resolve() if args.models else None
        if models is not None and not models.is_dir():
            raise RunError(f"--models {args.models}: not a folder")
    except RunError as e:
        print(f"comfy_metal run: error: {e}", file=sys.stderr)
        return e.code
    out = pathlib.Path(args.out).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    if not args.verbose:
        logging.getLogger().setLevel(logging.WARNING)
        logging.getLogger("comfy_metal").setLevel(logging.INFO)
    try:
        extra = shlex.split(args.comfy_args or "")
    except ValueError as e:
        print(f"comfy_metal run: error: --comfy-args: {e}", file=sys.stderr)
        return EXIT_USAGE
    session = HeadlessComfyUI(comfyui, out, models=models, force_cpu=args.cpu,
                              load_custom_nodes=args.custom_nodes, comfy_args=extra)
    try:
        try:
            session.start()
        except ImportError as e:
            raise RunError(f"could not import ComfyUI from {comfyui}: {e}. Run with the Python that runs "
                           "ComfyUI, or install its requirements: pip install -r "
                           f"{comfyui / 'requirements.txt'}") from None
        summary = session.execute(prompt, workflow_path)
    except RunError as e:
        print(f"comfy_metal run: error: {e}", file=sys.stderr)
        return e.code
    except KeyboardInterrupt:
        print("\ncomfy_metal run: interrupted", file=sys.stderr)
        return 130
    finally:
        session.close()
    summary_path = out / "summary.json"
    write_json_atomic(summary_path, summary)
    if summary["success"]:
        print(f"done in {summary['seconds']:.1f} s: {len(summary['files'])} output file(s) in {out}, "
              f"summary in {summary_path}", file=sys.stderr)
        for f in summary["files"]:
            print(f)
        return EXIT_OK
    print(f"comfy_metal run: the workflow failed: {summary['error']}\n(summary in {summary_path})", file=sys.stderr)
    return EXIT_FAILED


# --------------------------------------------------------------------------------------------
# Workflow and ComfyUI discovery
# --------------------------------------------------------------------------------------------

UI_FORMAT_HELP = (
    "it is a UI-format workflow (what ComfyUI saves and what drag-and-drop loads), but `run` needs the "
    "API format: open it in ComfyUI and use Workflow > Export (API) (older frontends: enable dev mode "
    "options in the settings, then 'Save (API Format)'). The pack's workflows/ folder ships both; the "
    "API twins end in _api.json.")


def load_api_workflow(path: pathlib.Path) -> dict:
    """The API-format prompt in `path` ({node_id: {"class_type", "inputs"}}); also accepts the body
    of a POST /prompt ({"prompt": {...}}). RunError(2) with the reason otherwise."""
    if not path.is_file():
        raise RunError(f"{path}: no such file")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RunError(f"{path} is not a JSON file: {e}") from None
    if isinstance(data, dict) and isinstance(data.get("prompt"), dict):
        data = data["prompt"]
    if isinstance(data, dict) and isinstance(data.get("nodes"), list) and "links" in data:
        raise RunError(f"{path}: {UI_FORMAT_HELP}")
    if not isinstance(data, dict) or not data:
        raise RunError(f"{path}: expected an API-format workflow, a JSON object mapping node ids to "
                       "{\"class_type\": ..., \"inputs\": {...}}")
    for node_id, node in data.items():
        if not isinstance(node, dict) or not isinstance(node.get("class_type"), str) \
                or not isinstance(node.get("inputs", {}), dict):
            raise RunError(f"{path}: node {node_id!r} is not an API-format node (expected "
                           "{\"class_type\": str, \"inputs\": {...}}); if this is a UI-format workflow, "
                           + UI_FORMAT_HELP)
    return data


def find_comfyui(explicit: str | None = None, pack_dirs=None) -> pathlib.Path:
    """--comfyui, else $COMFYUI_PATH, else the ComfyUI holding this pack (`pack_dirs`: where the pack
    is, as installed and resolved) in custom_nodes/. RunError(2) saying how to point at one."""
    for source, raw in (("--comfyui", explicit), (f"${COMFYUI_ENV}", os.environ.get(COMFYUI_ENV, "").strip())):
        if raw:
            path = pathlib.Path(raw).expanduser().resolve()
            missing = missing_comfyui_files(path)
            if missing:
                raise RunError(f"{source}={raw} is not a ComfyUI folder (missing {', '.join(missing)})")
            return path
    found = comfyui_in_custom_nodes(pack_dirs)
    if found is not None:
        return found
    raise RunError(
        "no ComfyUI found. `run` executes the workflow with a real ComfyUI: pass --comfyui /path/to/ComfyUI, "
        f"or set {COMFYUI_ENV}=/path/to/ComfyUI, or install this pack in ComfyUI/custom_nodes/ and run it "
        "with that ComfyUI's Python.")


# --------------------------------------------------------------------------------------------
# Progress and per-node measurements
# --------------------------------------------------------------------------------------------

def format_bar(value: float, total: float, width: int = 30) -> str:
    frac = 0.0 if not total else min(1.0, max(0.0, value / total))
    filled = int(round(frac * width))
    return f"[{'#' * filled}{'-' * (width - filled)}] {int(value)}/{int(total)} {frac * 100:3.0f}%"


class ProgressPrinter:
    """One line per node and a progress bar (rewritten in place on a terminal)."""

    def __init__(self, stream=None, total_nodes: int = 0):
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.total_nodes = total_nodes
        self.started = 0
        self._open_bar = False
        self._last_quarter = -1

    def _end_bar(self):
        if self._open_bar:
            self.stream.write("\n")
            self._open_bar = False

    def node(self, node_id: str, class_type: str):
        self._end_bar()
        self.started += 1
        self._last_quarter = -1
        self.stream.write(f"[{self.started}/{self.total_nodes}] node {node_id} {class_type}\n")
        self.stream.flush()

    def progress(self, value, total):
        if self.tty:
            self.stream.write("\r    " + format_bar(value, total))
            self._open_bar = value < total
            if not self._open_bar:
                self.stream.write("\n")
        else:  # logs: every quarter
            quarter = int(4 * value / total) if total else 4
            if quarter != self._last_quarter:
                self._last_quarter = quarter
                self.stream.write("    " + format_bar(value, total) + "\n")
        self.stream.flush()

    def close(self):
        self._end_bar()


def _memory_now(torch, mps: bool) -> dict:
    out = {}
    try:
        import psutil

        out["rss"] = psutil.Process().memory_info().rss
    except Exception:
        pass
    if mps:
        try:
            out["mps_allocated"] = int(torch.mps.current_allocated_memory())
            out["mps_driver"] = int(torch.mps.driver_allocated_memory())
        except Exception:
            pass
    return out


class NodeRecorder:
    """Per-node seconds and peak memory from the executor's events; a sampler thread catches the
    peaks inside long nodes."""

    def __init__(self, prompt: dict, progress: ProgressPrinter | None = None, interval: float = 0.02):
        import torch

        from ...metal_kernels.probe import mps_available

        self.torch = torch
        self.mps = mps_available()
        self.cuda = torch.cuda.is_available()
        self.prompt = prompt
        self.progress = progress
        self.nodes: dict[str, dict] = {}
        self.current: str | None = None
        self.t0 = 0.0
        self.overall_peak: dict[str, int] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, args=(interval,), daemon=True,
                                        name="comfy-metal-memory")
        self._thread.start()

    def _entry(self, node_id: str) -> dict:
        node = self.prompt.get(node_id, {})
        return self.nodes.setdefault(node_id, {
            "class": node.get("class_type"), "title": (node.get("_meta") or {}).get("title"),
            "seconds": 0.0, "cached": False, "peak_memory": {}, "backend": None})

    def _peak(self, target: dict, now: dict):
        for k, v in now.items():
            target[k] = max(target.get(k, 0), v)

    def _sample(self, interval: float):
        while not self._stop.wait(interval):
            now = _memory_now(self.torch, self.mps)
            with self._lock:
                if self.current is not None:
                    self._peak(self.nodes[self.current]["peak_memory"], now)
                self._peak(self.overall_peak, now)

    def _begin(self, node_id: str):
        with self._lock:
            self._entry(node_id)
            self.current, self.t0 = node_id, time.perf_counter()
            if self.cuda:
                try:
                    self.torch.cuda.reset_peak_memory_stats()
                except Exception:
                    pass
            self._peak(self.nodes[node_id]["peak_memory"], _memory_now(self.torch, self.mps))
        if self.progress:
            self.progress.node(node_id, self.nodes[node_id]["class"])

    def _finish(self):
        with self._lock:
            if self.current is None:
                return
            entry = self.nodes[self.current]
            entry["seconds"] = round(entry["seconds"] + time.perf_counter() - self.t0, 4)
            now = _memory_now(self.torch, self.mps)
            if self.cuda:
                try:
                    now["cuda"] = int(self.torch.cuda.max_memory_allocated())
                except Exception:
                    pass
            self._peak(entry["peak_memory"], now)
            self._peak(self.overall_peak, now)
            self.current = None

    def on_event(self, event: str, data: Any):
        if not isinstance(data, dict):
            return
        if event == "execution_cached":
            with self._lock:
                for node_id in data.get("nodes") or ():
                    self._entry(str(node_id))["cached"] = True
        elif event == "executing":
            self._finish()
            if data.get("node") is not None:
                self._begin(str(data["node"]))
        elif event in ("execution_success", "execution_error", "execution_interrupted"):
            self._finish()

    def close(self):
        self._finish()
        self._stop.set()
        self._thread.join(timeout=2)


# --------------------------------------------------------------------------------------------
# ComfyUI in this process
# --------------------------------------------------------------------------------------------

def _status_modules() -> list:
    """Every loaded copy of this pack's nodes/status (ComfyUI loads the pack under its own name)."""
    target = (pathlib.Path(__file__).parents[1] / "status" / "__init__.py").resolve()
    found = []
    for name, module in list(sys.modules.items()):
        if not name.endswith("nodes.status") or module is None:
            continue
        try:
            if pathlib.Path(getattr(module, "__file__", "") or "").resolve() == target:
                found.append(module)
        except OSError:
            continue
    return found


def _output_files(outputs: dict, out_dir: pathlib.Path) -> list[str]:
    files = []
    for ui in (outputs or {}).values():
        if not isinstance(ui, dict):
            continue
        for items in ui.values():
            if not isinstance(items, list):
                continue
            for item in items:
                if isinstance(item, dict) and item.get("type") == "output" and item.get("filename"):
                    path = out_dir / (item.get("subfolder") or "") / item["filename"]
                    files.append(str(path))
    return files


def _error_text(status_messages: list) -> str:
    for event, data in status_messages:
        if event == "execution_error":
            tb = "".join(data.get("traceback") or [])
            return (f"node {data.get('node_id')} ({data.get('node_type')}) raised {data.get('exception_type')}: "
                    f"{data.get('exception_message')}\n{tb}").rstrip()
        if event == "execution_interrupted":
            return f"interrupted at node {data.get('node_id')} ({data.get('node_type')})"
    return "execution failed"


def _validation_text(error: dict | None, node_errors: dict | None) -> str:
    lines = []
    if error:
        lines.append(f"{error.get('message', '')}: {error.get('details', '')}".rstrip(": "))
    for node_id, info in (node_errors or {}).items():
        for reason in info.get("errors", []):
            lines.append(f"  node {node_id} ({info.get('class_type')}): {reason.get('message')}: "
                         f"{reason.get('details')}")
    return "\n".join(lines) or "the workflow failed validation"


def attach_backends(nodes_out: dict[str, dict], records: list[dict]) -> None:
    """Put each status record (nodes/status record_node_backend) on its node: by node id, else
    (records made without ComfyUI's executing context) on the nodes of its class."""
    by_class: dict[str, dict] = {}
    for rec in sorted(records, key=lambda r: r.get("time") or 0):
        node_id = rec.get("node_id")
        if node_id is not None and str(node_id) in nodes_out:
            nodes_out[str(node_id)]["backend"] = rec
        elif rec.get("node_class"):
            by_class[rec["node_class"]] = rec
    for entry in nodes_out.values():
        if entry.get("backend") is None and entry.get("class") in by_class:
            entry["backend"] = by_class[entry["class"]]


def write_json_atomic(path: pathlib.Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, default=str)
        f.write("\n")
    os.replace(tmp, path)


class HeadlessComfyUI:
    """ComfyUI imported into this process with this pack loaded; one per process (ComfyUI keeps
    global state and parses its command line once)."""

    def __init__(self, comfyui: pathlib.Path, out: pathlib.Path, models: pathlib.Path | None = None,
                 force_cpu: bool = False, load_custom_nodes: bool = False, comfy_args=()):
        self.comfyui, self.out, self.models = comfyui, out, models
        self.comfy_args = list(comfy_args)
        self.force_cpu, self.load_custom_nodes = force_cpu, load_custom_nodes
        self.loop: asyncio.AbstractEventLoop | None = None
        self.server = None
        self.recorder: NodeRecorder | None = None
        self.progress: ProgressPrinter | None = None
        self.temp_dir: str | None = None
        self.device = "cpu"

    # -- startup -----------------------------------------------------------------------------

    def _parse_comfy_args(self):
        import torch

        from ...metal_kernels.probe import mps_available

        gpu = torch.cuda.is_available() or mps_available()
        self.device = "cpu" if self.force_cpu or not gpu else ("cuda" if torch.cuda.is_available() else "mps")
        if "comfy.cli_args" in sys.modules:
            return  # already parsed in this process
        argv = [str(self.comfyui / "main.py"), "--disable-auto-launch", "--database-url", "sqlite:///:memory:"]
        if self.device == "cpu":
            argv.append("--cpu")
        argv += self.comfy_args
        saved = sys.argv
        sys.argv = argv
        try:
            import comfy.options

            comfy.options.enable_args_parsing()
            import comfy.cli_args  # noqa: F401  (parses sys.argv once, at import)
        except SystemExit as e:  # argparse rejected an option of --comfy-args (its message is above)
            raise RunError(f"ComfyUI rejected its command line {' '.join(argv[1:])} (exit {e.code})") from None
        finally:
            sys.argv = saved

    def start(self) -> None:
        if str(self.comfyui) not in sys.path:
            sys.path.insert(0, str(self.comfyui))
        self._parse_comfy_args()
        import folder_paths
        folder_paths.set_output_directory(str(self.out))
        self.temp_dir = tempfile.mkdtemp(prefix="comfy-metal-run-temp-")
        folder_paths.set_temp_directory(os.path.join(self.temp_dir, "temp"))
        # ComfyUI's server object keeps browser settings in the user directory: a throwaway one, so a
        # headless run writes nothing into the ComfyUI folder.
        folder_paths.set_user_directory(os.path.join(self.temp_dir, "user"))
        os.makedirs(os.path.join(self.temp_dir, "user"), exist_ok=True)  # (else ComfyUI warns it created one)
        if self.models is not None:
            for sub in sorted(p for p in self.models.iterdir() if p.is_dir()):
                folder_paths.add_model_folder_path(sub.name, str(sub), is_default=True)

        import comfy.utils
        import execution
        import server

        nodes = importlib.import_module("nodes")   # ComfyUI's nodes.py (its folder is first on sys.path)

        self.execution, self.nodes = execution, nodes
        self.loop = asyncio.new_event_loop()
        recorder_box = self

        class HeadlessPromptServer(server.PromptServer):
            """ComfyUI's server object, not listening: the executor's events also feed the run's
            timing and progress."""

            def send_sync(self, event, data, sid=None):
                if recorder_box.recorder is not None:
                    recorder_box.recorder.on_event(event, data)
                super().send_sync(event, data, sid)

        self.server = HeadlessPromptServer(self.loop)
        self.server.client_id = CLIENT_ID  # the executor reports each node only to a client
        hook_breaker = _optional_import("hook_breaker_ac10a0")
        if hook_breaker is not None:
            hook_breaker.save_functions()
        try:
            self.loop.run_until_complete(nodes.init_extra_nodes(init_custom_nodes=self.load_custom_nodes,
                                                                init_api_nodes=False))
            loaded = {os.path.realpath(p) for p in getattr(nodes, "LOADED_MODULE_DIRS", {}).values()}
            if os.path.realpath(PACK_ROOT) not in loaded:
                builtin = set(nodes.NODE_CLASS_MAPPINGS)
                ok = self.loop.run_until_complete(
                    nodes.load_custom_node(str(PACK_ROOT), builtin, module_parent="custom_nodes"))
                if not ok:
                    raise RunError(f"ComfyUI could not load the Comfy Metal pack from {PACK_ROOT} "
                                   "(its error is logged above)", EXIT_FAILED)
        finally:
            if hook_breaker is not None:
                hook_breaker.restore_functions()
        comfy.utils.set_progress_bar_global_hook(self._progress_hook)

    def _progress_hook(self, value, total, preview_image=None, prompt_id=None, node_id=None):
        if self.progress is not None:
            self.progress.progress(value, total)

    # -- running -----------------------------------------------------------------------------

    def execute(self, prompt: dict, workflow_path: pathlib.Path) -> dict:
        execution = self.execution
        prompt_id = str(uuid.uuid4())
        status_mods = _status_modules()
        marks = {id(m): m.records_since(0)[1] for m in status_mods}
        summary: dict[str, Any] = {
            "workflow": str(workflow_path.resolve()), "prompt_id": prompt_id, "success": False, "error": None,
            "comfyui": {"path": str(self.comfyui), "version": _comfyui_version()},
            "device": self.device, "torch": _torch_version(),
            "backend_setting": os.environ.get("COMFY_METAL_BACKEND", "auto"),
            "seconds": 0.0, "peak_memory": {}, "nodes": {}, "outputs": {}, "files": [],
        }
        valid, error, targets, node_errors = self.loop.run_until_complete(
            execution.validate_prompt(prompt_id, prompt, None))
        if not valid:
            summary["error"] = _validation_text(error, node_errors)
            summary["node_errors"] = node_errors
            return summary
        self.progress = ProgressPrinter(sys.stderr, total_nodes=len(prompt))
        self.recorder = NodeRecorder(prompt, self.progress)
        executor = execution.PromptExecutor(self.server, cache_type=execution.CacheType.CLASSIC,
                                            cache_args={"lru": 0, "ram": 0, "ram_inactive": 0})
        t0 = time.perf_counter()
        try:
            executor.execute(prompt, prompt_id, {"client_id": CLIENT_ID}, targets)
        finally:
            summary["seconds"] = round(time.perf_counter() - t0, 3)
            self.recorder.close()
            self.progress.close()
            self._drain_messages()
        summary["success"] = bool(executor.success)
        if not executor.success:
            summary["error"] = _error_text(executor.status_messages)
        history = getattr(executor, "history_result", None) or {}
        summary["outputs"] = history.get("outputs", {})
        summary["files"] = _output_files(summary["outputs"], self.out)
        summary["peak_memory"] = dict(self.recorder.overall_peak)
        nodes_out = {nid: dict(entry) for nid, entry in self.recorder.nodes.items()}
        records = [rec for module in status_mods for rec in module.records_since(marks.get(id(module), 0))[0]]
        attach_backends(nodes_out, records)
        summary["nodes"] = nodes_out
        return summary

    def _drain_messages(self):
        # send_sync queues onto the (not running) server loop; run those callbacks and drop them.
        if self.loop is None or self.loop.is_closed():
            return
        self.loop.run_until_complete(asyncio.sleep(0))
        while not self.server.messages.empty():
            self.server.messages.get_nowait()

    def close(self):
        if self.recorder is not None:
            self.recorder.close()
        if self.temp_dir:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
        if self.loop is not None and not self.loop.is_closed():
            self.loop.close()


def _optional_import(name: str):
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _comfyui_version() -> str | None:
    module = _optional_import("comfyui_version")
    return getattr(module, "__version__", None)


def _torch_version() -> str:
    import torch

    return torch.__version__
