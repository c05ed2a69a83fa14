from _comfy_stub_util import unavailable

box_convert = unavailable("torchvision.ops.box_convert")
deform_conv2d = unavailable("torchvision.ops.deform_conv2d")
nms = unavailable("torchvision.ops.nms")
roi_align = unavailable("torchvision.ops.roi_align")
