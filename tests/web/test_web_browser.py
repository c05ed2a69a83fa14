"""The frontend extension in headless Chromium against a real ComfyUI server with the pack
(COMFYUI_PATH; skipped when chromium or ComfyUI is missing).

Drives Chromium through the DevTools protocol (aiohttp's websocket client): the page loads the
extension without errors, the route answers, a badge attached to a node is drawn by litegraph with
the backend from a `comfy_metal.backend` event, and the "Metal" sidebar tab renders the kernel table.
Server and browser listen on 127.0.0.1 only and are stopped at the end of the test.
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
BADGE_TEXT_JS = r"""
(() => { const n = window.__metalStatusNode;
  const b = n.badges.map((x) => (typeof x === "function" ? x() : x)).find((x) => x.tooltip !== undefined);
  return b && b.visible ? { text: b.text, tooltip: b.tooltip } : null; })()
"""


async def _drive(url: str, chromium: str, shots: pathlib.Path):
    async with headless_chromium.open_page(chromium, 1400, 900) as cdp:
        for domain in ("Page", "Runtime", "Log"):
            await cdp.call(f"{domain}.enable")
        await cdp.call("Page.navigate", url=url)
        await cdp.wait_for("!!(window.comfyAPI?.app?.app?.extensions?.some"
                           "((e) => e.name === 'comfy_metal.status') && window.comfyMetal)")
        await cdp.wait_for("!!window.comfyAPI.app.app.canvas && !!window.comfyAPI.app.app.graph")
        results = {}
        results["status"] = await cdp.wait_for(
            "window.comfyAPI.api.api.fetchApi('/comfy_metal/status').then((r) => r.json())")
        results["memory"] = await cdp.evaluate(
            "window.comfyAPI.api.api.fetchApi('/comfy_metal/memory').then((r) => r.json())")
        results["setting"] = await cdp.evaluate(
            "window.comfyAPI.app.app.extensionManager.setting.get('ComfyMetal.ForceReference')")
        results["badge"] = await cdp.evaluate(BADGE_JS)
        results["queued"] = await cdp.evaluate(QUEUE_JS)
        results["live_badge"] = await cdp.wait_for(BADGE_TEXT_JS, timeout=120)
        # the sidebar tab: registered, and its panel renders the kernel table
        tabs = await cdp.evaluate(
            "window.comfyAPI.app.app.extensionManager.sidebarTab.sidebarTabs.map((t) => t.id)")
        results["tabs"] = tabs
        await cdp.evaluate(
            "window.comfyAPI.app.app.extensionManager.sidebarTab.toggleSidebarTab('comfy-metal')")
        results["panel"] = await cdp.wait_for(
            "(() => { const el = document.querySelector('.comfy-metal-panel .comfy-metal-body');"
            " return el && el.textContent.includes('softmax') ? el.innerText : null; })()", timeout=60)
        await asyncio.sleep(1)
        shot = await cdp.call("Page.captureScreenshot", format="png")
        import base64

        shots.mkdir(parents=True, exist_ok=True)
        (shots / "comfy_metal_sidebar.png").write_bytes(base64.b64decode(shot["data"]))
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


def test_extension_in_headless_chromium(comfyui_path, tmp_path):
    pytest.importorskip("aiohttp", reason="aiohttp (a ComfyUI requirement) is not installed")
    chromium = _chromium()
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
        results = asyncio.run(_drive(server.url, chromium, tmp_path / "shots"))
        log = server.log()
    assert results["problems"] == [], results["problems"]
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
    assert "comfy-metal" in results["tabs"]
    assert "Kernels" in results["panel"] and "softmax" in results["panel"] and "Capabilities" in results["panel"]
    assert "Traceback" not in log or "comfy_metal" not in log, log[-4000:]
    print(f"screenshot: {tmp_path / 'shots' / 'comfy_metal_sidebar.png'}")
