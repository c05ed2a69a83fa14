"""Import-only stub of torchvision for Comfy Metal's ComfyUI integration tests.

Not torchvision: it only provides the names ComfyUI (and spandrel) touch at
import time; using any of them raises StubUnavailableError.
"""

__version__ = "0.0.0+comfymetal.stub"
__comfy_metal_stub__ = True

from . import models, ops, transforms  # noqa: E402,F401
