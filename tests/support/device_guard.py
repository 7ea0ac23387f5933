"""Host memory as a second device on a CPU-only machine, for the device tier
(tests/multiprocess/test_device_tier.py).

On a GPU run a tensor made by a factory call that names no device (``torch.zeros(n)``) or names the
host (``device="cpu"``), or by ``.cpu()``, lives in host memory, and so does a generator made that
way; the first op that meets it with the GPU's tensors raises. On a CPU run host memory is the run's
device and nothing raises. Inside ``host_memory_guard()`` the run's device stays the CPU, and what a
GPU run would hold in host memory is marked: such tensors become ``HostTensor``s (torch keeps the
subclass on everything computed from them alone), such generators remember it (inside the guard
``torch.Generator`` names a subclass that records how each one was made). A torch call,
collectives included, that takes a marked tensor together with an unmarked one, a marked tensor into
a collective, or a marked generator for unmarked tensors, raises ``DeviceMismatch``. Marked tensors
used on their own (``.tolist()``, ``.item()``, host bookkeeping) run, as on a GPU run: unlike
``torch.set_default_device("meta")``, real values flow, so data-dependent code (sampling, early stops,
MoE token counts) runs; and unlike that mode, this one also checks the calls made inside Python-level
torch functions, the backward pass among them.

Stricter than CUDA where CUDA would only copy or synchronize (a 0-dim host tensor in an elementwise
op, a host index into a device tensor, a host value assigned into one): SYSTEM.md's device rule wants
every tensor the code makes on the run's device. Explicit transfers (``copy_``, ``.to(device)``) are
allowed. Not seen: a tensor placed with a ``torch.device("cpu")`` object (the run's device on a CPU
run is that same object), tensors made outside torch's Python API (``torch.from_numpy``, legacy
constructors such as ``torch.LongTensor``), compiled graphs.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from typing import Iterator

import torch
import torch.utils._device
from torch.overrides import TorchFunctionMode, redispatch_function


class DeviceMismatch(RuntimeError):
    """What a GPU run would raise: host memory and the run's device meet in one op."""


# The device marked tensors report: the CPU still, but not equal to the run's device (torch.device("cpu")),
# so that code that compares devices (a lazy ``if t.device != device: t = t.to(device)``) acts as on a
# GPU run, and what is made on it (``device=host_tensor.device``) is host memory too.
HOST = torch.device("cpu", 0)


class HostTensor(torch.Tensor):
    """A tensor a GPU run would hold in host memory."""

    @property
    def device(self) -> torch.device:
        return HOST

    def __format__(self, format_spec: str) -> str:
        # Tensor.__format__ formats a 0-dim tensor as its number for torch.Tensor itself only.
        return self.as_subclass(torch.Tensor).__format__(format_spec)


# torch's own list of the factories that torch.set_default_device redirects.
_FACTORIES = frozenset(torch.utils._device._device_constructors())
# Factories that return their tensor argument as it is (same device) instead of copying it to the default one.
_PASS_THROUGH = frozenset({torch.as_tensor, torch.asarray})
# Explicit transfers between host memory and the device: allowed to take both.
_TRANSFERS = frozenset({torch.Tensor.copy_, torch.Tensor.to, torch.Tensor.cpu})
_GENERATOR = torch.Generator


def _names_host(device) -> bool:
    """Whether a ``device`` argument places in host memory on a GPU run: none given, a marked tensor's
    device, or the string "cpu" (code gets the run's device as a torch.device: run_device(), a
    tensor's .device; on a GPU run that string can only mean the host)."""
    if isinstance(device, str):
        return torch.device(device).type == "cpu"
    return device is None or device == HOST


# This package (megacispo.testing, the test helpers) is never in scope, though its name starts with megacispo.
_TESTING = __name__.rpartition(".")[0] + "."


def _in_scope(frame, scope: tuple[str, ...]) -> bool:
    name = frame.f_globals.get("__name__", "")
    return name.startswith(scope) and not name.startswith(_TESTING)


class _MarkedGenerator(_GENERATOR):
    """torch.Generator inside the guard: remembers whether code in scope made it in host memory."""

    scope: tuple[str, ...] = ()

    def __new__(cls, device=None):
        generator = super().__new__(cls) if device is None else super().__new__(cls, device)
        generator.on_host = _names_host(device) and _in_scope(sys._getframe(1), cls.scope)
        return generator


def _tensors(values) -> Iterator[torch.Tensor]:
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from _tensors(value)


def _describe(tensors: list[torch.Tensor]) -> str:
    return ", ".join(f"{tuple(t.shape)} {t.dtype}" for t in tensors)


def _check_one_memory(func, args, kwargs) -> None:
    tensors = list(_tensors((*args, *kwargs.values())))
    host = [t for t in tensors if isinstance(t, HostTensor)]
    device = [t for t in tensors if not isinstance(t, HostTensor)]
    name = getattr(func, "__qualname__", repr(func))
    if host and device:
        raise DeviceMismatch(
            f"{name} takes host-memory tensors [{_describe(host)}] (made without a device, on \"cpu\" or by .cpu()) "
            f"together with tensors on the run's device [{_describe(device)}]: a GPU run fails here"
        )
    if host and getattr(func, "__module__", "").startswith("torch.distributed"):
        raise DeviceMismatch(
            f"{name} takes host-memory tensors [{_describe(host)}] (made without a device, on \"cpu\" or by "
            ".cpu()): a GPU run's collectives (NCCL) take tensors on the run's device only"
        )
    generator = kwargs.get("generator")
    if getattr(generator, "on_host", False) and (device or not _names_host(kwargs.get("device"))):
        raise DeviceMismatch(
            f"{name} draws with a generator in host memory for tensors on the run's device: a GPU run fails "
            "here (make it with torch.Generator(device=...))"
        )


def _places_on_host(func, args, kwargs) -> bool | None:
    """Whether a factory or a transfer puts its result in host memory; None: it keeps its input's place."""
    if func is torch.Tensor.cpu:
        return True
    if func is torch.Tensor.to:
        named = kwargs.get("device", args[1] if len(args) > 1 else None)
        if isinstance(named, torch.Tensor):
            return isinstance(named, HostTensor)  # to(other): other's place
        moved = torch._C._nn._parse_to(*args[1:], **kwargs)[0] is not None
        return _names_host(named) if moved else None
    if func in _PASS_THROUGH and isinstance(args[0], torch.Tensor) and "device" not in kwargs:
        return None
    return _names_host(kwargs.get("device"))


def _mark(func, args, kwargs, result, called_in_scope: bool):
    """Mark what ``func`` put in host memory when code in scope called it; unmark what an explicit
    transfer put on the run's device."""
    if func is torch.Tensor.copy_:
        return args[0]  # in place: the destination stays where it is, whatever the source
    if func not in _FACTORIES and func not in _TRANSFERS:
        return result
    on_host = _places_on_host(func, args, kwargs)
    if on_host and called_in_scope:
        return result.as_subclass(HostTensor)
    if on_host is False and isinstance(result, HostTensor):
        return result.as_subclass(torch.Tensor)
    return result


class _HostMemoryMode(TorchFunctionMode):
    def __init__(self, scope: tuple[str, ...]):
        super().__init__()
        self.scope = scope

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _TRANSFERS:
            _check_one_memory(func, args, kwargs)
        if inspect.isfunction(func):
            # A torch function written in Python (Tensor.backward, torch.autograd.backward, the
            # collectives) makes its torch calls inside this call, where the mode is switched off:
            # run it under the mode again, one override level down, so that those calls are checked
            # too. Without this a whole backward pass (custom autograd Functions) goes unchecked.
            with self:
                result = redispatch_function(func, types, args, kwargs)
        else:
            result = func(*args, **kwargs)
        # The caller's frame: torch calls a mode straight from the call site of a C++ function.
        return _mark(func, args, kwargs, result, _in_scope(sys._getframe(1), self.scope))


@contextlib.contextmanager
def host_memory_guard(scope: tuple[str, ...] = ("megacispo",)) -> Iterator[None]:
    """Run the enclosed code as a GPU run would place its tensors (see the module docstring).

    Only what code in the modules named by ``scope`` (prefixes) places in host memory is marked.
    Megatron-Core 0.16.1 makes host tensors where a GPU run does too and works: forward_step's
    ``num_tokens = torch.tensor(0, dtype=torch.int)`` (pipeline_parallel/schedules.py:251), which
    the schedule adds to its device counter (:649; CUDA's add takes a 0-dim CPU tensor). And on a
    CPU-only branch: models/config.py turns use_cpu_initialization on for a CPU run, so the weights
    come from ``torch.empty(..., dtype=...)`` without a device (tensor_parallel/layers.py:240
    VocabParallelEmbedding, :851 and :893 ColumnParallelLinear, likewise RowParallelLinear), where a
    GPU run makes them on the device. Marking upstream calls would fail on both for no GPU fault.
    Any op, upstream ones included, that meets a marked tensor with an unmarked one still raises."""
    _MarkedGenerator.scope = scope
    torch.Generator = _MarkedGenerator
    try:
        with _HostMemoryMode(scope):
            yield
    finally:
        torch.Generator = _GENERATOR
