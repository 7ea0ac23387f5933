"""megacispo's C++ CPU kernels (csrc/ beside this file), compiled at set-up or on first use.

- cpu_gemm.cpp: torch's fp32 CPU products (aten::mm, bmm, addmm, addmm_) replaced at the CPU
  dispatch key by faster kernels for the shapes this project multiplies (few rows, one row per
  batch entry, oneDNN where it takes fp32); its header says which and why.
- cpu_decode.cpp: the few-rows product those use, and the fp32 CPU kernels of the model's decode-step
  ops ``megacispo::decode_experts`` (a MoE layer's routed experts in one call) and
  ``megacispo::rms_norm`` (one call where torch runs eight ops); cpu_gemm.cpp registers them.

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
    """Put the kernels in torch's dispatch for CPU tensors (once; later calls change nothing but
    what ``disable_products`` took out). Returns whether the dense fp32 products run on oneDNN
    (False on CPUs without AVX-512)."""
    return kernels_available() and torch.ops.megacispo.enable_cpu_kernels()


def disable_products() -> None:
    """torch's own CPU products again (a benchmark's peer runs on them); ``enable_kernels`` restores
    ours. The model ops keep their kernels."""
    if kernels_available():
        torch.ops.megacispo.disable_cpu_products()
