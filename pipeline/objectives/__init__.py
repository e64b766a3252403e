"""The pre-training objectives, one module each (mlm, tacl, taco), and the registry the rest of the
pipeline asks (pipeline.objectives.base)."""

from pipeline.objectives import mlm, tacl, taco  # noqa: F401  (each registers itself)
from pipeline.objectives.base import Defaults, LossInputs, Objective, StepLosses, get, names, register

__all__ = ["Defaults", "LossInputs", "Objective", "StepLosses", "get", "names", "register"]
