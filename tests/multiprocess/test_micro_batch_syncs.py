"""Host syncs of one packed training micro-batch (HybridModel's forward and backward on a row from
megacispo.training.packing), counted on the CPU as a GPU run would make them: inside
megacispo.testing.device_guard.host_memory_guard, host memory is marked, so that a copy from it to the
run's device (``to``, ``copy_``), a read of a device value on the host (``.item()``, ``.tolist()``,
``bool(tensor)``, ...) and an op whose output shape depends on device values (``nonzero``,
``masked_select``, ...) are told apart from host bookkeeping. Outside the MoE layers' forward a
micro-batch through softmax layers makes the same small number at 2 layers and at 4: nothing per layer
(the packer's device copy of the row's offsets, tests/unit/test_packed_syncs.py for the layers' CUDA arm).
Megatron's MoE layers in training make theirs in every layer (the token dispatcher reads its split
sizes on the host), a fixed number a layer. The model's layers are softmax layers: a lightning layer's
CPU arm reads its decay rates on the host, where that costs nothing (its Triton arm reads nothing,
tests/unit/test_gpu_arms.py), and on a CPU run the host is the run's device."""

from __future__ import annotations

import inspect
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode, redispatch_function
from torch.utils._python_dispatch import TorchDispatchMode

from megacispo.testing.device_guard import HostTensor, _places_on_host
from megacispo.testing.harness import run_distributed

_READS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__,
          torch.Tensor.__index__, torch.Tensor.numpy}
_SHAPE_FROM_VALUES = {"aten::nonzero", "aten::masked_select", "aten::unique", "aten::_unique", "aten::_unique2",
                      "aten::unique_consecutive", "aten::unique_dim", "aten::bincount", "aten::repeat_interleave"}
LENGTHS = [5, 9, 3]
# The packer's copies of the row's gather index, sequence ids and offsets to the device, and
# models/model.py's copy of the host offsets for the RoPE positions (once a forward).
OUTSIDE_MOE = {"rest": 4, "rest: host-to-device copy": 4}


class _Syncs:
    """Host syncs by region: "moe" while an MoE layer's forward runs, "rest" otherwise."""

    def __init__(self) -> None:
        self.by_region: Counter[str] = Counter()
        self.region = "rest"

    def note(self, kind: str) -> None:
        self.by_region[self.region] += 1
        self.by_region[f"{self.region}: {kind}"] += 1


class _HostReadsAndCopies(TorchFunctionMode):
    def __init__(self, syncs: _Syncs) -> None:
        super().__init__()
        self.syncs = syncs

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if inspect.isfunction(func):  # Tensor.backward and the like: count inside them too
            with self:
                result = redispatch_function(func, types, args, kwargs)
        else:
            result = func(*args, **kwargs)
        source = args[0] if args else None
        if func in _READS and isinstance(source, torch.Tensor) and not isinstance(source, HostTensor):
            self.syncs.note(func.__name__)
        elif func is torch.Tensor.to and isinstance(source, HostTensor):
            if _places_on_host(func, args, kwargs) is False:  # None: a cast that stays in host memory
                self.syncs.note("host-to-device copy")
        elif func is torch.Tensor.copy_ and isinstance(args[1], HostTensor) and not isinstance(source, HostTensor):
            self.syncs.note("host-to-device copy")
        return result


class _ValueShapedOps(TorchDispatchMode):
    def __init__(self, syncs: _Syncs) -> None:
        super().__init__()
        self.syncs = syncs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name in _SHAPE_FROM_VALUES:
            self.syncs.note(func._schema.name)
        return func(*args, **(kwargs or {}))


def _micro_batch_syncs(num_layers: int) -> dict[str, int]:
    from megacispo.models.config import model_config, transformer_config
    from megacispo.models.model import HybridModel
    from megacispo.parallel.layout import ParallelConfig, init_distributed
    from megacispo.testing.device_guard import host_memory_guard
    from megacispo.training.packing import pack_rows

    config = model_config("tiny", num_layers=num_layers, layer_pattern="S")
    init_distributed(ParallelConfig(), seed=0)
    model = HybridModel(config, transformer_config(config, ParallelConfig()))
    syncs = _Syncs()

    def enter(*_):
        syncs.region = "moe"

    def leave(*_):
        syncs.region = "rest"

    for layer in model.decoder.layers:
        layer.mlp.register_forward_pre_hook(enter)
        layer.mlp.register_forward_hook(leave)
    # On the run's device, as the trainer holds its batch.
    batch = torch.randint(3, config.vocab_size, (len(LENGTHS), max(LENGTHS)), device=torch.device("cpu"))
    # The guard innermost: it marks what code in megacispo puts in host memory by its caller's frame.
    with _HostReadsAndCopies(syncs), _ValueShapedOps(syncs), host_memory_guard():
        (row,) = pack_rows(LENGTHS, max(LENGTHS), sum(LENGTHS), 1, 8, batch.device)
        tokens = row.pack(batch)
        losses = model(tokens, labels=tokens, packed_seq_params=row.packed_seq_params)
        losses.sum().backward()
    return dict(syncs.by_region)


def test_a_packed_micro_batch_syncs_the_host_as_often_at_2_layers_as_at_4_outside_the_moe_layers():
    two, four = (run_distributed(_micro_batch_syncs, 1, layers)[0] for layers in (2, 4))
    rest = {region: count for region, count in two.items() if region.startswith("rest")}
    assert rest == {region: count for region, count in four.items() if region.startswith("rest")}, (two, four)
    assert rest == OUTSIDE_MOE, two
    assert four["moe"] == 2 * two["moe"] > 0, (two, four)
