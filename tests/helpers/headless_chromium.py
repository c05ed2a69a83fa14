"""Headless Chromium driven through the DevTools protocol (CDP), shared by the browser tests and the
workflow screenshot tool (tests/ is on sys.path: `import headless_chromium`).

    async with headless_chromium.open_page(chromium, 1400, 900) as cdp:
        await cdp.call("Runtime.enable")
        value = await cdp.evaluate("1 + 1")

`open_page` starts Chromium (127.0.0.1 only, a temporary profile), reads the DevTools port from its
stderr, opens one page target, connects its websocket (aiohttp) and yields a `CDP`; on the way out it
always stops the browser (terminate, then kill after 20 s) and removes the profile.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import re
import shutil
import subprocess
import tempfile
import time

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "chrome")
PAGE_TIMEOUT = 120      # seconds for one DevTools reply (and the default wait_for timeout)
START_TIMEOUT = 60      # seconds for Chromium to print its DevTools address

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--no-first-run")


def chromium_path() -> str | None:
    """The first Chromium/Chrome executable on PATH, or None."""
    for name in CHROMIUM_NAMES:
        path = shutil.which(name)
        if path:
            return path
    return None


class CDP:
    """Minimal Chrome DevTools protocol client over one page target's websocket. Events that arrive
    while waiting for a reply are collected in `events` (clear it to start afresh)."""

    def __init__(self, ws):
        self.ws = ws
        self.next_id = 0
        self.events: list[dict] = []

    async def call(self, method: str, **params):
        self.next_id += 1
        my_id = self.next_id
        await self.ws.send_json({"id": my_id, "method": method, "params": params})
        while True:
            msg = await asyncio.wait_for(self.ws.receive_json(), timeout=PAGE_TIMEOUT)
            if msg.get("id") == my_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})
            if "method" in msg:
                self.events.append(msg)

    async def evaluate(self, expression: str):
        result = await self.call("Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"page exception: {json.dumps(result['exceptionDetails'])[:2000]}")
        return result["result"].get("value")

    async def wait_for(self, expression: str, timeout: float = PAGE_TIMEOUT, *, guard: bool = True,
                       message: str | None = None):
        """Polls `expression` every 0.5 s until it is truthy and returns its value. With `guard` a
        throwing/rejecting expression counts as not yet (null); without, the page exception raises.
        TimeoutError(`message`, default "page never satisfied: <expression>") after `timeout` s."""
        deadline = time.monotonic() + timeout
        if guard:
            expression_ = f"(async () => {{ try {{ return await ({expression}); }} catch (e) {{ return null; }} }})()"
        else:
            expression_ = expression
        while True:
            value = await self.evaluate(expression_)
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(message or f"page never satisfied: {expression}")
            await asyncio.sleep(0.5)

    def console_messages(self) -> list[str]:
        """The text of console errors/warnings/asserts among the collected events."""
        return [" ".join(str(a.get("value", a.get("description", ""))) for a in e["params"].get("args", []))
                for e in self.events if e["method"] == "Runtime.consoleAPICalled"
                and e["params"].get("type") in ("error", "warning", "assert")]

    def exceptions(self) -> list[str]:
        """Uncaught page exceptions among the collected events (JSON, cut to 1500 characters)."""
        return [json.dumps(e["params"].get("exceptionDetails", {}))[:1500]
                for e in self.events if e["method"] == "Runtime.exceptionThrown"]

    def problems(self, pattern: str = r"comfy[_-]metal|comfy_metal\.js|status_model") -> list[str]:
        """Console errors/warnings, uncaught exceptions and failed loads whose text, or the script of a frame of
        their stack, matches `pattern` (by default: those that concern the pack, including a frontend warning
        our code triggers, e.g. a deprecated property's getter called from comfy_metal.js)."""
        out = []
        for e in self.events:
            method, p = e["method"], e.get("params", {})
            if method == "Runtime.exceptionThrown":
                details = p.get("exceptionDetails", {})
                out.append((json.dumps(details)[:1500], details.get("stackTrace")))
            elif method == "Runtime.consoleAPICalled" and p.get("type") in ("error", "warning", "assert"):
                text = " ".join(str(a.get("value", a.get("description", ""))) for a in p.get("args", []))
                out.append((text, p.get("stackTrace")))
            elif method == "Log.entryAdded" and p.get("entry", {}).get("level") in ("error", "warning"):
                entry = p["entry"]
                out.append((f"{entry.get('text')} {entry.get('url', '')}", entry.get("stackTrace")))
        found = []
        for text, stack in out:
            frames = [f.get("url", "") for f in (stack or {}).get("callFrames", [])]
            if re.search(pattern, text, re.I) or any(re.search(pattern, url, re.I) for url in frames):
                found.append(text + (f"  (from {frames[0]})" if frames else ""))
        return found


@contextlib.asynccontextmanager
async def open_page(chromium: str, width: int, height: int, extra_flags=(),
                    profile_prefix: str = "comfy-metal-chromium-"):
    """Launches headless `chromium` with a `width`x`height` window (plus `extra_flags`, e.g.
    "--hide-scrollbars") and a temporary profile, opens a blank page target and yields its `CDP`.
    The browser is stopped and the profile removed however the block ends."""
    import aiohttp

    profile = tempfile.mkdtemp(prefix=profile_prefix)
    proc = subprocess.Popen(
        [chromium, *FLAGS, *extra_flags, "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0",
         f"--user-data-dir={profile}", f"--window-size={width},{height}", "about:blank"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        port = None
        deadline = time.monotonic() + START_TIMEOUT
        while port is None:
            line = await asyncio.get_running_loop().run_in_executor(None, proc.stderr.readline)
            m = re.search(r"DevTools listening on ws://127\.0\.0\.1:(\d+)/", line)
            if m:
                port = int(m.group(1))
            elif (not line and proc.poll() is not None) or time.monotonic() > deadline:
                raise RuntimeError(f"chromium did not start (exit {proc.poll()})")
        async with aiohttp.ClientSession() as http:
            async with http.put(f"http://127.0.0.1:{port}/json/new?about:blank") as r:
                target = await r.json(content_type=None)
            async with http.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=0) as ws:
                yield CDP(ws)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(profile, ignore_errors=True)
