import enum

from _comfy_stub_util import unavailable


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


normalize = unavailable("torchvision.transforms.functional.normalize")
resize = unavailable("torchvision.transforms.functional.resize")
rotate = unavailable("torchvision.transforms.functional.rotate")
to_tensor = unavailable("torchvision.transforms.functional.to_tensor")
to_pil_image = unavailable("torchvision.transforms.functional.to_pil_image")
