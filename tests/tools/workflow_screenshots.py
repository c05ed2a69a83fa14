"""Screenshots of the example workflows (workflows/*.json) as ComfyUI's own frontend shows them.

    COMFYUI_PATH=/work/comfyui python tests/tools/workflow_screenshots.py [--out DIR] [NAME ...]

Starts a real ComfyUI server (tests/helpers/comfyui_env.comfyui_server: 127.0.0.1, free port, temporary base
directory, the pack as a custom node) whose model folders hold tiny random models of the right
architectures (tests/workflow_models.py) under exactly the file names the workflows expect, so the
frontend finds every model and shows no "errors found" toast or red outlines. Headless Chromium
loads each UI workflow (a fresh page each) and keeps the view it opens with (its saved `extra.ds`,
fitted by build_workflows.py for this 1400x800 page): the picture is what a user sees on opening it,
the frontend's menus, sidebar and minimap included. It renders at 2x (SHOT_SCALE, a Retina screen) and
downscales to 1400x800 (smoother small text), and saves workflows/screenshots/<name>.png as an optimized
256-colour palette PNG (<= 150 KB each). Without NAME arguments it also saves metal_tab.png: the Metal
sidebar tab (its first screen: the verdict, what to do, memory; Details collapsed) beside a Comfy Metal
Status node that ran, and metal_tab_details.png: the same with the tab's Details open.

Fails (exit 1) if a workflow's model file is missing from the server's lists, if the frontend
shows an error toast ("N errors found") or marks a node with
errors, or if a PNG ends up larger than the limit. Runtime ~1 min.
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import pathlib
import shutil
import sys
import tempfile
import time

TOOLS = pathlib.Path(__file__).resolve().parent
TESTS = TOOLS.parent
ROOT = TESTS.parent
for p in (TESTS, TESTS / "helpers", TOOLS):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import build_workflows as bw  # noqa: E402
import comfyui_env  # noqa: E402
import headless_chromium  # noqa: E402

OUT_DIR = ROOT / "workflows" / "screenshots"
TAB_SHOT = "metal_tab"         # the Metal tab and a Comfy Metal Status node after a run
DETAILS_SHOT = "metal_tab_details"   # the same with the tab's Details open
WIDTH, HEIGHT = 1400, 800
MAX_BYTES = 150 * 1024
TOTAL_TIMEOUT = 600          # seconds for the whole browser session
SETTINGS = {                 # a new user's frontend (stored in the temporary user dir), less the debug overlay
    "Comfy.TutorialCompleted": True,
    "Comfy.Graph.CanvasInfo": False,
    "Comfy.Workflow.Persist": False,
}
SCALE = int(os.environ.get("SHOT_SCALE", "2"))  # rendered at 2x, downscaled: smoother small text


# ------------------------------------------------------------------------------------ models

class _ModelDirs:
    """What workflow_models.place_models needs of a ComfyUI: the server's default model folders."""

    def __init__(self, base: pathlib.Path):
        self.base = base

    def models_dir(self, kind: str) -> pathlib.Path:
        path = self.base / "models" / kind
        path.mkdir(parents=True, exist_ok=True)
        return path

    def refresh_models(self) -> None:
        pass


def place_models(comfyui_path: pathlib.Path, base: pathlib.Path) -> dict:
    """Tiny random models under the workflows' file names in base/models/<folder>/ (ComfyUI's own
    model classes build them, so ComfyUI is imported here, CPU only)."""
    if str(comfyui_path) not in sys.path:
        sys.path.insert(0, str(comfyui_path))
    stubs = comfyui_env.stubs_path()
    if stubs is not None and str(stubs) not in sys.path:
        sys.path.append(str(stubs))
    # comfy.cli_args parses sys.argv at import: parse ComfyUI's own --cpu args, as the test harness does
    comfyui_env.ComfyUIHarness(comfyui_path, base)._parse_args()
    import workflow_models as wm

    roles = {role: file for file, role in bw.TEST_ROLES.items()}
    return wm.place_models(_ModelDirs(base), roles)


def check_model_lists(server, workflows: dict) -> list[str]:
    """Every model file value of every workflow is among the choices the server offers."""
    info = server.get_json("/object_info", timeout=120)
    problems = []
    for name, wf in workflows.items():
        for node in wf["nodes"]:
            spec = info.get(node["type"], {}).get("input", {})
            combos = {k: v[0] for part in ("required", "optional") for k, v in spec.get(part, {}).items()
                      if isinstance(v, list) and v and isinstance(v[0], list)}
            for value in node.get("widgets_values") or []:
                if bw.is_file_choice(value) and not any(value in choices for choices in combos.values()):
                    problems.append(f"{name}: node {node['id']} ({node['type']}): {value!r} is not offered")
    return problems


# ------------------------------------------------------------------------------------ browser

PAGE_STATE_JS = r"""
(() => {
  const app = window.comfyAPI.app.app;
  const toasts = [...document.querySelectorAll('.p-toast-message')].map((t) => t.innerText.trim());
  const found = document.body.innerText.match(/\d+ errors? found[^\n]*/gi) || [];
  const errorNodes = app.graph.nodes.filter((n) => n.has_errors).map((n) => `${n.id} ${n.type}`);
  return { toasts: [...toasts, ...found], errorNodes, nodes: app.graph.nodes.length };
})()
"""


# The Metal tab next to a Comfy Metal Status node that has run (its report on the node).
TAB_JS = r"""
(async () => {
  const app = window.comfyAPI.app.app, api = window.comfyAPI.api.api;
  app.graph.clear();
  const node = LiteGraph.createNode("MetalStatus");
  node.pos = [400, 130];          // right of the open tab, at its default size
  app.graph.add(node);
  app.canvas.ds.scale = 1; app.canvas.ds.offset = [0, 0];
  const prompt = { [String(node.id)]: { class_type: "MetalStatus", inputs: {} } };
  await api.fetchApi("/prompt", { method: "POST", headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ prompt, client_id: api.clientId }) });
  window.__shotNode = node;
  await app.extensionManager.sidebarTab.toggleSidebarTab("comfy-metal");
  return node.id;
})()
"""
TAB_READY_JS = ("(() => { const w = window.__shotNode?.widgets?.find((x) => x.name === 'report');"
                " const body = document.querySelector('.comfy-metal-panel .comfy-metal-verdict');"
                " return !!(w && String(w.value).length > 20 && body && body.textContent); })()")


async def _browser(url: str, chromium: str, workflows: dict, out: pathlib.Path, tab: bool = True) -> dict:
    report = {}
    async with headless_chromium.open_page(chromium, WIDTH, HEIGHT, extra_flags=("--hide-scrollbars",),
                                           profile_prefix="comfy-metal-shots-chromium-") as cdp:

        async def wait_for(expression, what, timeout=120):
            await cdp.wait_for(expression, timeout, guard=False, message=what)

        await cdp.call("Page.enable")
        await cdp.call("Runtime.enable")
        await cdp.call("Emulation.setDeviceMetricsOverride", width=WIDTH, height=HEIGHT, deviceScaleFactor=SCALE,
                       mobile=False)
        out.mkdir(parents=True, exist_ok=True)
        for name, wf in workflows.items():
            # a fresh page per workflow: one tab, no leftovers from the previous one
            cdp.events.clear()   # console events are not looked at here
            await cdp.call("Page.navigate", url=url)
            await wait_for("!!(window.comfyAPI?.app?.app?.graph && window.comfyAPI.app.app.canvas"
                           " && Object.keys(LiteGraph.registered_node_types).length > 100)",
                           "the ComfyUI frontend did not come up")
            await wait_for("window.comfyAPI.app.app.graph.nodes.length > 0",
                           "the frontend never loaded its first workflow")
            await asyncio.sleep(2)
            await cdp.evaluate(f"window.comfyAPI.app.app.loadGraphData(JSON.parse({json.dumps(json.dumps(wf))}),"
                               f" true, true, {json.dumps(name)})")
            await wait_for(f"window.comfyAPI.app.app.graph.nodes.length === {len(wf['nodes'])}",
                           f"{name}: the graph was not loaded", timeout=60)
            await asyncio.sleep(1.5)          # validation toasts (if any) appear after the load
            state = await cdp.evaluate(PAGE_STATE_JS)
            scale = await cdp.evaluate("window.comfyAPI.app.app.canvas.ds.scale")
            shot = await cdp.call("Page.captureScreenshot", format="png")
            raw = base64.b64decode(shot["data"])
            report[name] = {"state": state, "scale": scale, "raw_bytes": len(raw), **save_png(raw, out / f"{name}.png")}
        if tab:
            await cdp.call("Page.navigate", url=url)
            await wait_for("!!(window.comfyAPI?.app?.app?.graph && window.comfyMetal)", "the frontend did not come up")
            await asyncio.sleep(2)
            await cdp.evaluate(TAB_JS)
            await wait_for(TAB_READY_JS, "the status node's report or the Metal tab did not show", timeout=120)
            await asyncio.sleep(1.5)
            shot = await cdp.call("Page.captureScreenshot", format="png")
            raw = base64.b64decode(shot["data"])
            report[TAB_SHOT] = {"state": {"toasts": [], "errorNodes": [], "nodes": 1}, "scale": 1.0,
                                "raw_bytes": len(raw), **save_png(raw, out / f"{TAB_SHOT}.png")}
            await cdp.evaluate("document.querySelector('.comfy-metal-panel details.comfy-metal-details summary').click()")
            await asyncio.sleep(1)
            shot = await cdp.call("Page.captureScreenshot", format="png")
            raw = base64.b64decode(shot["data"])
            report[DETAILS_SHOT] = {"state": {"toasts": [], "errorNodes": [], "nodes": 1}, "scale": 1.0,
                                    "raw_bytes": len(raw), **save_png(raw, out / f"{DETAILS_SHOT}.png")}
    return report


def save_png(raw: bytes, path: pathlib.Path) -> dict:
    """The screenshot as a 256-colour palette PNG (the UI is flat colours; text stays crisp), written
    atomically; falls back to fewer colours only if the limit needs it."""
    from PIL import Image

    with Image.open(io.BytesIO(raw)) as im:
        rgb = im.convert("RGB")
    if rgb.size != (WIDTH, HEIGHT):
        rgb = rgb.resize((WIDTH, HEIGHT), Image.Resampling.LANCZOS)
    for colors in (256, 128, 64):
        pal = rgb.quantize(colors=colors, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
        buf = io.BytesIO()
        pal.save(buf, format="PNG", optimize=True)
        if buf.tell() <= MAX_BYTES:
            break
    tmp = path.with_suffix(".png.tmp")
    tmp.write_bytes(buf.getvalue())
    os.replace(tmp, path)
    return {"size": rgb.size, "bytes": buf.tell(), "colors": colors}


# ------------------------------------------------------------------------------------ main

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", help=f"workflows (default: all of {sorted(bw.WORKFLOWS)})")
    ap.add_argument("--out", type=pathlib.Path, default=OUT_DIR)
    ap.add_argument("--keep", action="store_true", help="keep the temporary server directory")
    args = ap.parse_args(argv)

    comfyui_path, reason = comfyui_env.comfyui_path_or_reason()
    if comfyui_path is None:
        print(reason, file=sys.stderr)
        return 2
    chromium = headless_chromium.chromium_path()
    if chromium is None:
        print("chromium is not installed", file=sys.stderr)
        return 2
    names = args.names or sorted(bw.WORKFLOWS)
    unknown = sorted(set(names) - set(bw.WORKFLOWS))
    if unknown:
        print(f"unknown workflows: {unknown}", file=sys.stderr)
        return 2
    workflows = {n: json.loads((bw.WORKFLOWS_DIR / f"{n}.json").read_text()) for n in names}

    work = pathlib.Path(tempfile.mkdtemp(prefix="comfy-metal-shots-"))
    try:
        t0 = time.monotonic()
        placed = place_models(comfyui_path, work / "base")   # comfyui_server uses <work>/base as base dir
        print(f"placed {len(placed)} tiny models in {time.monotonic() - t0:.1f}s")
        (work / "base" / "user" / "default").mkdir(parents=True, exist_ok=True)
        (work / "base" / "user" / "default" / "comfy.settings.json").write_text(json.dumps(SETTINGS))
        with comfyui_env.comfyui_server(comfyui_path, work) as server:
            problems = check_model_lists(server, workflows)
            if problems:
                print("\n".join(problems), file=sys.stderr)
                return 1
            report = asyncio.run(asyncio.wait_for(_browser(server.url, chromium, workflows, args.out,
                                                           tab=not args.names), TOTAL_TIMEOUT))
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)

    failed = False
    for name, r in report.items():
        st = r["state"]
        bad = [t for t in st["toasts"] if t] + [f"node with errors: {n}" for n in st["errorNodes"]]
        if r["bytes"] > MAX_BYTES:
            bad.append(f"{r['bytes']} bytes > {MAX_BYTES}")
        failed |= bool(bad)
        print(f"{name}.png: {r['size'][0]}x{r['size'][1]}, {r['bytes'] / 1024:.1f} KB "
              f"({r['colors']} colours; raw {r['raw_bytes'] / 1024:.0f} KB), {st['nodes']} nodes, zoom {r['scale']:.2f}"
              + (f"  PROBLEMS: {bad}" if bad else ""))
    print(f"written to {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
