"""The pre-training objectives, one module each (mlm, tacl, taco), and the registry the rest of the
pipeline asks (pipeline.objectives.base). Every module of this package is imported here, so adding an
objective is adding one file: its knobs become flags and its name an --objective choice."""

import importlib
import pkgutil

from pipeline.objectives.base import Defaults, LossInputs, Objective, StepLosses, get, names, register

for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    if _module != "base":
        importlib.import_module(f"{__name__}.{_module}")  # each registers itself

__all__ = ["Defaults", "LossInputs", "Objective", "StepLosses", "get", "names", "register"]
