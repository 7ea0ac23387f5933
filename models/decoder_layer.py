"""The hybrid decoder layer and the ModuleSpecs that assemble a stage of the model.

One layer class for every layer; the layer pattern only decides which mixer spec (lightning or
softmax attention) and which residual factors a layer's spec carries. The residual is MiniMax's
scaled post-norm (the residual carries the normalized input):

    h  = input_layernorm(x);    x = alpha_mix * h  + beta_mix * mixer(h)
    h2 = pre_mlp_layernorm(x);  x = alpha_mlp * h2 + beta_mlp * moe(h2)

The MoE is Megatron-Core's MoELayer, taken from Megatron's own local GPT layer spec: a TopKRouter
(softmax over the top-k logits in fp32 = softmax, top-k, renormalize) and SequentialMLP experts
whose linear_fc1 is [W1; W3] (gate; up) with SwiGLU and linear_fc2 = W2.

Its load-balancing loss is Megatron's per-layer Switch loss, summed over layers:
coeff * E / (k T^2) * sum_e count_e * sum_t p_te. HF's load_balancing_loss_func (used when
output_router_logits is set) instead averages the counts and the probabilities over all layers
before the product and has no 1/k; the two differ in scale and form. It only shapes training.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import BaseTransformerLayer, get_transformer_layer_offset
from megatron.core.utils import get_pg_rank

from megacispo.models.config import LIGHTNING, HybridModelConfig
from megacispo.models.layers import RMSNorm
from megacispo.models.lightning_mixer import LightningMixer, LightningMixerSubmodules
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
    ) -> None:
        super().__init__(config=config)
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        # TransformerBlock passes the stage-local number; the global one (1-based) names the
        # layer in checkpoints and sets the lightning decay rates.
        self.layer_number = layer_number + get_transformer_layer_offset(config, vp_stage, get_pg_rank(pg_collection.pp))
        self.mixer_alpha, self.mixer_beta = mixer_alpha, mixer_beta
        self.mlp_alpha, self.mlp_beta = mlp_alpha, mlp_beta
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
        **unused,
    ) -> tuple[torch.Tensor, None]:
        """Returns (hidden_states, context=None), as TransformerBlock expects of a layer."""
        normed = self.input_layernorm(hidden_states)
        mixed = self.self_attention(
            normed,
            attention_mask=attention_mask,
            rotary_pos_cos=rotary_pos_cos,
            rotary_pos_sin=rotary_pos_sin,
            packed_seq_params=packed_seq_params,
            inference_context=inference_context,
        )
        hidden_states = self.mixer_alpha * normed + self.mixer_beta * mixed
        normed = self.pre_mlp_layernorm(hidden_states)
        moe_out, _ = self.mlp(normed)
        return self.mlp_alpha * normed + self.mlp_beta * moe_out, None


def moe_spec(num_experts: int) -> ModuleSpec:
    """Megatron-Core's MoE submodule spec, as its local GPT layer spec builds it (SequentialMLP
    experts with Megatron's linears; no grouped GEMM, no Transformer Engine)."""
    return get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False).submodules.mlp


def mixer_spec(hybrid_config: HybridModelConfig, kind: str) -> ModuleSpec:
    """The mixer of a layer kind: 'L' lightning attention, 'S' softmax attention."""
    if kind == LIGHTNING:
        return ModuleSpec(
            module=LightningMixer,
            params={"block_size": hybrid_config.lightning_block_size, "norm_eps": hybrid_config.lightning_norm_eps},
            submodules=LightningMixerSubmodules(),
        )
    return ModuleSpec(module=SoftmaxAttention, submodules=SoftmaxAttentionSubmodules())


def layer_spec(hybrid_config: HybridModelConfig, layer_idx: int) -> ModuleSpec:
    """The spec of global layer ``layer_idx`` (0-based): the pattern picks its mixer and residual factors."""
    mixer_alpha, mixer_beta, mlp_alpha, mlp_beta = hybrid_config.residual_factors(layer_idx)
    return ModuleSpec(
        module=HybridDecoderLayer,
        params={"mixer_alpha": mixer_alpha, "mixer_beta": mixer_beta, "mlp_alpha": mlp_alpha, "mlp_beta": mlp_beta},
        submodules=HybridLayerSubmodules(
            self_attention=mixer_spec(hybrid_config, hybrid_config.layer_kind(layer_idx)),
            mlp=moe_spec(hybrid_config.num_experts),
        ),
    )


def block_spec(
    hybrid_config: HybridModelConfig, config: TransformerConfig, pp_rank: int, vp_stage: int | None = None
) -> TransformerBlockSubmodules:
    """The layers of one pipeline stage (Megatron's split: consecutive layers) and the final norm."""
    offset = get_transformer_layer_offset(config, vp_stage, pp_rank)
    num_layers = get_num_layers_to_build(config, vp_stage, pp_rank)
    return TransformerBlockSubmodules(
        layer_specs=[layer_spec(hybrid_config, offset + i) for i in range(num_layers)],
        layer_norm=RMSNorm,
    )
