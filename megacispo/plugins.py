"""User code named in a config as ``module:name`` (a reward function, a metric hook), imported at
start-up: the one way a run loads it, with errors that say which part is wrong."""

from __future__ import annotations

import importlib
from typing import Any


def import_object(spec: str, kind: str = "function") -> Any:
    """The object ``module:name`` names (dots in ``name`` for nested attributes), its module imported
    now; ValueError saying what is wrong (``kind``: what the object is, for the messages)."""
    module_name, _, attribute_path = spec.partition(":")
    if not module_name or not attribute_path:
        raise ValueError(f"a user {kind} needs both parts of 'module:{kind}'")
    target = _import_module(module_name)
    for attribute in attribute_path.split("."):
        if not hasattr(target, attribute):
            raise ValueError(f"module {module_name!r} has no attribute {attribute_path!r}; check the name")
        target = getattr(target, attribute)
    return target


def _import_module(module_name: str):
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name == module_name or module_name.startswith(f"{error.name}."):
            raise ValueError(
                f"module {module_name!r} not found; put its directory on PYTHONPATH or fix the name"
            ) from error
        raise ValueError(f"importing module {module_name!r} failed: {error}") from error
    except Exception as error:
        raise ValueError(f"importing module {module_name!r} failed: {type(error).__name__}: {error}") from error
