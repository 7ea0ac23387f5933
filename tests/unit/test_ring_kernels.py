"""The CP pieces' kernels on the GPU path (models.softmax_cp._block_forward / _block_backward: CUDA's
flash attention for bf16, its memory-efficient attention for fp32), called as both CP schemes call them, on the meta device, whose shape functions take the
same arguments as the CUDA kernels: the calls are well formed (argument order, the forward's extra
outputs handed to the backward) and give the shapes the merge expects. The CPU path's numbers are
checked against one process in tests/multiprocess/test_softmax_cp.py."""

from __future__ import annotations

import pytest
import torch

from megacispo.models.softmax_cp import _block_backward, _block_forward


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["flash", "memory-efficient"])
@pytest.mark.parametrize("causal, queries, keys", [(True, 12, 12), (False, 5, 12)])
def test_the_gpu_block_kernels_are_called_as_their_schemas_say(causal, queries, keys, dtype):
    q = torch.empty(1, 8, queries, 128, dtype=dtype, device="meta")
    k, v = (torch.empty(1, 8, keys, 128, dtype=dtype, device="meta") for _ in range(2))
    out, lse, extra = _block_forward(q, k, v, causal, 128**-0.5)
    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == (1, 8, queries) and lse.dtype == torch.float32
    dq, dk, dv = _block_backward(torch.empty_like(out), q, k, v, out, lse, causal, 128**-0.5, extra)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
