from _comfy_stub_util import unavailable

from . import optical_flow  # noqa: F401

efficientnet_v2_s = unavailable("torchvision.models.efficientnet_v2_s")
