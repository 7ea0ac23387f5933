"""A packed row's offsets go to the device once, with the row (megacispo.training.packing), and no softmax
layer copies them again: on CUDA (fake CUDA tensors: torch's shape functions) a micro-batch's softmax
layers in bf16 (varlen flash attention) make no host-to-device copy and read nothing back, at 1 layer
and at 3, given the packer's row as a GPU run holds it (host memory marked by
megacispo.testing.device_guard, the rest on the device). Params without the device copy (Megatron's
PackedSeqParams, what the packer gave before) cost a copy per layer, which the count sees."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams
from torch.utils._python_dispatch import TorchDispatchMode

from megacispo.models.softmax_attention import PackedRowParams, attend_packed_row
from megacispo.testing.device_guard import HostTensor, host_memory_guard
from megacispo.testing.fake_cuda import fake_cuda
from megacispo.training.packing import pack_rows

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16
LENGTHS = [5, 9, 3]


class _HostDeviceTraffic(TorchDispatchMode):
    """Copies from host memory to a GPU (``copy_`` and ``to``), and reads of a device value on the host."""

    def __init__(self) -> None:
        super().__init__()
        self.uploads, self.reads = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is torch.ops.aten._to_copy.default:
            self.uploads += args[0].device.type == "cpu" and out.device.type == "cuda"
        elif func is torch.ops.aten.copy_.default:
            self.uploads += args[1].device.type == "cpu" and args[0].device.type == "cuda"
        elif func is torch.ops.aten._local_scalar_dense.default:
            self.reads += 1
        return out


def _packed_row_params() -> PackedSeqParams:
    """The packer's params of a row of LENGTHS (padded to 24 tokens), host memory marked as a GPU run's."""
    with host_memory_guard():
        (row,) = pack_rows(LENGTHS, max(LENGTHS), sum(LENGTHS), 1, 8, torch.device("cpu"))
    return row.packed_seq_params


def _on_fake_cuda(params: PackedSeqParams) -> PackedSeqParams:
    """``params`` as a GPU run holds them: its host tensors on the host, the others on the GPU (fake CUDA)."""
    tensors = {field.name: getattr(params, field.name) for field in dataclasses.fields(params)}
    placed = {name: (value.tolist(), value.dtype, "cpu" if isinstance(value, HostTensor) else "cuda")
              for name, value in tensors.items() if isinstance(value, torch.Tensor)}
    return dataclasses.replace(params, **{name: torch.tensor(values, dtype=dtype, device=device)
                                          for name, (values, dtype, device) in placed.items()})


def _softmax_layers_traffic(params: PackedSeqParams, num_layers: int) -> _HostDeviceTraffic:
    """What ``num_layers`` softmax layers' attention of the packed row (SoftmaxAttention.forward's call)
    moves between host and GPU, in bf16 on fake CUDA."""
    width = params.cu_seqlens_q.tolist()[-1]  # the row's length, its trailing padding included
    with fake_cuda():
        on_gpu = _on_fake_cuda(params)
        q = torch.empty(1, HEADS, width, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        k, v = (torch.empty(1, KV_HEADS, width, HEAD_DIM, dtype=torch.bfloat16, device="cuda") for _ in range(2))
        traffic = _HostDeviceTraffic()
        with traffic:
            for _ in range(num_layers):
                out = attend_packed_row(q, k, v, on_gpu, HEAD_DIM**-0.5)
    assert out.is_cuda and out.shape == q.shape
    return traffic


def test_the_packer_puts_the_offsets_on_the_device_once_beside_the_hosts():
    params = _packed_row_params()
    assert isinstance(params, PackedRowParams)
    assert isinstance(params.cu_seqlens_q, HostTensor), "the lightning and CP layers read the offsets on the host"
    assert not isinstance(params.device_cu_seqlens, HostTensor) and params.device_cu_seqlens.dtype == torch.int32
    assert params.cu_seqlens_q.tolist() == params.device_cu_seqlens.tolist() == [0, 5, 14, 17, 24]
    assert params.max_seqlen_q == 9, "a Python int: the varlen kernel's call reads no device value"


@pytest.mark.parametrize("num_layers", [1, 3])
def test_softmax_layers_on_cuda_copy_no_offsets_and_read_nothing_back(num_layers):
    traffic = _softmax_layers_traffic(_packed_row_params(), num_layers)
    assert (traffic.uploads, traffic.reads) == (0, 0), (
        f"{num_layers} softmax layers: {traffic.uploads} host-to-device copies, {traffic.reads} device reads")


def test_params_without_the_device_copy_cost_a_copy_per_layer():
    """The count's check: Megatron's PackedSeqParams with host offsets only."""
    params = _packed_row_params()
    plain = PackedSeqParams(qkv_format="thd", cu_seqlens_q=params.cu_seqlens_q, cu_seqlens_kv=params.cu_seqlens_kv,
                            max_seqlen_q=params.max_seqlen_q, max_seqlen_kv=params.max_seqlen_kv)
    assert _softmax_layers_traffic(plain, 3).uploads == 3
