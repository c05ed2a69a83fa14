from _comfy_stub_util import unavailable

raft_large = unavailable("torchvision.models.optical_flow.raft_large")
