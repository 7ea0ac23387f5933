"""megacispo's C++ CPU kernels (csrc/ beside this file), compiled at set-up or on first use.

- cpu_gemm.cpp: torch's fp32 CPU products (aten::mm, bmm, addmm, addmm_) replaced at the CPU
  dispatch key by faster kernels for the shapes this project multiplies (few rows, one row per
  batch entry, oneDNN where it takes fp32); its header says which and why.
- cpu_decode.cpp: the few-rows product those use, and ``decode_experts_cpu``, a decode step's
  routed experts of one MoE layer in one call, registered here as the fp32 CPU kernel of
  models/experts.py's op ``megacispo::decode_experts``.

torch.utils.cpp_extension builds them with the machine's C++ compiler and ninja into its extension
cache (TORCH_EXTENSIONS_DIR, by default ~/.cache/torch_extensions): tools/setup_env.sh does it, about
15 s on 2 cores; later calls only load them. They need AVX2 and FMA; where they can't be built,
torch's own kernels run, more slowly, after one warning that says why.
"""

from __future__ import annotations

import functools
import subprocess
import warnings
from pathlib import Path

import torch

EXTENSION_NAME = "megacispo_cpu_kernels"
_SOURCES = [Path(__file__).with_name("csrc") / name for name in ("cpu_decode.cpp", "cpu_gemm.cpp")]
_CFLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp"]
# torch's own libgomp is loaded first, and this library's libgomp.so.1 resolves to it: one
# OpenMP thread pool, the one torch.set_num_threads sizes.
_LDFLAGS = ["-fopenmp"]

@functools.cache
def kernels_available() -> bool:
    """Whether the kernels are loaded; the first call builds or loads them. False, with one warning,
    on a CPU without AVX2 or where the build fails."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        warnings.warn(f"megacispo's CPU kernels need AVX2 and this CPU runs torch at {capability}: "
                      "torch's own CPU kernels run instead.", stacklevel=2)
        return False
    from torch.utils import cpp_extension  # builds with ninja and g++: imported only where it builds

    try:
        cpp_extension.load(
            name=EXTENSION_NAME, sources=[str(source) for source in _SOURCES],
            extra_cflags=_CFLAGS, extra_ldflags=_LDFLAGS, is_python_module=False,
        )
    except (OSError, RuntimeError, subprocess.CalledProcessError) as error:
        warnings.warn(f"megacispo's CPU kernels did not build ({error}); torch's own CPU kernels run instead, "
                      "more slowly. They need a C++ compiler (g++) and ninja (pip install ninja).", stacklevel=2)
        return False
    return True


def enable_kernels() -> bool:
    """Put the kernels in torch's dispatch for CPU tensors (once; later calls change nothing).
    Returns whether the dense fp32 products run on oneDNN (False on CPUs without AVX-512)."""
    if not kernels_available():
        return False
    _register_decode_experts()
    return torch.ops.megacispo.enable_cpu_products()


@functools.cache
def _register_decode_experts() -> torch.library.Library:
    # Cached, so kept alive for the process: dropping a Library removes its registrations.
    library = torch.library.Library("megacispo", "IMPL")
    library.impl("decode_experts", _decode_experts, "CPU")
    return library


def disable_products() -> None:
    """torch's own CPU products again (a benchmark's peer runs on them); ``enable_kernels`` restores
    ours."""
    if kernels_available():
        torch.ops.megacispo.disable_cpu_products()


def _decode_experts(tokens, probs, top_experts, fc1_weights, fc2_weights) -> torch.Tensor:
    """megacispo::decode_experts for CPU tensors: the C++ kernel in fp32, the op's own torch
    implementation (registered as CompositeExplicitAutograd) in other dtypes."""
    if tokens.dtype == probs.dtype == torch.float32:
        return torch.ops.megacispo.decode_experts_cpu(tokens.contiguous(), probs, top_experts, fc1_weights, fc2_weights)
    # _op_dk calls the kernel registered at one dispatch key: here the torch implementation that
    # this CPU kernel overrides.
    return torch.ops.megacispo.decode_experts.default._op_dk(
        torch._C.DispatchKey.CompositeExplicitAutograd, tokens, probs, top_experts, fc1_weights, fc2_weights
    )
