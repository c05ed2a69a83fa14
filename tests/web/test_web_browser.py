"""The frontend extension in headless Chromium against a real ComfyUI server with the pack
(COMFYUI_PATH; skipped when chromium or ComfyUI is missing).

Drives Chromium through the DevTools protocol (aiohttp's websocket client), as a new user would:
- with no model installed, each shipped workflow's Missing Models list names every file it loads with its
  folder (the workflows' `models` entries), and the MoE workflow's missing model folder gets the pack's toast
  with its download location;
- with the models in place: the page loads the extension, the route answers, a badge attached to a node is
  drawn by litegraph with the backend from a `comfy_metal.backend` event, the Comfy Metal Status node shows
  the plain-words verdict after a real run, the "Metal" sidebar tab leads with its verdict line (visible,
  words only) and keeps the rest in a collapsed Details whose force-reference switch changes the server's
  setting and ComfyUI's, and each shipped workflow opens at a readable zoom (>= 0.6) with its Note and first
  nodes inside the visible, uncovered part of the canvas;
- no console warning or error comes from the pack (by its text or its stack).
Server and browser listen on 127.0.0.1 only (requests to the model hosts are blocked) and are stopped at the
end of the test.
"""
from __future__ import annotations

import asyncio
import json
import pathlib

import pytest

import comfyui_env
import headless_chromium


def _chromium() -> str:
    path = headless_chromium.chromium_path()
    if path:
        return path
    reason = "chromium is not installed (apt-get install -y chromium): headless browser test skipped"
    print(reason)
    pytest.skip(reason)


# Runs in the page: a real LGraphNode standing in for a pack node (a class the status route lists as the
# pack's), our nodeCreated hook once the pack's node list is known, a backend event through ComfyUI's api, then a canvas redraw.
BADGE_JS = r"""
(async () => {
  const app = window.comfyAPI.app.app, api = window.comfyAPI.api.api;
  const ext = app.extensions.find((e) => e.name === "comfy_metal.status");
  await window.comfyMetal.refreshStatus();
  const node = LiteGraph.createNode("EmptyImage");
  node.comfyClass = "MetalStatus";
  node.title = "Metal node (test)";
  node.pos = [520, 160];
  app.graph.add(node);
  ext.nodeCreated(node);
  const ours = () => node.badges.map((b) => (typeof b === "function" ? b() : b)).filter((b) => b.tooltip !== undefined);
  const before = ours().map((b) => b.visible);
  api.dispatchCustomEvent("comfy_metal.backend", { node_id: String(node.id), node_class: "MetalStatus",
    backend: "reference", reason: "forced by COMFY_METAL_BACKEND/COMFY_METAL_REFERENCE", kernels: {}, time: Date.now() / 1000 });
  app.canvas.setDirty(true, true);
  app.canvas.draw(true, true);
  await new Promise((r) => requestAnimationFrame(() => requestAnimationFrame(r)));
  app.canvas.draw(true, true);
  const badge = ours()[0];
  return { before, text: badge.text, tooltip: badge.tooltip, visible: badge.visible,
           drawnRect: Array.from(badge.boundingRect), sameObject: ours()[0] === badge };
})()
"""


# Runs in the page: the pack's MetalStatus node on the canvas, queued for real; its backend arrives
# over the websocket (event comfy_metal.backend) and its badge shows it.
QUEUE_JS = r"""
(async () => {
  const app = window.comfyAPI.app.app, api = window.comfyAPI.api.api;
  const node = LiteGraph.createNode("MetalStatus");
  node.pos = [520, 420];
  app.graph.add(node);
  const prompt = { [String(node.id)]: { class_type: "MetalStatus", inputs: {} } };
  const res = await api.fetchApi("/prompt", { method: "POST", headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ prompt, client_id: api.clientId }) });
  window.__metalStatusNode = node;
  return { status: res.status, id: node.id, hasBadge: !!node.__comfyMetalBadge };
})()
"""
STATUS_REPORT_JS = r"""
(() => { const n = window.__metalStatusNode;
  const w = n.widgets?.find((x) => x.name === "report");
  const el = w?.element;
  return w && String(w.value).startsWith("No Apple GPU here") ? { value: w.value, readOnly: !!el?.readOnly,
    size: Array.from(n.size), titleWidth: app_title_width(n) } : null;
  function app_title_width(node) {
    const ctx = document.createElement("canvas").getContext("2d");
    ctx.font = `${LiteGraph.NODE_TEXT_SIZE ?? 14}px ${LiteGraph.NODE_FONT ?? "Arial"}`;
    return ctx.measureText(node.title).width;
  }
})()
"""
# The Metal tab after the status route answered: its first line (the verdict), whether the user sees it, the
# collapsed Details and what is in it.
TAB_JS = r"""
(() => { const body = document.querySelector('.comfy-metal-panel .comfy-metal-body');
  const verdict = body?.querySelector('.comfy-metal-verdict');
  if (!verdict || !verdict.textContent) return null;
  const r = verdict.getBoundingClientRect();
  const hit = document.elementFromPoint(r.left + Math.min(20, r.width / 2), r.top + r.height / 2);
  const details = body.querySelector('details.comfy-metal-details');
  return { first: body.firstElementChild === verdict, verdict: verdict.textContent,
    visible: r.width > 0 && r.height > 0 && r.top >= 0 && r.bottom <= window.innerHeight && verdict.contains(hit),
    detailsOpen: details?.open, shown: body.innerText,
    features: [...body.querySelectorAll('.comfy-metal-group')].map((g) => g.dataset.feature),
    hasSwitch: !!details?.querySelector('input.comfy-metal-force'),
    checked: body.querySelector('input.comfy-metal-force')?.checked,
    text: body.textContent };
})()
"""
CLICK_SWITCH_JS = r"""
(() => { const details = document.querySelector('.comfy-metal-panel details.comfy-metal-details');
  if (!details.open) details.querySelector('summary').click();
  const box = details.querySelector('input.comfy-metal-force'); box.click(); return box.checked; })()
"""
# Loads a UI workflow as a user's drag-and-drop does (no model installed), opens the errors panel as the
# "View details" of the frontend's toast does, and returns what the Missing Models list and the toasts say.
MISSING_JS = r"""
(async (workflow) => {
  const app = window.comfyAPI.app.app;
  await app.loadGraphData(workflow);
  for (let i = 0; i < 40 && !document.body.innerText.includes('Missing Models'); i++) {
    [...document.querySelectorAll('button')].find((b) => b.innerText.trim() === 'View details')?.click();
    await new Promise((r) => setTimeout(r, 250));
  }
  await new Promise((r) => setTimeout(r, 500));
  return { text: document.body.innerText,
    toasts: [...document.querySelectorAll('.p-toast-message')].map((t) => t.innerText) };
})
"""
# Loads a UI workflow as a user's drag-and-drop does, then reports every node's box on the screen and
# what the page shows at its corners (the canvas, or a node's own text box; not the menu or a panel).
LOAD_WORKFLOW_JS = r"""
(async (workflow) => {
  const app = window.comfyAPI.app.app;
  await app.loadGraphData(workflow);
  await new Promise((r) => requestAnimationFrame(() => requestAnimationFrame(r)));
  app.canvas.draw(true, true);
  await new Promise((r) => setTimeout(r, 300));
  const canvas = app.canvas.canvas, title = LiteGraph.NODE_TITLE_HEIGHT;
  const ds = app.canvas.ds, rect = canvas.getBoundingClientRect();
  const covered = (x, y) => {
    const el = document.elementFromPoint(x, y);
    if (!el) return "nothing";
    if (el === canvas || el.closest('.dom-widget, .dom-widgets, .comfy-multiline-input') || el.tagName === 'TEXTAREA') return null;
    return `${el.tagName}.${String(el.className).slice(0, 80)}: ${el.textContent.slice(0, 120)}`;
  };
  const nodes = app.graph._nodes.map((n) => {
    const [x0, y0] = ds.convertOffsetToCanvas([n.pos[0], n.pos[1] - title]);
    const [x1, y1] = ds.convertOffsetToCanvas([n.pos[0] + n.size[0], n.pos[1] + n.size[1]]);
    const box = [x0 + rect.left, y0 + rect.top, x1 + rect.left, y1 + rect.top];
    const inset = 3;
    const corners = [[box[0] + inset, box[1] + inset], [box[2] - inset, box[1] + inset],
                     [box[0] + inset, box[3] - inset], [box[2] - inset, box[3] - inset]];
    return { id: n.id, type: n.type, box, covers: corners.map(([x, y]) => covered(x, y)).filter(Boolean) };
  });
  return { scale: ds.scale, width: window.innerWidth, height: window.innerHeight, nodes };
})
"""
BADGE_TEXT_JS = r"""
(() => { const n = window.__metalStatusNode;
  const b = n.badges.map((x) => (typeof x === "function" ? x() : x)).find((x) => x.tooltip !== undefined);
  return b && b.visible ? { text: b.text, tooltip: b.tooltip } : null; })()
"""


WORKFLOWS = pathlib.Path(__file__).resolve().parents[2] / "workflows"


async def _open_app(cdp, url: str) -> None:
    await cdp.call("Page.navigate", url=url)
    await cdp.wait_for("!!(window.comfyAPI?.app?.app?.extensions?.some"
                       "((e) => e.name === 'comfy_metal.status') && window.comfyMetal)")
    await cdp.wait_for("!!window.comfyAPI.app.app.canvas && !!window.comfyAPI.app.app.graph")
    await cdp.wait_for("window.comfyAPI.app.app.graph.nodes.length > 0")    # its first (default) workflow


async def _drive(url: str, chromium: str, shots: pathlib.Path, place_models):
    import base64

    async with headless_chromium.open_page(chromium, 1400, 900) as cdp:
        for domain in ("Page", "Runtime", "Log", "Network"):
            await cdp.call(f"{domain}.enable")
        # the Missing Models list asks the model hosts for file sizes: nothing leaves this machine
        await cdp.call("Network.setBlockedURLs", urls=["*huggingface.co*", "*civitai.com*"])
        shots.mkdir(parents=True, exist_ok=True)
        results = {"missing": {}}
        # 1. no model installed: each workflow's Missing Models list and the pack's folder toast
        await _open_app(cdp, url)
        for path in sorted(WORKFLOWS.glob("*.json")):
            if not path.name.endswith(".api.json"):
                results["missing"][path.stem] = await cdp.evaluate(f"({MISSING_JS})({path.read_text()})")
                shot = await cdp.call("Page.captureScreenshot", format="png")
                (shots / f"missing_{path.stem}.png").write_bytes(base64.b64decode(shot["data"]))
        # 2. the models in place (empty files under their names), the errors panel closed, the page opened afresh
        place_models()
        await cdp.evaluate("window.comfyAPI.app.app.extensionManager.setting.set('Comfy.RightSidePanel.IsOpen', false)")
        await _open_app(cdp, url)
        results["status"] = await cdp.wait_for(
            "window.comfyAPI.api.api.fetchApi('/comfy_metal/status').then((r) => r.json())")
        results["memory"] = await cdp.evaluate(
            "window.comfyAPI.api.api.fetchApi('/comfy_metal/memory').then((r) => r.json())")
        results["setting"] = await cdp.evaluate(
            "window.comfyAPI.app.app.extensionManager.setting.get('ComfyMetal.ForceReference')")
        results["badge"] = await cdp.evaluate(BADGE_JS)
        results["queued"] = await cdp.evaluate(QUEUE_JS)
        results["live_badge"] = await cdp.wait_for(BADGE_TEXT_JS, timeout=120)
        # the sidebar tab: registered, and its panel leads with the verdict
        tabs = await cdp.evaluate(
            "window.comfyAPI.app.app.extensionManager.sidebarTab.sidebarTabs.map((t) => t.id)")
        results["tabs"] = tabs
        await cdp.evaluate(
            "window.comfyAPI.app.app.extensionManager.sidebarTab.toggleSidebarTab('comfy-metal')")
        results["report"] = await cdp.wait_for(STATUS_REPORT_JS, timeout=120)
        results["tab"] = await cdp.wait_for(TAB_JS, timeout=60)
        await asyncio.sleep(1)
        shot = await cdp.call("Page.captureScreenshot", format="png")
        (shots / "comfy_metal_sidebar.png").write_bytes(base64.b64decode(shot["data"]))
        # the switch in the tab's Details: the server's setting and ComfyUI's setting follow it, both ways
        results["switch_on"] = await cdp.evaluate(CLICK_SWITCH_JS)
        results["forced"] = await cdp.wait_for(
            "window.comfyAPI.api.api.fetchApi('/comfy_metal/status').then((r) => r.json())"
            ".then((s) => s.force_reference ? [s.force_reference, window.comfyAPI.app.app.extensionManager"
            ".setting.get('ComfyMetal.ForceReference')] : null)", timeout=30)
        await cdp.wait_for("document.querySelector('.comfy-metal-panel input.comfy-metal-force')?.checked || null")
        results["forced_tab"] = await cdp.wait_for(
            f"(({TAB_JS.strip()})?.text ?? '').includes('switched off by Force reference') ? ({TAB_JS.strip()}) : null",
            timeout=30)
        results["switch_off"] = await cdp.evaluate(CLICK_SWITCH_JS)
        results["unforced"] = await cdp.wait_for(
            "window.comfyAPI.api.api.fetchApi('/comfy_metal/status').then((r) => r.json())"
            ".then((s) => s.force_reference === false ? [s.force_reference, window.comfyAPI.app.app.extensionManager"
            ".setting.get('ComfyMetal.ForceReference')] : null)", timeout=30)
        # close the tab (a user loading a workflow sees the whole canvas), then each shipped workflow
        await cdp.evaluate(
            "window.comfyAPI.app.app.extensionManager.sidebarTab.toggleSidebarTab('comfy-metal')")
        results["workflows"] = {}
        for path in sorted(WORKFLOWS.glob("*.json")):
            if path.name.endswith(".api.json"):
                continue
            results["workflows"][path.stem] = await cdp.evaluate(f"({LOAD_WORKFLOW_JS})({path.read_text()})")
            shot = await cdp.call("Page.captureScreenshot", format="png")
            (shots / f"workflow_{path.stem}.png").write_bytes(base64.b64decode(shot["data"]))
        await asyncio.sleep(1)  # let late console messages arrive
        await cdp.evaluate("1")
        results["problems"] = cdp.problems()
        return results


def _post_setting(url: str, setting_id: str, value) -> None:
    import urllib.request

    req = urllib.request.Request(f"{url}/settings/{setting_id}", data=json.dumps(value).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status == 200


def _name_workflow_models(base: pathlib.Path) -> None:
    """Empty files (and the MoE folder's config.json) under the names the workflows use, so the model
    lists hold them and the frontend loads each workflow without a missing-models notice over the canvas
    (nothing here runs a model)."""
    import sys

    sys.path.insert(0, str(WORKFLOWS.parent / "tests" / "tools"))
    import build_workflows as bw

    for name in bw.WORKFLOWS:
        for folder, file in bw.model_files(name):
            target = base / "models" / folder / file
            if file.endswith("/"):
                target.mkdir(parents=True, exist_ok=True)
                (target / "config.json").write_text("{}")
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                target.touch()


def test_extension_in_headless_chromium(comfyui_path, tmp_path):
    pytest.importorskip("aiohttp", reason="aiohttp (a ComfyUI requirement) is not installed")
    chromium = _chromium()
    base = tmp_path / "server" / "base"          # comfyui_server's base directory
    with comfyui_env.comfyui_server(comfyui_path, tmp_path / "server") as server:
        # the route answers on the server's origin, with and without ComfyUI's /api prefix
        status = server.get_json("/comfy_metal/status")
        assert "softmax" in status["kernels"] and status["memory"]["device"] == "cpu"
        assert server.get_json("/api/comfy_metal/memory")["device"] == "cpu"
        extensions = server.get_json("/extensions")
        ours = [e for e in extensions if e.endswith("/comfy_metal.js")]
        assert ours, f"ComfyUI does not serve web/comfy_metal.js: {extensions}"
        # no first-run templates dialog over the screenshot (a user setting of the temporary server)
        _post_setting(server.url, "Comfy.TutorialCompleted", True)
        results = asyncio.run(_drive(server.url, chromium, tmp_path / "shots", lambda: _name_workflow_models(base)))
        log = server.log()
    print(f"screenshots: {tmp_path / 'shots'}")
    assert results["problems"] == [], results["problems"]
    import build_workflows as bw   # on sys.path since _name_workflow_models

    # 1. the Missing Models list: every file with its folder; the model folder in the pack's toast
    assert set(results["missing"]) == set(bw.WORKFLOWS)
    for name, seen in results["missing"].items():
        for spec in bw.model_specs(name):
            folder, file = spec[0], spec[1]
            if bw.is_folder(spec):
                toast = [t for t in seen["toasts"] if "a model folder is missing" in t]
                assert toast and file in toast[0] and bw.download_url(spec) in toast[0], (name, seen["toasts"])
                assert f"ComfyUI/models/{folder}/{file}" in toast[0]
            else:
                assert f"{file}\n{folder}" in seen["text"], (name, file, seen["text"][-3000:])
        assert "Unknown" not in seen["text"].split("Missing Models")[-1], (name, seen["text"][-3000:])
    # 2. with the models
    assert results["status"]["kernels"]["softmax"]["backend"] == "reference"
    assert results["memory"]["in_use"] > 0
    assert results["setting"] is False
    badge = results["badge"]
    assert badge["before"] == [False]  # no badge before the node ran
    assert badge["text"] == "Reference" and badge["visible"] is True and badge["sameObject"] is True
    assert badge["drawnRect"][2] > 0 and badge["drawnRect"][3] > 0  # litegraph drew it in the title bar
    assert "forced by COMFY_METAL_BACKEND" in badge["tooltip"]
    assert results["queued"]["status"] == 200 and results["queued"]["hasBadge"] is True
    live = results["live_badge"]  # real node, real execution, real websocket event
    assert live["text"] == "Reference", live
    assert "Metal runs only on MPS tensors" in live["tooltip"]
    report = results["report"]       # the status node's text after its real run: the verdict and a short list
    assert report["value"].startswith("No Apple GPU here: Comfy Metal runs its plain PyTorch code"), report
    assert report["readOnly"] and "Capabilities" not in report["value"] and "---" not in report["value"], report
    assert report["size"][0] >= report["titleWidth"] + 60, report   # its title is not cut
    assert "comfy-metal" in results["tabs"]
    tab = results["tab"]
    assert tab["first"] and tab["visible"], tab
    assert tab["verdict"] == results["status"]["summary"]["verdict"]
    assert tab["verdict"].startswith("No Apple GPU here: Comfy Metal runs its plain PyTorch code"), tab["verdict"]
    assert tab["detailsOpen"] is False and tab["hasSwitch"] and tab["checked"] is False
    # what a user sees before opening Details: words, no kernel names, probe keys or backend switches
    for raw in ("MPS tensors", "COMFY_METAL_BACKEND", "softmax", "sampler_", "mps_pad_is_safe", "torch._grouped_mm"):
        assert raw not in tab["shown"], (raw, tab["shown"])
    assert {"attention", "FP8 models", "sampling", "the low-memory VAE", "MoE text encoders"} <= set(tab["features"])
    assert "Metal runs only on MPS tensors" not in tab["text"] and "mps_pad_is_safe" not in tab["text"].split("title")[0]
    assert results["switch_on"] is True and results["forced"] == [True, True]
    assert results["forced_tab"]["detailsOpen"] is True     # the refresh after the switch kept Details open
    assert results["switch_off"] is False and results["unforced"] == [False, False]
    # 3. each workflow opens readable, its Note and first nodes in view and uncovered
    assert set(results["workflows"]) == set(bw.WORKFLOWS)
    for name, view in results["workflows"].items():
        assert view["scale"] >= 0.6, (name, view["scale"])
        ui = json.loads((WORKFLOWS / f"{name}.json").read_text())
        shown = {str(n["id"]) for n in bw.view_nodes(ui["nodes"])}     # the page gives node ids as strings
        assert any(n["type"] == "Note" and str(n["id"]) in shown for n in view["nodes"]), (name, shown, view["nodes"])
        for n in view["nodes"]:
            if str(n["id"]) not in shown:
                continue
            x0, y0, x1, y1 = n["box"]
            assert 0 <= x0 and 0 <= y0 and x1 <= view["width"] and y1 <= view["height"], (name, n)
            assert n["covers"] == [], (name, n)    # nothing (menu bar, tabs, panels, minimap) over its corners
    assert "Traceback" not in log or "comfy_metal" not in log, log[-4000:]
