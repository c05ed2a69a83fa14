from _comfy_stub_util import unavailable

MelScale = unavailable("torchaudio.transforms.MelScale")
MelSpectrogram = unavailable("torchaudio.transforms.MelSpectrogram")
Resample = unavailable("torchaudio.transforms.Resample")
