"""megacispo's C++ CPU kernels (models/csrc/), compiled at set-up or on first use.

Decoding (cpu_decode.cpp):

- ``torch.ops.megacispo.few_rows_linear(rows, weight)``: F.linear for 1 to 16 rows, each weight
  row read once for all the rows (``layers.few_rows_linear`` says when it is used);
- ``torch.ops.megacispo.decode_experts_cpu(tokens, probs, top_experts, fc1_weights, fc2_weights)``:
  a decode step's routed experts of one MoE layer in one call (``experts.decode_experts``);
- ``torch.ops.megacispo.rms_norm_rows(rows, weight, eps)``: RMSNorm of a decode step's few rows in
  one call (``layers.RMSNorm``).

Training (cpu_swiglu.cpp): ``torch.ops.megacispo.swiglu_forward(projected, probs)`` and
``swiglu_backward(grad_weighted, projected, probs)``, an expert's SwiGLU times its routing weight
and its gradient, one pass each (``experts.expert_mlp`` under autograd).

Dense products (cpu_matmul.cpp): ``torch.ops.megacispo.onednn_mm(a, b)`` and
``onednn_addmm_(out, a, b)``, fp32 products on oneDNN's kernels (``matmul`` says when and why).

torch.utils.cpp_extension builds them with the machine's C++ compiler and ninja into its extension
cache (TORCH_EXTENSIONS_DIR, by default ~/.cache/torch_extensions): tools/setup_env.sh does it, about
15 s on 2 cores; later calls only load them. They need AVX2 and FMA; where they can't be built,
decoding, the experts' SwiGLU and the dense products run torch's ops instead, more slowly, after
one warning that says why.
"""

from __future__ import annotations

import subprocess
import warnings
from pathlib import Path

import torch

EXTENSION_NAME = "megacispo_cpu_kernels"
_SOURCES = [
    Path(__file__).with_name("csrc") / name for name in ("cpu_decode.cpp", "cpu_swiglu.cpp", "cpu_matmul.cpp")
]
_CFLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp"]
# torch's own libgomp is loaded first, and this library's libgomp.so.1 resolves to it: one
# OpenMP thread pool, the one torch.set_num_threads sizes.
_LDFLAGS = ["-fopenmp"]

_loaded: bool | None = None  # None until the first cpu_kernels_available()


def cpu_kernels_available() -> bool:
    """Whether the kernels are loaded; the first call builds or loads them. False, with one warning,
    on a CPU without AVX2 or where the build fails. Call it once before torch.compile traces a
    caller: the trace then reads the answer instead of building."""
    global _loaded
    if _loaded is None:
        _loaded = _load()
    return _loaded


def cpu_kernels_apply(*tensors: torch.Tensor) -> bool:
    """Whether the kernels take these tensors: all fp32 on a CPU, and the kernels loaded."""
    on_cpu_in_fp32 = all(tensor.dtype == torch.float32 and tensor.device.type == "cpu" for tensor in tensors)
    return on_cpu_in_fp32 and cpu_kernels_available()


def _load() -> bool:
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        warnings.warn(f"megacispo's CPU kernels need AVX2 and this CPU runs torch at {capability}: decoding, "
                      "the experts' SwiGLU and the dense products run torch's ops instead.", stacklevel=3)
        return False
    from torch.utils import cpp_extension

    try:
        cpp_extension.load(
            name=EXTENSION_NAME, sources=[str(source) for source in _SOURCES],
            extra_cflags=_CFLAGS, extra_ldflags=_LDFLAGS, is_python_module=False,
        )
    except (OSError, RuntimeError, subprocess.CalledProcessError) as error:
        warnings.warn(f"megacispo's CPU kernels did not build ({error}); decoding, the experts' SwiGLU and the "
                      "dense products run torch's ops instead, more slowly. They need a C++ compiler (g++) and "
                      "ninja (pip install ninja).",
                      stacklevel=3)
        return False
    torch.library.register_fake("megacispo::few_rows_linear")(_few_rows_linear_shape)
    torch.library.register_fake("megacispo::decode_experts_cpu")(_decode_experts_shape)
    return True


def _few_rows_linear_shape(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return rows.new_empty(rows.shape[0], weight.shape[0])


def _decode_experts_shape(tokens, probs, top_experts, fc1_weights, fc2_weights) -> torch.Tensor:
    return torch.empty_like(tokens)
