from _comfy_stub_util import unavailable

from . import functional  # noqa: F401
from .functional import InterpolationMode  # noqa: F401

Compose = unavailable("torchvision.transforms.Compose")
Normalize = unavailable("torchvision.transforms.Normalize")
Resize = unavailable("torchvision.transforms.Resize")
ToPILImage = unavailable("torchvision.transforms.ToPILImage")
ToTensor = unavailable("torchvision.transforms.ToTensor")
