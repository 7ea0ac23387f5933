"""Private copies of a module of Triton kernels, for tests that run the kernels in Triton's CPU interpreter.

Triton reads TRITON_INTERPRET when @triton.jit runs, i.e. when the kernels' module is imported, so a
test loads its own copy of the module with the variable set (or unset) just for that import: the
environment and the importable module stay as they were for other tests. Triton itself is imported
without the variable, so its own @triton.jit helpers (tl.zeros, tl.sum, ...) cannot run in the
interpreter: the kernels use only builtins.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
from types import ModuleType

import pytest


def load_kernels_module(module: str, interpret: bool, name: str) -> ModuleType:
    """A fresh copy of ``module`` (a dotted name, e.g. megacispo.models.lightning_triton) imported as
    ``name``, with TRITON_INTERPRET=1 for that import when ``interpret``."""
    with contextlib.suppress(ImportError):  # an install without triton: the copy imports without it
        importlib.import_module("triton.language")  # Triton itself without the variable, whoever imports it first
    path = importlib.util.find_spec(module).origin
    spec = importlib.util.spec_from_file_location(name, path)
    copy = importlib.util.module_from_spec(spec)
    sys.modules[name] = copy  # dataclasses look their module up there
    with pytest.MonkeyPatch.context() as patch:
        if interpret:
            patch.setenv("TRITON_INTERPRET", "1")
        else:
            patch.delenv("TRITON_INTERPRET", raising=False)
        spec.loader.exec_module(copy)
    assert copy.INTERPRETED == interpret
    return copy
