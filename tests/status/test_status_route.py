"""nodes/status: the /comfy_metal routes (through aiohttp's test server), per-node backend
records and the websocket event, route registration inside (and only inside) ComfyUI."""
from __future__ import annotations

import asyncio
import json
import sys
import threading
import types

import pytest
import torch

from comfy_metal import metal_kernels
from comfy_metal.metal_kernels import dispatch
from comfy_metal.nodes import status

# aiohttp is in the test extras (and a ComfyUI requirement): a missing install fails here, not a silent skip.
from aiohttp import web  # noqa: E402
from aiohttp.test_utils import TestClient, TestServer  # noqa: E402


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    monkeypatch.delenv("COMFY_METAL_BACKEND", raising=False)
    monkeypatch.delenv("COMFY_METAL_REFERENCE", raising=False)
    monkeypatch.setattr(status.routes, "_saved_backend_env", status.routes._UNSET)
    dispatch.reset()
    status.clear_records()
    yield
    dispatch.reset()
    status.clear_records()


def _call(method: str, path: str, json_body=None, data=None):
    """(http status, parsed JSON) of one request to an app holding only the pack's routes."""
    async def go():
        routes = web.RouteTableDef()
        status.add_routes(routes)
        app = web.Application()
        app.add_routes(routes)
        async with TestClient(TestServer(app, host="127.0.0.1")) as client:
            resp = await client.request(method, path, json=json_body, data=data)
            return resp.status, await resp.json()
    return asyncio.run(go())


def test_status_route_reports_probe_kernels_nodes_and_memory():
    metal_kernels.softmax(torch.randn(3, 5))
    status.record_node_backend("MetalThing", ["softmax"], node_id="12")
    code, body = _call("GET", "/comfy_metal/status")
    assert code == 200
    assert set(body) >= {"capabilities", "backend_setting", "force_reference", "kernels", "last_backend",
                         "node_backends", "memory", "loaded_models", "summary", "forced_kernels", "measured"}
    assert body["summary"]["verdict"].startswith("No Apple GPU here: Comfy Metal runs its plain PyTorch code")
    assert body["capabilities"]["torch"] == torch.__version__
    assert body["backend_setting"] == "auto"
    assert body["force_reference"] is False
    soft = body["kernels"]["softmax"]
    assert soft == {"backend": "reference", "device": "cpu", "source": "softmax.metal",
                    "reason": "Metal runs only on MPS tensors (this call is on cpu)"}
    assert body["last_backend"] == {"softmax": "reference"}
    assert body["node_backends"]["12"]["node_class"] == "MetalThing"
    assert body["memory"]["device"] == "cpu"


def test_status_self_checks_run_off_the_event_loop(monkeypatch):
    seen = {}
    real = status.status_payload

    def spy():
        seen["thread"] = threading.current_thread()
        return real()

    monkeypatch.setattr(status.routes, "status_payload", spy)
    code, _ = _call("GET", "/comfy_metal/status")
    assert code == 200
    assert seen["thread"] is not threading.main_thread()  # asyncio.run's loop runs on the main thread


def test_status_route_failure_is_a_json_500(monkeypatch):
    def broken():
        raise RuntimeError("probe exploded")

    monkeypatch.setattr(status.routes, "status_payload", broken)
    code, body = _call("GET", "/comfy_metal/status")
    assert code == 500
    assert body == {"error": "RuntimeError: probe exploded"}


def test_memory_route_on_cpu():
    import psutil

    code, body = _call("GET", "/comfy_metal/memory")
    assert code == 200
    assert body["device"] == "cpu"
    assert 0 < body["in_use"] <= body["recommended_max"] == psutil.virtual_memory().total
    assert body["process_rss"] == body["in_use"]  # on CPU, "in use" is this process's RSS


def test_settings_force_reference_and_restore(monkeypatch):
    monkeypatch.setenv("COMFY_METAL_BACKEND", "auto")
    code, body = _call("POST", "/comfy_metal/settings", {"force_reference": True})
    assert (code, body) == (200, {"force_reference": True, "backend_setting": "reference"})
    import os

    assert os.environ["COMFY_METAL_BACKEND"] == "reference"
    # the next kernel call takes the reference because it was forced
    metal_kernels.softmax(torch.randn(2, 3))
    rec = status.record_node_backend("MetalThing", ["softmax"])
    assert rec["kernels"]["softmax"]["reason"] == "forced by COMFY_METAL_BACKEND/COMFY_METAL_REFERENCE"
    assert status.status_payload()["force_reference"] is True
    # switching on twice keeps the original value to restore
    _call("POST", "/comfy_metal/settings", {"force_reference": True})
    code, body = _call("POST", "/comfy_metal/settings", {"force_reference": False})
    assert (code, body) == (200, {"force_reference": False, "backend_setting": "auto"})
    assert os.environ["COMFY_METAL_BACKEND"] == "auto"


def test_settings_off_when_started_forced_means_not_forced(monkeypatch):
    import os

    monkeypatch.setenv("COMFY_METAL_BACKEND", "reference")
    code, body = _call("POST", "/comfy_metal/settings", {"force_reference": False})
    assert (code, body["force_reference"]) == (200, False)
    assert "COMFY_METAL_BACKEND" not in os.environ


@pytest.mark.parametrize("payload", [{"force_reference": "yes"}, {}, [True], None])
def test_settings_rejects_bad_bodies(payload):
    import os

    if payload is None:
        code, body = _call("POST", "/comfy_metal/settings", data=b"not json")
    else:
        code, body = _call("POST", "/comfy_metal/settings", payload)
    assert code == 400
    assert "force_reference" in body["error"]
    assert "COMFY_METAL_BACKEND" not in os.environ


def test_summarize_backends():
    assert status.summarize_backends({}) == ("none", "no Comfy Metal kernel ran in this node")
    assert status.summarize_backends({"a": {"backend": "metal"}, "b": {"backend": "metal"}})[0] == "metal"
    assert status.summarize_backends({"a": {"backend": "metal"}, "b": {"backend": "emulator"}})[0] == "emulator"
    assert status.summarize_backends({"a": {"backend": "reference", "reason": "why"}}) == ("reference", "why")
    overall, reason = status.summarize_backends({"a": {"backend": "metal"},
                                                 "b": {"backend": "reference", "reason": "self-check failed"}})
    assert overall == "mixed"
    assert reason == "reference for b: self-check failed"


class _FakeServer:
    def __init__(self):
        self.sent = []
        self.client_id = "client-1"
        self.routes = web.RouteTableDef()

    def send_sync(self, event, data, sid=None):
        self.sent.append((event, data, sid))


@pytest.fixture
def fake_comfyui(monkeypatch):
    """A `server` module with PromptServer.instance and ComfyUI's executing context, as in ComfyUI."""
    instance = _FakeServer()
    server = types.ModuleType("server")
    server.PromptServer = type("PromptServer", (), {"instance": instance})
    utils = types.ModuleType("comfy_execution.utils")
    ctx = {"node": None}
    utils.get_executing_context = lambda: (None if ctx["node"] is None
                                           else types.SimpleNamespace(prompt_id="p", node_id=ctx["node"]))
    monkeypatch.setitem(sys.modules, "server", server)
    monkeypatch.setitem(sys.modules, "comfy_execution.utils", utils)
    return instance, ctx


def test_record_sends_event_with_executing_node_id(fake_comfyui):
    instance, ctx = fake_comfyui
    metal_kernels.softmax(torch.randn(4, 7))
    ctx["node"] = "5"
    rec = status.record_node_backend("MetalThing", ["softmax", "never_called"])
    assert rec["node_id"] == "5"
    assert set(rec["kernels"]) == {"softmax"}
    assert instance.sent == [(status.BACKEND_EVENT, rec, "client-1")]
    assert json.loads(json.dumps(rec)) == rec  # the websocket event is plain JSON
    rec_core = status.record_node_backend(None, ["softmax"])  # e.g. a Metal sampler inside KSampler
    assert rec_core["node_id"] == "5" and rec_core["node_class"] is None and rec_core["backend"] == "reference"
    assert status.node_backends["5"] is rec_core
    ctx["node"] = None
    rec2 = status.record_node_backend("MetalOther", [])
    assert rec2["node_id"] is None and rec2["backend"] == "none"
    assert set(status.node_backends) == {"5", "MetalOther"}
    records, index = status.records_since(0)
    assert [r["node_class"] for r in records] == ["MetalThing", None, "MetalOther"] and index == 3
    assert status.records_since(2)[0] == [rec2]
    assert status.records_since(3) == ([], 3)


def test_record_never_raises(fake_comfyui):
    instance, _ = fake_comfyui

    def boom(*a, **k):
        raise ConnectionError("socket gone")

    instance.send_sync = boom
    metal_kernels.softmax(torch.randn(2, 2))
    assert status.record_node_backend("MetalThing", ["softmax"])["backend"] == "reference"
    assert status.record_node_backend("MetalThing", 12345) is None  # not a list of names: logged, not raised


class _Encoder(torch.nn.Module):
    """A text-encoder-shaped model: the root's own forward is not called, its child's is (as in
    ComfyUI's SD1ClipModel -> SDClipModel), and a grandchild calls a registry kernel."""

    def __init__(self):
        super().__init__()
        self.clip_l = torch.nn.Sequential(torch.nn.Module())
        self.clip_l[0].forward = lambda x: metal_kernels.softmax(x) if self.call_kernel else x
        self.call_kernel = True
        self.fail = False

    def encode(self, x):
        if self.fail:
            def boom(m, args):
                raise RuntimeError("encoder failed")
            handle = self.clip_l[0].register_forward_pre_hook(boom)
            try:
                return self.clip_l(x)
            finally:
                handle.remove()
        return self.clip_l(x)


def test_forward_hooks_record_for_the_executing_node_and_restore_last_backend(fake_comfyui):
    """record_forward_kernels: one record per outermost forward, for the executing node (node_class None),
    listing only the kernels that ran; last_backend entries of kernels that did not run are put back."""
    instance, ctx = fake_comfyui
    enc = _Encoder()
    rec = status.record_forward_kernels(enc, ["softmax", "gemv"])
    assert status.record_forward_kernels(enc, ["fp8_decode"]) is rec     # once per model: kernels added
    assert rec.kernels == ("softmax", "gemv", "fp8_decode")
    dispatch.last_backend["gemv"] = "metal"                              # from an earlier node
    dispatch.last_backend.pop("softmax", None)
    ctx["node"] = "6"
    enc.encode(torch.randn(3, 5))
    records, index = status.records_since(0)
    assert len(records) == 1 and index == 1, records                     # nested forwards: one record
    r = records[0]
    assert r["node_id"] == "6" and r["node_class"] is None
    assert set(r["kernels"]) == {"softmax"} and r["backend"] == "reference", r
    assert dispatch.last_backend["gemv"] == "metal" and dispatch.last_backend["softmax"] == "reference"
    assert instance.sent[-1] == (status.BACKEND_EVENT, r, "client-1")
    # A run calling none of the kernels makes no record and keeps last_backend as it was.
    enc.call_kernel = False
    enc.encode(torch.randn(2, 2))
    assert status.records_since(1)[0] == [] and dispatch.last_backend["softmax"] == "reference"
    # A forward that raises: the error reaches the caller, no record, entries restored, depth reset.
    enc.call_kernel, enc.fail = True, True
    with pytest.raises(RuntimeError, match="encoder failed"):
        enc.encode(torch.randn(2, 2))
    assert status.records_since(1)[0] == [] and dispatch.last_backend["softmax"] == "reference"
    assert rec.depth == 0 and rec.before == {}
    enc.fail = False
    enc.encode(torch.randn(2, 2))
    assert [x["node_id"] for x in status.records_since(1)[0]] == ["6"]


def test_forward_hooks_never_raise(fake_comfyui, monkeypatch):
    enc = _Encoder()
    status.record_forward_kernels(enc, ["softmax"])
    monkeypatch.setattr(status.records, "record_node_backend", lambda *a, **k: 1 / 0)
    out = enc.encode(torch.randn(2, 3))                                  # logged at debug, not raised
    assert out.shape == (2, 3)
    assert status.record_forward_kernels(object(), ["softmax"]) is None  # not a module: logged, None


def test_routes_register_only_inside_comfyui_and_once(fake_comfyui, monkeypatch):
    instance, _ = fake_comfyui
    assert status.register_with_comfyui() is True
    assert status.register_with_comfyui() is False
    paths = sorted((r.method, r.path) for r in instance.routes)
    assert paths == [("GET", "/comfy_metal/memory"), ("GET", "/comfy_metal/status"),
                     ("POST", "/comfy_metal/settings")]
    monkeypatch.delitem(sys.modules, "server")
    assert status.register_with_comfyui() is False


def test_routes_in_real_comfyui(comfyui):
    """The pack loaded by ComfyUI's load_custom_node added its routes to the real PromptServer."""
    from aiohttp.test_utils import make_mocked_request
    import json

    handler = comfyui._route_handler("GET", "/comfy_metal/status")
    response = comfyui.loop.run_until_complete(handler(make_mocked_request("GET", "/comfy_metal/status")))
    body = json.loads(response.body)
    assert response.status == 200
    assert "softmax" in body["kernels"]
    handler = comfyui._route_handler("GET", "/comfy_metal/memory")
    response = comfyui.loop.run_until_complete(handler(make_mocked_request("GET", "/comfy_metal/memory")))
    assert json.loads(response.body)["device"] == "cpu"
    comfyui._route_handler("POST", "/comfy_metal/settings")


def test_metal_status_node_reports_and_records(fake_comfyui):
    instance, ctx = fake_comfyui
    ctx["node"] = "21"
    node = status.NODE_CLASS_MAPPINGS["MetalStatus"]()
    out = node.report()
    text = out["result"][0]
    (shown,) = out["ui"]["text"]
    # on the node: the Metal tab's verdict, then a short list (no wide tables); the output adds the tables
    assert shown.startswith("No Apple GPU here: Comfy Metal runs its plain PyTorch code")
    assert text.startswith(shown) and "---" not in shown and len(shown.splitlines()) <= 16
    assert "- Attention, FP8 models, GGUF models, NVFP4 / MXFP8 / INT8 models, sampling, the low-memory VAE and MoE " \
           "text encoders: plain PyTorch code (no Apple GPU here)" in shown
    assert "Kernels (COMFY_METAL_BACKEND=auto)" in text and "Capabilities" in text
    assert "This node's probe call: reference (Metal runs only on MPS tensors (this call is on cpu))" in text
    for name in metal_kernels.REGISTRY:
        assert name in text
    rec = status.node_backends["21"]
    assert rec["node_class"] == "MetalStatus" and rec["backend"] == "reference"
    assert instance.sent[-1] == (status.BACKEND_EVENT, rec, "client-1")
    assert status.NODE_DISPLAY_NAME_MAPPINGS["MetalStatus"] == "Comfy Metal Status"
    assert status.MetalStatus.IS_CHANGED() != status.MetalStatus.IS_CHANGED()  # NaN: always re-run


def test_metal_status_node_under_the_emulator(monkeypatch):
    """The node's probe call runs the real softmax MSL through the emulator and says so."""
    from comfy_metal.metal_kernels import emulator

    if not emulator.available():
        pytest.skip("clang-19 is missing: the MSL emulator cannot run")
    monkeypatch.setenv("COMFY_METAL_REFERENCE", ",".join(n for n in metal_kernels.REGISTRY if n != "softmax"))
    monkeypatch.setenv("COMFY_METAL_BACKEND", "emulator")
    dispatch.reset()
    text = status.MetalStatus().report()["result"][0]
    rec = status.node_backends["MetalStatus"]
    assert rec["backend"] == "emulator" and rec["kernels"]["softmax"]["reason"] == "passed its self-check"
    assert "This node's probe call: emulator (every kernel passed its self-check)" in text
