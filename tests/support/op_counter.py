"""Count the kernels a decode step would launch on a GPU, by counting torch ops on the CPU.

``OpCounter`` counts every aten op that runs under it, except those that launch nothing on a GPU
(views, and allocations without a fill such as ``empty``), with two corrections so that the count
is a CUDA build's and not the CPU build's:

- this project's custom ops (``megacispo::...``) count as a CUDA build runs them: one kernel for an
  op with a CUDA kernel of its own (the decode step's expert bookkeeping, models/experts_triton.py),
  else its composite implementation, op by op (where the CPU layer serves it with one C++ kernel);
- ``torch.nn.functional.rms_norm``, which the CPU build decomposes into six ops, counts as the one
  fused kernel (``aten::_fused_rms_norm``) that a CUDA build of torch 2.13 runs for it (the casts
  around it still count);
- a ``torch.distributed`` collective counts as its one ``c10d::`` op: gloo finishes some (the
  reduce-scatter) with a copy into the output, where NCCL's one kernel writes the output itself.

Reads of a device value on the host (``item``, ``tolist``, ``bool(tensor)``, ``int(tensor)``, ...)
and ops whose output shape depends on the values (``nonzero``, ``masked_select``, ``unique``,
``bincount``, ...) are listed in ``host_syncs`` (the ops among them are counted too).
``counting_as`` attributes ops to a region (a decoder layer): ``layer_op_counts`` gives the ops per
layer of a model's decode step. ``compiled_kernels`` counts the kernels of a compiled step instead,
in the code torch.compile generated for it.
"""

from __future__ import annotations

import contextlib
import re
from collections import Counter
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

# Metadata and uninitialized allocations: no kernel on a GPU.
_NO_KERNEL = {
    "aten::empty", "aten::empty_strided", "aten::empty_like", "aten::new_empty", "aten::_unsafe_view",
    "aten::lift_fresh", "aten::detach", "aten::alias", "aten::set_", "aten::resize_", "aten::_reshape_alias",
    "aten::promote_types",
}
# A device-to-host read, or an output whose size the host must learn from the device.
HOST_SYNC_OPS = {
    "aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::unique", "aten::_unique",
    "aten::_unique2", "aten::unique_consecutive", "aten::unique_dim", "aten::bincount", "aten::repeat_interleave",
    "aten::_assert_async", "aten::equal", "aten::is_nonzero", "aten::allclose",
}
_FUSED_ON_CUDA = {F.rms_norm, torch.rms_norm}
_HOST_READS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__int__,
               torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.numpy}


class OpCounter(TorchDispatchMode):
    """Counts the kernel-launching ops run under it: ``by_op`` (op name -> count), ``by_region``,
    ``host_syncs`` (names of host syncs, in order) and ``syncs_by_region``."""

    def __init__(self) -> None:
        super().__init__()
        self.by_op: Counter[str] = Counter()
        self.by_region: Counter[str] = Counter()
        self.host_syncs: list[str] = []
        self.syncs_by_region: Counter[str] = Counter()
        self.region: str | None = None
        self._fused_depth = 0
        self._collective_depth = 0

    @property
    def total(self) -> int:
        return sum(self.by_op.values())

    def count(self, name: str) -> None:
        self.by_op[name] += 1
        if self.region is not None:
            self.by_region[self.region] += 1
        if name in HOST_SYNC_OPS:
            self.host_sync(name)

    def host_sync(self, name: str) -> None:
        self.host_syncs.append(name)
        if self.region is not None:
            self.syncs_by_region[self.region] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "megacispo" and not has_cuda_kernel(func.name()):
            with self:
                return func.redispatch(_COMPOSITE, *args, **kwargs)
        out = func(*args, **kwargs)
        name = func._schema.name
        if self._collective_depth and not name.startswith("c10d::"):
            return out
        if self._fused_depth == 0 and name not in _NO_KERNEL and (not func.is_view or _copied(args, out)):
            self.count(name)
        return out

    def __enter__(self):
        self._functions = _FusedFunctions(self)
        self._functions.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        result = super().__exit__(*exc)
        self._functions.__exit__(*exc)
        return result

    @contextlib.contextmanager
    def counting_as(self, region: str) -> Iterator[None]:
        """Ops (and host syncs) run inside are also counted under ``region`` in ``by_region``
        (``syncs_by_region``)."""
        outer, self.region = self.region, region
        try:
            yield
        finally:
            self.region = outer


def _copied(args: tuple, out) -> bool:
    """Whether an op that may return an alias of its input (``to``, ``contiguous``, ``reshape``: the
    forms a custom op's composite implementation runs them in) made a new tensor: a copy kernel."""
    if not isinstance(out, torch.Tensor):
        return False
    inputs = {arg.untyped_storage().data_ptr() for arg in args if isinstance(arg, torch.Tensor)}
    return out.untyped_storage().data_ptr() not in inputs


_COMPOSITE = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)


class _FusedFunctions(TorchFunctionMode):
    """Counts a function a CUDA build runs as one fused kernel once, and not the ops it decomposes into here."""

    def __init__(self, counter: OpCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _HOST_READS:
            # A CPU build reads these without dispatching an op; on a GPU each waits for the device.
            self.counter.host_sync(func.__name__)
        if getattr(func, "__module__", "").startswith("torch.distributed"):
            self.counter._collective_depth += 1
            try:
                return func(*args, **kwargs)
            finally:
                self.counter._collective_depth -= 1
        if func not in _FUSED_ON_CUDA or self.counter._fused_depth:
            return func(*args, **kwargs)
        if not args[0].is_contiguous():
            self.counter.count("aten::clone")  # the fused kernel reads a contiguous copy of a strided input
        self.counter.count("aten::_fused_rms_norm")
        self.counter._fused_depth += 1
        try:
            return func(*args, **kwargs)
        finally:
            self.counter._fused_depth -= 1


@contextlib.contextmanager
def counting_layers(counter: OpCounter, layers: list[torch.nn.Module], method: str) -> Iterator[None]:
    """Within it, the ops each of ``layers`` runs in its ``method`` (``step`` on the lean path,
    ``forward`` on Megatron's) are counted under region ``layer <i>``: an instance attribute wraps the
    method, removed on exit."""
    for index, layer in enumerate(layers):
        bound = getattr(layer, method)

        def counted(*args, _bound: Callable = bound, _region: str = f"layer {index}", **kwargs):
            with counter.counting_as(_region):
                return _bound(*args, **kwargs)

        setattr(layer, method, counted)
    try:
        yield
    finally:
        for layer in layers:
            delattr(layer, method)


def layer_op_counts(counter: OpCounter) -> list[int]:
    """Ops counted per ``layer <i>`` region, in layer order."""
    layers = sorted((int(region.split()[1]), count) for region, count in counter.by_region.items()
                    if region.startswith("layer "))
    return [count for _, count in layers]


# The lines of inductor's generated ``call`` that launch kernels: its fused kernels (``cpp_fused_*`` for a
# CPU, ``triton_*`` for a GPU), the library kernels it calls (``extern_kernels.mm``, ...) and the ops it
# leaves to aten, this project or c10d (``torch.ops.aten.sort``, a collective).
_COMPILED_KERNEL_CALL = re.compile(
    r"^[ \t]+(?:\w+ = )?(cpp_fused_\w+|triton_\w+\.run|extern_kernels\.\w+|torch\.ops\.[\w.]+)\(", re.MULTILINE
)


def compiled_kernels(code: str) -> int:
    """The kernels one run of a compiled graph launches, read from its generated code (the sources
    ``torch._inductor.utils.run_and_get_code`` returns): a call each. A collective's wait launches
    none (NCCL's is a stream wait). This project's ops (``megacispo::...``) count one if they have a
    CUDA kernel of their own (as ``OpCounter`` counts them); the others, whose kernels the code does
    not show, are refused."""
    calls = _COMPILED_KERNEL_CALL.findall(code)
    project_ops = {call for call in calls if call.startswith("torch.ops.megacispo.")}
    if hidden := sorted(call for call in project_ops if not has_cuda_kernel(f"megacispo::{call.split('.')[3]}")):
        raise ValueError(f"the compiled graph calls {hidden}, whose kernels its code does not show")
    return sum(call != "torch.ops._c10d_functional.wait_tensor.default" for call in calls)


def has_cuda_kernel(op_name: str) -> bool:
    """Whether the op ``op_name`` (``namespace::name``) has a CUDA kernel of its own."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(op_name, "CUDA")
