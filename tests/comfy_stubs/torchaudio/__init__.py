"""Import-only stub of torchaudio for Comfy Metal's ComfyUI integration tests.

Not torchaudio: it only provides the names ComfyUI touches at import time;
using any of them raises StubUnavailableError.
"""

from _comfy_stub_util import unavailable

__version__ = "0.0.0+comfymetal.stub"
__comfy_metal_stub__ = True

from . import functional, transforms  # noqa: E402,F401

load = unavailable("torchaudio.load")
save = unavailable("torchaudio.save")
info = unavailable("torchaudio.info")
