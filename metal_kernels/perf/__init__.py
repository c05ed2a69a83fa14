"""The performance model: chip table (chips.py), roofline predictor (roofline.py), real-model predict cases
(cases.py) and the glue that profiles a case in the emulator (run.py). `python -m comfy_metal bench --predict`
prints the table; every figure it prints is a model prediction, not a measurement."""
from __future__ import annotations

from .cases import PredictCase, all_cases, at_shape, cases_for
from .chips import CHIPS, Chip, chip
from .roofline import Prediction, predict
from .run import ProfilingLibrary, profile_case, source_locator

__all__ = ["CHIPS", "Chip", "chip", "Prediction", "predict", "PredictCase", "all_cases", "at_shape", "cases_for",
           "ProfilingLibrary", "profile_case", "source_locator"]
