"""The Transformer Engine backend of the hybrid layers (models.decoder_layer.TRANSFORMER_ENGINE_BACKEND):
TE linears for the mixers' projections (here) and TE grouped experts for the MoE
(models.decoder_layer.te_moe_spec), so that their GEMMs run in FP8 under Megatron-Core's fp8_autocast
(TransformerBlock enters it per layer from the TransformerConfig's fp8 fields).

What stays out of FP8: the embedding and the LM head (local Megatron linears outside the decoder;
fp32 with model.fp32_lm_head), the router (Megatron's TopKRouter, an fp32 torch GEMM), the RMSNorms
(the project's own, fp32 inside) and the attention kernels. The norms are not fused into the
projections (TE's LayerNormLinear): the scaled post-norm residual needs the normalized input
itself, and each mixer feeds two to four projections from it.

Context parallelism takes these layers as it takes the local ones: everything here is per token,
and the context-parallel exchanges (chunk states, K and V) happen in the project's own attention
kernels, outside FP8. Megatron's fp8_autocast reduces the FP8 amax over the CP ranks too
(get_amax_reduction_group(with_context_parallel=True)), so CP ranks keep the same scales. The
alignment Transformer Engine's FP8 GEMMs ask of the token count applies to each rank's share of
the row, N / CP (/ TP under sequence parallelism), not to N.

Nothing here imports transformer_engine, or Megatron's TE extension, until a layer is built: the
specs name the builders, and the experts' spec names TE's grouped linears by module path (Megatron's
build_module imports a ``(module, name)`` pair when it builds), so a spec can be made and inspected on
a machine without Transformer Engine. Importing this module imports no Megatron either: the start-up
check (``require_transformer_engine``) runs before anything heavy is loaded.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util

import torch

TE_EXTENSION = "megatron.core.extensions.transformer_engine"
INSTALL_HINT = "pip install -e .[fp8]  (installs transformer-engine[pytorch]; needs a CUDA GPU and toolkit)"
# The oldest Transformer Engine each recipe needs, as megatron/core/fp8_utils.py get_fp8_recipe and
# TransformerConfig check it (FP8 grouped GEMMs for the experts need 1.11).
MIN_TE_VERSION = {"delayed": "1.11.0", "tensorwise": "2.2.0.dev0", "blockwise": "2.3.0.dev0", "mxfp8": "2.1.0"}
# MXFP8 GEMMs exist on Blackwell (compute capability 10) and later.
MXFP8_MIN_CAPABILITY = (10, 0)


def transformer_engine_installed() -> bool:
    """Whether transformer_engine can be imported (found without importing it)."""
    return importlib.util.find_spec("transformer_engine") is not None


def transformer_engine_version() -> str:
    """The installed Transformer Engine's version (its distribution metadata, else its __version__)."""
    for distribution in ("transformer-engine", "transformer_engine"):
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    import transformer_engine

    return str(transformer_engine.__version__)


def require_transformer_engine(fp8_recipe: str | None) -> None:
    """Raise ValueError, naming the setting and the fix, unless this machine can build the
    Transformer Engine layers and, with ``fp8_recipe``, run that recipe."""
    from packaging.version import Version

    wanted = f"precision.fp8 = {fp8_recipe!r}" if fp8_recipe else "precision.use_transformer_engine = true"
    if not transformer_engine_installed():
        raise ValueError(f"{wanted} needs Transformer Engine, which is not installed: {INSTALL_HINT}")
    if fp8_recipe is None:
        return
    version = transformer_engine_version()
    if Version(version) < Version(MIN_TE_VERSION[fp8_recipe]):
        raise ValueError(
            f"{wanted} needs transformer-engine >= {MIN_TE_VERSION[fp8_recipe]}, but {version} is installed: "
            f"upgrade it ({INSTALL_HINT}) or choose another precision.fp8 recipe."
        )
    if not torch.cuda.is_available():
        raise ValueError(f"{wanted}: FP8 GEMMs need a CUDA GPU (Hopper or newer); set precision.fp8 = null here.")
    capability = torch.cuda.get_device_capability()
    if fp8_recipe == "mxfp8" and capability < MXFP8_MIN_CAPABILITY:
        raise ValueError(
            f"{wanted} needs a Blackwell GPU (compute capability >= 10.0), this one has {capability}: "
            f"use precision.fp8 = blockwise or tensorwise."
        )


@functools.cache
def _column_shard_linear_class() -> type:
    """TEColumnShardLinear, defined on first use: its base class is Megatron's TELinear."""
    from megatron.core.extensions.transformer_engine import TELinear
    from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint
    from megatron.core.utils import divide

    class TEColumnShardLinear(TELinear):
        """This rank's rows of a column-parallel projection as a Transformer Engine Linear that does
        no communication: the mixer has already entered the tensor-parallel region once for all its
        projections (layers.enter_tensor_parallel_region), which TEColumnParallelLinear would repeat
        (its own all-gather, and an all-reduce of the input gradient). Weight [output / TP, input],
        sharded along dim 0 in checkpoints like ColumnParallelLinear's."""

        def __init__(self, input_size: int, output_size: int, *, config, tp_group) -> None:
            super().__init__(
                input_size, divide(output_size, tp_group.size()), parallel_mode=None, config=config,
                init_method=config.init_method, bias=False, skip_bias_add=False,
                skip_weight_param_allocation=False, is_expert=False, tp_group=tp_group,
            )
            set_tensor_model_parallel_attributes(self.weight, is_parallel=True, dim=0, stride=1)

        def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
            return make_sharded_tensors_for_checkpoint(
                self.state_dict(prefix="", keep_vars=True), prefix, {"weight": 0}, sharded_offsets,
                tp_group=self._tp_group, dp_cp_group=(metadata or {}).get("dp_cp_group"),
            )

    return TEColumnShardLinear


def te_column_parallel_linear(config, input_size: int, output_size: int, tp_group):
    """TE counterpart of layers.local_column_parallel_linear (input already in the TP region)."""
    return _column_shard_linear_class()(input_size, output_size, config=config, tp_group=tp_group)


def te_row_parallel_linear(config, input_size: int, output_size: int, tp_group):
    """TE counterpart of layers.row_parallel_linear: all-reduce, or reduce-scatter along the sequence
    under sequence parallelism."""
    from megatron.core.extensions.transformer_engine import TERowParallelLinear

    return TERowParallelLinear(
        input_size, output_size, config=config, init_method=config.output_layer_init_method, bias=False,
        input_is_parallel=True, skip_bias_add=True, is_expert=False, tp_group=tp_group,
    )
