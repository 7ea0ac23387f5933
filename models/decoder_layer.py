"""The hybrid decoder layer and the ModuleSpecs that assemble a stage of the model.

One layer class for every layer of both families; the layer pattern only decides which mixer spec
(lightning or softmax attention) and which residual factors a layer's spec carries, the family
whether the softmax mixer has QK-norm and which residual the layer adds. M1's residual is MiniMax's
scaled post-norm (the residual carries the normalized input):

    h  = input_layernorm(x);    x = alpha_mix * h  + beta_mix * mixer(h)
    h2 = pre_mlp_layernorm(x);  x = alpha_mlp * h2 + beta_mlp * moe(h2)

M2's is the plain pre-norm one: x = x + mixer(input_layernorm(x)); x = x + moe(pre_mlp_layernorm(x)).

The MoE is Megatron-Core's MoELayer, taken from Megatron's own local GPT layer spec: a TopKRouter
(softmax over the top-k logits in fp32 = softmax, top-k, renormalize) and SequentialMLP experts
whose linear_fc1 is [W1; W3] (gate; up) with SwiGLU and linear_fc2 = W2 (as SkipEmptySequentialMLP,
models/experts.py: the same module and checkpoint keys with a cheaper forward).

Where the linears come from is a ``LayerBackend``: local Megatron linears and SequentialMLP experts,
or Transformer Engine linears (models/te_specs.py) and grouped experts (``te_moe_spec``), chosen by the
TransformerConfig's transformer_impl. The layer pattern picks the mixer either way; the norms, the
router and the attention kernels are the same modules in both.

Full activation recompute is done by the layer itself (``recompute``): Megatron's block-level full
recompute calls the layers without the RoPE cos / sin.

Its load-balancing loss is Megatron's per-layer Switch loss, summed over layers:
coeff * E / (k T^2) * sum_e count_e * sum_t p_te. HF's load_balancing_loss_func (used when
output_router_logits is set) instead averages the counts and the probabilities over all layers
before the product and has no 1/k; the two differ in scale and form. It only shapes training.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Callable

import torch
from megatron.core import tensor_parallel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.moe_layer import MoESubmodules
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import BaseTransformerLayer, get_transformer_layer_offset
from megatron.core.utils import get_pg_rank

from megacispo.models import te_specs
from megacispo.models.config import LIGHTNING, HybridModelConfig, LoraConfig
from megacispo.models.experts import (
    InProcessMoELayer,
    PaddingMaskedTopKRouter,
    SkipEmptySequentialMLP,
    StackingTEGroupedMLP,
)
from megacispo.models.layers import (
    AttentionStep,
    InferenceCache,
    RMSNorm,
    ScaledResidual,
    TensorParallelRMSNorm,
    local_column_parallel_linear,
    row_parallel_linear,
)
from megacispo.models.lightning_mixer import LightningMixer, LightningMixerSubmodules
from megacispo.models.lora import LoraColumnParallelLinear, LoraRowParallelLinear
from megacispo.models.softmax_attention import SoftmaxAttention, SoftmaxAttentionSubmodules


@dataclass
class HybridLayerSubmodules:
    """The four parts of a decoder layer."""

    input_layernorm: ModuleSpec | type = RMSNorm
    self_attention: ModuleSpec | type | None = None
    pre_mlp_layernorm: ModuleSpec | type = RMSNorm
    mlp: ModuleSpec | type | None = None


class HybridDecoderLayer(MegatronModule, BaseTransformerLayer):
    """One decoder layer: [s(/TP), b, H] -> [s(/TP), b, H], called by Megatron's TransformerBlock."""

    def __init__(
        self,
        config: TransformerConfig,
        submodules: HybridLayerSubmodules,
        layer_number: int = 1,
        pg_collection: ProcessGroupCollection | None = None,
        vp_stage: int | None = None,
        *,
        mixer_alpha: float,
        mixer_beta: float,
        mlp_alpha: float,
        mlp_beta: float,
        prenorm_residual: bool = False,
        recompute: bool = False,
    ) -> None:
        super().__init__(config=config)
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        self.tp_group = pg_collection.tp
        self.recompute = recompute
        # TransformerBlock passes the stage-local number; the global one (1-based) names the
        # layer in checkpoints and sets the lightning decay rates.
        self.layer_number = layer_number + get_transformer_layer_offset(config, vp_stage, get_pg_rank(pg_collection.pp))
        self.mixer_residual = ScaledResidual(mixer_alpha, mixer_beta)
        self.mlp_residual = ScaledResidual(mlp_alpha, mlp_beta)
        self.prenorm_residual = prenorm_residual
        norm_args = dict(config=config, hidden_size=config.hidden_size, eps=config.layernorm_epsilon)
        self.input_layernorm = build_module(submodules.input_layernorm, **norm_args)
        self.self_attention = build_module(
            submodules.self_attention, config=config, layer_number=self.layer_number, pg_collection=pg_collection
        )
        self.pre_mlp_layernorm = build_module(submodules.pre_mlp_layernorm, **norm_args)
        self.mlp = build_module(submodules.mlp, config=config, pg_collection=pg_collection)
        self.mlp.set_layer_number(self.layer_number)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        rotary_pos_cos: torch.Tensor | None = None,
        rotary_pos_sin: torch.Tensor | None = None,
        packed_seq_params=None,
        inference_context=None,
        padding_mask: torch.Tensor | None = None,
        **unused,
    ) -> tuple[torch.Tensor, None]:
        """Returns (hidden_states, context=None), as TransformerBlock expects of a layer.
        padding_mask [b, s(/TP)] bool, True at padding: for the MoE router's statistics only."""
        if not (self.recompute and self.training and torch.is_grad_enabled() and inference_context is None):
            return self._layer(
                hidden_states, attention_mask, rotary_pos_cos, rotary_pos_sin, packed_seq_params, inference_context,
                padding_mask,
            ), None

        # The recompute in backward routes as this forward did: the same replayed experts (models/routing.py).
        routes = self.mlp.router.router_replay
        pinned = routes.pinned() if routes is not None else None

        def run(hidden_states, attention_mask, rotary_pos_cos, rotary_pos_sin):
            if pinned is not None:
                routes.restore(pinned)
            return self._layer(
                hidden_states, attention_mask, rotary_pos_cos, rotary_pos_sin, packed_seq_params, None, padding_mask
            )

        # Only the layer input (and the mask and RoPE tables) is kept; backward runs the layer again.
        # Under FP8, Transformer Engine's checkpoint keeps the scaling state of the two forwards apart.
        args = (hidden_states, attention_mask, rotary_pos_cos, rotary_pos_sin)
        if self.config.fp8:
            from megatron.core.extensions.transformer_engine import te_checkpoint

            return te_checkpoint(run, False, tensor_parallel.get_cuda_rng_tracker, self.tp_group, *args), None
        return tensor_parallel.checkpoint(run, False, *args), None

    def _layer(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None,
        rotary_pos_cos: torch.Tensor | None,
        rotary_pos_sin: torch.Tensor | None,
        packed_seq_params,
        inference_context,
        padding_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        normed = self.input_layernorm(hidden_states)
        mixed = self.self_attention(
            normed,
            attention_mask=attention_mask,
            rotary_pos_cos=rotary_pos_cos,
            rotary_pos_sin=rotary_pos_sin,
            packed_seq_params=packed_seq_params,
            inference_context=inference_context,
        )
        hidden_states = self.mixer_residual(hidden_states if self.prenorm_residual else normed, mixed)
        normed = self.pre_mlp_layernorm(hidden_states)
        moe_out, _ = self.mlp(normed, padding_mask=padding_mask)
        return self.mlp_residual(hidden_states if self.prenorm_residual else normed, moe_out)

    def step(self, hidden: torch.Tensor, cache: InferenceCache, attention: AttentionStep | None = None) -> torch.Tensor:
        """One token per sequence, for HybridModel.decode_step: hidden [b, H] (every TP rank the same) -> [b, H],
        what forward computes for a one-token decode step, through the mixer's and the MoE's
        ``step`` (no Megatron linears, router or token dispatcher in this process), each of which adds
        its residual in its last product. ``attention``: what the step's softmax layers share
        (``AttentionStep``; None in a model without them). With the pre-norm residual (M2) the steps
        return their updates alone (``UPDATE_ONLY``: their products read no residual) and the layer
        adds them to its input, one add each."""
        if self.prenorm_residual:
            hidden = hidden + self.self_attention.step(self.input_layernorm.step(hidden), cache, attention, UPDATE_ONLY)
            return hidden + self.mlp.step(self.pre_mlp_layernorm.step(hidden), UPDATE_ONLY, cache.rows_agree)
        normed = self.input_layernorm.step(hidden)
        hidden = self.self_attention.step(normed, cache, attention, self.mixer_residual)
        normed = self.pre_mlp_layernorm.step(hidden)
        return self.mlp.step(normed, self.mlp_residual, cache.rows_agree)


# A step's update without its residual: alpha 0 (row_parallel_step's addmm and the experts' last product
# then read no residual), beta 1 (no product).
UPDATE_ONLY = ScaledResidual(0.0, 1.0)


def local_moe_spec(num_experts: int, lora: LoraConfig | None = None) -> ModuleSpec:
    """Megatron-Core's MoE submodule spec, as its local GPT layer spec builds it (no grouped GEMM, no
    Transformer Engine), as InProcessMoELayer with SkipEmptySequentialMLP experts: the same modules,
    parameters and checkpoint keys with cheaper forwards (models/experts.py). ``lora``: the experts'
    linear_fc1 / linear_fc2 that it targets get adapters, each expert its own."""
    spec = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False).submodules.mlp
    linears = spec.submodules.experts.submodules
    if lora is not None:
        linears = dataclasses.replace(
            linears,
            **{
                name: ModuleSpec(module=adapted, params=params)
                for name, adapted, params in (
                    ("linear_fc1", LoraColumnParallelLinear, {"lora": lora, "gated": True}),
                    ("linear_fc2", LoraRowParallelLinear, {"lora": lora}),
                )
                if lora.adapts(name)
            },
        )
    experts = dataclasses.replace(spec.submodules.experts, module=SkipEmptySequentialMLP, submodules=linears)
    return dataclasses.replace(
        spec, module=InProcessMoELayer,
        submodules=dataclasses.replace(spec.submodules, experts=experts, router=PaddingMaskedTopKRouter),
    )


def te_moe_spec(num_experts: int, lora: LoraConfig | None = None) -> ModuleSpec:
    """The MoE layer with Transformer Engine grouped experts (one grouped GEMM for all local experts;
    fc1 = [W1; W3] with SwiGLU, fc2 = W2, as SequentialMLP): Megatron's MoELayer and TEGroupedMLP as
    InProcessMoELayer and StackingTEGroupedMLP (the same parameters and keys), whose lean decode step
    runs the experts' stacked weights as the local layers' does. TEGroupedMLP pads each expert's
    tokens to what FP8 GEMMs need. Its grouped linears are named by module path (Megatron's
    build_module imports them when it builds), so the spec is made without Transformer Engine.
    ``num_experts`` comes from the TransformerConfig at build time; it is taken to match
    local_moe_spec's signature. Adapters are local layers' alone (megacispo.startup refuses LoRA with
    Transformer Engine layers)."""
    del num_experts
    _check_no_adapters(lora, "Transformer Engine grouped experts")
    experts = ModuleSpec(
        module=StackingTEGroupedMLP,
        submodules=MLPSubmodules(
            linear_fc1=ModuleSpec(module=(te_specs.TE_EXTENSION, "TEColumnParallelGroupedLinear")),
            linear_fc2=ModuleSpec(module=(te_specs.TE_EXTENSION, "TERowParallelGroupedLinear")),
        ),
    )
    return ModuleSpec(
        module=InProcessMoELayer,
        submodules=MoESubmodules(experts=experts, router=PaddingMaskedTopKRouter),
        metainfo={"fuse_pre_mlp_layernorm": False},
    )


@dataclass(frozen=True)
class LayerBackend:
    """Where a layer's linears come from. A projection builder is called as
    (config, input_size, output_size, tp_group); column-parallel ones take an input that the mixer
    has already brought into the tensor-parallel region."""

    name: str
    column_parallel_linear: Callable
    row_parallel_linear: Callable
    moe: Callable[[int, LoraConfig | None], ModuleSpec]
    """(num_experts, lora) -> the MoE layer's spec."""


LOCAL_BACKEND = LayerBackend(
    name="local",
    column_parallel_linear=local_column_parallel_linear,
    row_parallel_linear=row_parallel_linear,
    moe=local_moe_spec,
)
TRANSFORMER_ENGINE_BACKEND = LayerBackend(
    name="transformer_engine",
    column_parallel_linear=te_specs.te_column_parallel_linear,
    row_parallel_linear=te_specs.te_row_parallel_linear,
    moe=te_moe_spec,
)


def layer_backend(config: TransformerConfig) -> LayerBackend:
    """Transformer Engine layers when the config asks for them. models.config.transformer_config
    always sets transformer_impl (Megatron's own default is transformer_engine)."""
    return TRANSFORMER_ENGINE_BACKEND if config.transformer_impl == "transformer_engine" else LOCAL_BACKEND


def _check_no_adapters(lora: LoraConfig | None, layers: str) -> None:
    if lora is not None and lora.enabled:
        raise ValueError(f"lora.rank = {lora.rank}: adapters sit on local layers only, not on {layers}")


def mixer_spec(
    hybrid_config: HybridModelConfig, kind: str, backend: LayerBackend = LOCAL_BACKEND, lora: LoraConfig | None = None
) -> ModuleSpec:
    """The mixer of a layer kind: 'L' lightning attention, 'S' softmax attention; the projections that
    ``lora`` targets get adapters (models/lora.py)."""

    def projection(name: str, row_parallel: bool) -> Callable:
        if lora is None or not lora.adapts(name):
            return backend.row_parallel_linear if row_parallel else backend.column_parallel_linear
        if backend is not LOCAL_BACKEND:
            _check_no_adapters(lora, f"{backend.name} linears")
        if row_parallel:
            return functools.partial(row_parallel_linear, linear=LoraRowParallelLinear, lora=lora)
        return functools.partial(local_column_parallel_linear, linear=LoraColumnParallelLinear, lora=lora)

    if kind == LIGHTNING:
        return ModuleSpec(
            module=LightningMixer,
            params={"block_size": hybrid_config.lightning_block_size, "norm_eps": hybrid_config.lightning_norm_eps},
            submodules=LightningMixerSubmodules(
                qkv_proj=projection("qkv_proj", False), output_gate=projection("output_gate", False),
                out_proj=projection("out_proj", True),
            ),
        )
    qk_norm = TensorParallelRMSNorm if hybrid_config.qk_norm else None
    return ModuleSpec(
        module=SoftmaxAttention,
        submodules=SoftmaxAttentionSubmodules(
            q_proj=projection("q_proj", False), k_proj=projection("k_proj", False),
            v_proj=projection("v_proj", False), o_proj=projection("o_proj", True), q_norm=qk_norm, k_norm=qk_norm,
        ),
    )


def layer_spec(
    hybrid_config: HybridModelConfig, layer_idx: int, backend: LayerBackend = LOCAL_BACKEND, recompute: bool = False,
    lora: LoraConfig | None = None,
) -> ModuleSpec:
    """The spec of global layer ``layer_idx`` (0-based): the pattern picks its mixer and residual
    factors, the backend its linears, ``lora`` the linears with adapters; ``recompute``: keep only the
    layer's input for backward."""
    mixer_alpha, mixer_beta, mlp_alpha, mlp_beta = hybrid_config.residual_factors(layer_idx)
    return ModuleSpec(
        module=HybridDecoderLayer,
        params={
            "mixer_alpha": mixer_alpha, "mixer_beta": mixer_beta, "mlp_alpha": mlp_alpha, "mlp_beta": mlp_beta,
            "prenorm_residual": hybrid_config.prenorm_residual, "recompute": recompute,
        },
        submodules=HybridLayerSubmodules(
            self_attention=mixer_spec(hybrid_config, hybrid_config.layer_kind(layer_idx), backend, lora),
            mlp=backend.moe(hybrid_config.num_experts, lora),
        ),
    )


def recomputes_layer(config: TransformerConfig, stage_layer_idx: int) -> bool:
    """Full recompute (models.config.recompute_kwargs) of a stage's ``stage_layer_idx``-th layer:
    every layer with method uniform, the first recompute_num_layers of the stage with block."""
    if config.recompute_granularity is not None or config.recompute_method is None:
        return False
    return config.recompute_method == "uniform" or stage_layer_idx < config.recompute_num_layers


def block_spec(
    hybrid_config: HybridModelConfig, config: TransformerConfig, pp_rank: int, vp_stage: int | None = None,
    lora: LoraConfig | None = None,
) -> TransformerBlockSubmodules:
    """The layers of one pipeline stage (Megatron's split: consecutive layers) and the final norm;
    ``lora``: the adapters."""
    offset = get_transformer_layer_offset(config, vp_stage, pp_rank)
    num_layers = get_num_layers_to_build(config, vp_stage, pp_rank)
    backend = layer_backend(config)
    return TransformerBlockSubmodules(
        layer_specs=[
            layer_spec(hybrid_config, offset + i, backend, recomputes_layer(config, i), lora) for i in range(num_layers)
        ],
        layer_norm=RMSNorm,
    )
