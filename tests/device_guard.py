"""Host memory as a second device on a CPU-only machine, so that the device tier
(tests/test_device_tier.py) sees what a GPU run would do with a misplaced tensor.

On a GPU run a tensor made by a factory call that names no device (``torch.zeros(n)``), by
``.cpu()``, or a generator made without a device, lives in host memory; the first op that meets it
with the GPU's tensors raises. On a CPU run both are the same memory and nothing raises. Inside
``host_memory_guard()`` the run's device stays the CPU, and what a GPU run would hold in host memory
is marked: such tensors become ``HostTensor``s (torch keeps the subclass on everything computed from
them alone), such generators remember it. A torch call, collectives included, that takes a marked
tensor together with an unmarked one, or a marked generator with unmarked tensors, raises
``DeviceMismatch``. Marked tensors used on their own (``.tolist()``, ``.item()``, host bookkeeping)
run, as they do on a GPU run; unlike ``torch.set_default_device("meta")``, real values flow, so
data-dependent code (sampling, early stops, MoE token counts) runs.

It is stricter than CUDA where CUDA would only copy or synchronize (a 0-dim host tensor in an
elementwise op, a host index into a device tensor, a host value assigned into one): SYSTEM.md's
device rule wants every tensor the code makes on the run's device. Explicit transfers (``copy_``,
``.to(device)``) are allowed. What it cannot see: a tensor made with an explicit ``device="cpu"``
or moved by ``.to("cpu")`` (the CPU is the run's device here), tensors made outside torch's Python
API (``torch.from_numpy``, legacy constructors such as ``torch.LongTensor``), compiled graphs.
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


# torch's own list of the factories that torch.set_default_device redirects.
_FACTORIES = frozenset(torch.utils._device._device_constructors())
# Factories that return their tensor argument as it is (same device) instead of copying it to the default one.
_PASS_THROUGH = frozenset({torch.as_tensor, torch.asarray})
# Explicit transfers between host memory and the device: allowed to take both.
_TRANSFERS = frozenset({torch.Tensor.copy_, torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.cuda})
_GENERATOR = torch.Generator


class _MarkedGenerator(_GENERATOR):
    """torch.Generator inside the guard: remembers whether code in scope made it without a device."""

    scope: tuple[str, ...] = ()

    def __new__(cls, device=None):
        generator = super().__new__(cls) if device is None else super().__new__(cls, device)
        on_host = device is None or torch.device(device) == HOST
        generator.on_host = on_host and _in_scope(sys._getframe(1), cls.scope)
        return generator


def _in_scope(frame, scope: tuple[str, ...]) -> bool:
    return frame.f_globals.get("__name__", "").startswith(scope)


def _tensors(values) -> Iterator[torch.Tensor]:
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from _tensors(value)


def _describe(tensors: list[torch.Tensor]) -> str:
    return ", ".join(f"{tuple(t.shape)} {t.dtype}" for t in tensors)


def _name(func) -> str:
    return getattr(func, "__qualname__", repr(func))


def _check_one_memory(func, args, kwargs) -> None:
    tensors = list(_tensors((*args, *kwargs.values())))
    host = [t for t in tensors if isinstance(t, HostTensor)]
    device = [t for t in tensors if not isinstance(t, HostTensor)]
    if host and device:
        raise DeviceMismatch(
            f"{_name(func)} takes host-memory tensors [{_describe(host)}] (made without device= or by .cpu()) "
            f"together with tensors on the run's device [{_describe(device)}]: a GPU run fails here"
        )
    if host and getattr(func, "__module__", "").startswith("torch.distributed"):
        raise DeviceMismatch(
            f"{_name(func)} takes host-memory tensors [{_describe(host)}] (made without device= or by .cpu()): "
            "a GPU run's collectives (NCCL) take tensors on the run's device only"
        )
    generator = kwargs.get("generator")
    if getattr(generator, "on_host", False) and (device or kwargs.get("device") is not None):
        raise DeviceMismatch(
            f"{_name(func)} draws with a generator made without a device for tensors on the run's device: a GPU "
            "run fails here (make it with torch.Generator(device=...))"
        )


def _target(func, args, kwargs) -> torch.device | None:
    """Where a factory or a transfer puts its result, None where it does not say."""
    if func is torch.Tensor.to:
        return torch._C._nn._parse_to(*args[1:], **kwargs)[0]
    if func is torch.Tensor.cpu:
        return HOST
    device = kwargs.get("device")
    return None if device is None else torch.device(device)


def _mark(func, args, kwargs, result, called_in_scope: bool):
    """Mark what ``func`` made in host memory when code in scope called it; unmark what an explicit
    transfer put on the run's device."""
    if func is torch.Tensor.copy_:
        return args[0]  # in place: the destination stays where it is, whatever the source
    if func not in _FACTORIES and func not in _TRANSFERS:
        return result
    target = _target(func, args, kwargs)
    if func in _PASS_THROUGH and target is None and isinstance(args[0], torch.Tensor):
        return result
    if target == HOST or (target is None and func in _FACTORIES):
        return result.as_subclass(HostTensor) if called_in_scope else result
    if target is not None and isinstance(result, HostTensor):
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
            # collectives) runs its torch calls inside this call, where a mode is switched off: run
            # it again under the mode, one override level down, so that those calls are checked too.
            # Without this a whole backward pass (custom autograd Functions) would go unchecked.
            with self:
                result = redispatch_function(func, types, args, kwargs)
        else:
            result = func(*args, **kwargs)
        # The caller's frame: torch calls a mode straight from the call site of a C++ function.
        return _mark(func, args, kwargs, result, _in_scope(sys._getframe(1), self.scope))


@contextlib.contextmanager
def host_memory_guard(scope: tuple[str, ...] = ("megacispo",)) -> Iterator[None]:
    """Run the enclosed code as a GPU run would place its tensors (see the module docstring).

    Only what code in the modules named by ``scope`` (prefixes) makes is marked: Megatron-Core and
    torch make host tensors on purpose where a GPU run keeps them on the host (token counts read
    back with .tolist(), CPU scalars that CUDA's elementwise ops take, CPU-only branches such as
    use_cpu_initialization), and their GPU behaviour is not what this tier tests. Any op, upstream
    ones included, that meets a marked tensor with an unmarked one raises."""
    _MarkedGenerator.scope = scope
    torch.Generator = _MarkedGenerator
    try:
        with _HostMemoryMode(scope):
            yield
    finally:
        torch.Generator = _GENERATOR
