"""Import paths of modules that moved inside fp8kit, kept working for users: ``import fp8kit.formats`` gives
the module ``fp8kit.numerics.formats`` itself (one module object under both names, so a patch through either
name is seen by both). Code inside fp8kit uses the new paths (``tests/test_layering.py`` holds it)."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from types import ModuleType

MOVED = {
    "fp8kit.formats": "fp8kit.numerics.formats",
    "fp8kit.scaling": "fp8kit.numerics.scaling",
    "fp8kit.tensor": "fp8kit.numerics.tensor",
    "fp8kit.hadamard": "fp8kit.numerics.hadamard",
    "fp8kit.grouped_tensor": "fp8kit.numerics.grouped_tensor",
    "fp8kit.scaling_state": "fp8kit.numerics.scaling_state",
    "fp8kit.recipes": "fp8kit.numerics.recipes",
    "fp8kit.state_dict": "fp8kit.numerics.state_dict",
    "fp8kit.device": "fp8kit.runtime.device",
    "fp8kit.progress": "fp8kit.runtime.progress",
    "fp8kit.evaluation": "fp8kit.data.evaluation",
    "fp8kit.pretrained_ptq": "fp8kit.jobs.quantize",
    "fp8kit.ptq.sequential": "fp8kit.jobs.layerwise",
    "fp8kit.compare": "fp8kit.jobs.compare",
    "fp8kit.cost": "fp8kit.jobs.cost",
    "fp8kit.estimate": "fp8kit.jobs.estimate",
    "fp8kit.model_shape": "fp8kit.jobs.model_shape",
    "fp8kit.train.reload": "fp8kit.jobs.loading",
    "fp8kit.qat.pretrained": "fp8kit.jobs.qad",
    "fp8kit.train.evaluate": "fp8kit.jobs.evaluate",
}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old name in ``MOVED`` and loads it as the module at its new path."""

    def __init__(self) -> None:
        self.labels: dict[str, tuple[str, importlib.machinery.ModuleSpec, object]] = {}

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(MOVED[spec.name])
        self.labels[spec.name] = (module.__name__, module.__spec__, module.__loader__)
        return module

    def exec_module(self, module: ModuleType) -> None:
        """The module at the new path ran already; the import machinery labelled it with the old name, which
        is taken off again (its name, spec and loader stay those of its new path)."""
        module.__name__, module.__spec__, module.__loader__ = self.labels.pop(module.__spec__.name)


def install() -> None:
    """Put the finder on ``sys.meta_path`` once."""
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.append(_Alias())
