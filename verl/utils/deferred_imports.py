"""Third-party imports deferred from import time to first use, installed by ``import verl``.

transformers imports, at import time, two libraries it needs only for features verl never runs, whenever they are
installed (lm_eval and mlflow install both): ``generation/candidate_generator.py`` runs ``from sklearn.metrics
import roc_curve`` (assisted decoding's adaptive confidence threshold) and six object-detection losses in
``transformers/loss/`` run ``from scipy.optimize import linear_sum_assignment`` (DETR's matching). transformers
imports all of them while it loads any causal LM, so every ``verl`` command, server, replica and Ray worker paid
for scikit-learn, pandas and scipy.optimize: ~1.3 s of CPU per process here (``python -c "import
verl.models.loader"``; ``-X importtime`` names the modules).

While one of those modules executes, ``sys.modules`` holds a stand-in for the library module it takes names from;
each name is a function that imports the real module at its first call and calls the real function: the same
results, the cost paid only by a process that runs that feature. The stand-in is removed as soon as the importer has
executed, so any later ``import sklearn.metrics`` gets the real one; where the library module is already imported,
the real one is used and nothing is deferred. ``VERL_DEFER_IMPORTS=0`` turns it off.

This is a substitution into transformers' import, so ``verl.models.patches`` lists it with the transformers versions
it was checked against; ``tests/test_deferred_imports.py`` fails if transformers stops importing through it, imports
these libraries another way, or the deferred functions differ from the libraries' own.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

DETECTION_LOSSES = ("loss_for_object_detection", "loss_deformable_detr", "loss_grounding_dino", "loss_lw_detr",
                    "loss_rf_detr", "loss_rt_detr")
# importing module -> the modules whose import it makes lazy while it executes.
DEFERRED: dict[str, tuple[str, ...]] = {
    "transformers.generation.candidate_generator": ("sklearn.metrics",),
    **{f"transformers.loss.{loss}": ("scipy.optimize",) for loss in DETECTION_LOSSES},
}


def deferred_function(module: str, name: str) -> Callable[..., Any]:
    """A function that imports ``module`` on its first call and calls ``module.name`` with the same arguments."""

    def call(*args: Any, **kwargs: Any) -> Any:
        return getattr(importlib.import_module(module), name)(*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    call.__doc__ = f"{module}.{name}, imported at the first call (verl.utils.deferred_imports)."
    return call


class _StandIn(ModuleType):
    """Stands in for a module while one importer executes: any attribute is a ``deferred_function`` of the real one.
    (Every name the importers take is a function; a class would not survive this.)"""

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name.startswith("__"):
            raise AttributeError(name)
        return deferred_function(self.__name__, name)


class _DeferringLoader(importlib.abc.Loader):
    """Wraps the importer's own loader: puts the stand-ins in ``sys.modules`` for the length of ``exec_module``."""

    def __init__(self, loader: importlib.abc.Loader, deferred: Sequence[str]):
        self.loader = loader
        self.deferred = deferred

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        placed = [name for name in self.deferred if name not in sys.modules]
        for name in placed:
            sys.modules[name] = _StandIn(name)
        try:
            self.loader.exec_module(module)
        finally:
            for name in placed:
                if isinstance(sys.modules.get(name), _StandIn):
                    del sys.modules[name]

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ...: inspect and tracebacks use them
        return getattr(self.loader, name)


class DeferringFinder(importlib.abc.MetaPathFinder):
    """Finds the modules in ``DEFERRED`` as the path finder would, with their loader wrapped."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in DEFERRED:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _DeferringLoader(spec.loader, DEFERRED[fullname])
        return spec


def install() -> None:
    """Put ``DeferringFinder`` first on ``sys.meta_path`` (once; a no-op for importers already imported), unless
    ``VERL_DEFER_IMPORTS=0``."""
    if os.environ.get("VERL_DEFER_IMPORTS", "1") == "0":
        return
    if not any(isinstance(finder, DeferringFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, DeferringFinder())
