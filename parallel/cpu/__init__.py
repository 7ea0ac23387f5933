"""Everything that exists only to make megacispo run, or run faster, on a CPU-only torch: the one
CPU switch.

``enable()`` is called by ``megacispo.parallel.layout.init_distributed`` when there is no CUDA
device, and nowhere else. It

1. makes Megatron-Core 0.16.1 run on a CPU (``megatron``: CUDA calls redirected, hard-coded CUDA
   devices recompiled away, each patch naming its upstream call site), and
2. puts megacispo's C++ kernels into torch's dispatch for CPU tensors (``kernels``): torch's fp32
   products (``@``, F.linear, Megatron's linears and their backward passes) on oneDNN or, for a
   decode step's few rows, a weight-streaming kernel; and the fp32 CPU kernels of the model's
   decode-step ops ``megacispo::decode_experts`` and ``megacispo::rms_norm``.

Model and driver code read as plain Megatron-Core and torch, with no CPU/GPU branch: on a GPU
none of this is imported or applied. ``vllm`` holds the shims of vLLM's CPU build, applied by
``megacispo.rollout.vllm_engine.start_vllm`` to the engine it starts when there is no CUDA device
(they act on that engine, which exists only then).
"""

from __future__ import annotations

from megacispo.parallel.cpu import megatron
from megacispo.parallel.cpu.kernels import disable_products, enable_kernels, kernels_available

__all__ = ["disable_products", "enable", "enable_kernels", "kernels_available"]


def enable() -> None:
    """Make Megatron-Core and megacispo's model run fast on this CPU-only torch (idempotent)."""
    megatron.apply()
    enable_kernels()
