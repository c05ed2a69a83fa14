from _comfy_stub_util import unavailable

resample = unavailable("torchaudio.functional.resample")
bass_biquad = unavailable("torchaudio.functional.bass_biquad")
treble_biquad = unavailable("torchaudio.functional.treble_biquad")
equalizer_biquad = unavailable("torchaudio.functional.equalizer_biquad")
