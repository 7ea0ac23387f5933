"""Hugging Face names of the model's tensors and config fields: the one place that knows them.

Our names are the layout-independent checkpoint keys of ``HybridModel.sharded_state_dict()``
(what ``parallel.sharded.assemble`` and dist checkpoints use): the same at every TP / PP / EP
layout, layers by global index, experts stacked along a leading axis.

HF has two layouts of the experts:

- "legacy": on disk (the original checkpoints and what save_pretrained writes), one tensor per
  expert and matrix: model.layers.N.block_sparse_moe.experts.E.{w1, w2, w3}.weight, router
  model.layers.N.block_sparse_moe.gate.weight;
- "fused": transformers 5.x in memory, model.layers.N.mlp.experts.gate_up_proj [E, 2I, H]
  (= cat(w1, w3) per expert), mlp.experts.down_proj [E, H, I], router mlp.gate.weight.

Our linear_fc1 of expert e is [W1; W3] (gate rows, then up rows), so the stacked
``...mlp.experts.experts.linear_fc1.weight`` [E, 2I, H] is exactly HF's gate_up_proj.

Every other tensor is a rename. The lightning decay buffers (slope_rate, query_decay, key_decay,
diagonal_decay) are derived from the layer index and are neither read nor written.

HF's MiniMaxConfig applies RoPE to the whole head_dim (the original MiniMax code rotates the
first rotary_dim = head_dim / 2 channels); the rotary width is therefore carried separately:
``config_to_hf`` records it as ``rotary_dim`` (the original config's field) and
``config_from_hf`` reads it back, defaulting to what HF computes (head_dim).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from megacispo.models.config import LIGHTNING, SOFTMAX, HybridModelConfig

LEGACY = "legacy"
FUSED = "fused"
EXPERT_LAYOUTS = (LEGACY, FUSED)

# Our key -> HF name, outside the layers.
GLOBAL_NAMES = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}
# Inside layer N: our "decoder.layers.N.<suffix>" -> HF "model.layers.N.<name>", by layer kind.
LAYER_NAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
}
MIXER_NAMES = {
    LIGHTNING: {
        "self_attention.qkv_proj.weight": "self_attn.qkv_proj.weight",
        "self_attention.output_gate.weight": "self_attn.output_gate.weight",
        "self_attention.norm.weight": "self_attn.norm.weight",
        "self_attention.out_proj.weight": "self_attn.out_proj.weight",
    },
    SOFTMAX: {
        "self_attention.q_proj.weight": "self_attn.q_proj.weight",
        "self_attention.k_proj.weight": "self_attn.k_proj.weight",
        "self_attention.v_proj.weight": "self_attn.v_proj.weight",
        "self_attention.o_proj.weight": "self_attn.o_proj.weight",
    },
}
ROUTER_KEY = "mlp.router.weight"
EXPERT_FC1_KEY = "mlp.experts.experts.linear_fc1.weight"  # [E, 2I, H]: per expert [W1; W3]
EXPERT_FC2_KEY = "mlp.experts.experts.linear_fc2.weight"  # [E, H, I]: per expert W2
ROUTER_NAMES = {LEGACY: "block_sparse_moe.gate.weight", FUSED: "mlp.gate.weight"}
FUSED_EXPERT_NAMES = {EXPERT_FC1_KEY: "mlp.experts.gate_up_proj", EXPERT_FC2_KEY: "mlp.experts.down_proj"}
LEGACY_EXPERT_NAME = "block_sparse_moe.experts.{expert}.{matrix}.weight"

HF_LAYER_TYPES = {LIGHTNING: "linear_attention", SOFTMAX: "full_attention"}


@dataclass(frozen=True)
class TensorMapping:
    """One of our full tensors and the HF tensor(s) it is made of."""

    key: str
    hf_names: tuple[str, ...]
    split: Callable[[torch.Tensor], tuple[torch.Tensor, ...]]
    """Our full tensor -> the HF tensors, in hf_names order."""
    merge: Callable[[tuple[torch.Tensor, ...]], torch.Tensor]
    """The HF tensors, in hf_names order -> our full tensor."""

    def to_hf(self, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        return dict(zip(self.hf_names, self.split(tensor)))

    def from_hf(self, hf_tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        missing = [name for name in self.hf_names if name not in hf_tensors]
        if missing:
            more = " ..." if len(missing) > 4 else ""
            raise ValueError(f"HF tensors for {self.key} are missing: {missing[:4]}{more}")
        return self.merge(tuple(hf_tensors[name] for name in self.hf_names))


def _rename(key: str, hf_name: str) -> TensorMapping:
    return TensorMapping(key, (hf_name,), split=lambda t: (t,), merge=lambda ts: ts[0])


def _legacy_fc1(key: str, hf_prefix: str, num_experts: int) -> TensorMapping:
    """[E, 2I, H] <-> w1, w3 of each expert ([I, H] each), ordered expert by expert."""
    names = tuple(
        hf_prefix + LEGACY_EXPERT_NAME.format(expert=e, matrix=m) for e in range(num_experts) for m in ("w1", "w3")
    )

    def split(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(half for expert in t for half in expert.chunk(2, dim=0))

    def merge(ts: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return torch.stack([torch.cat(ts[2 * e : 2 * e + 2], dim=0) for e in range(num_experts)])

    return TensorMapping(key, names, split, merge)


def _legacy_fc2(key: str, hf_prefix: str, num_experts: int) -> TensorMapping:
    """[E, H, I] <-> w2 of each expert ([H, I])."""
    names = tuple(hf_prefix + LEGACY_EXPERT_NAME.format(expert=e, matrix="w2") for e in range(num_experts))
    return TensorMapping(key, names, split=lambda t: tuple(t.unbind(0)), merge=lambda ts: torch.stack(ts))


def tensor_mappings(config: HybridModelConfig, experts_layout: str = LEGACY) -> list[TensorMapping]:
    """Every tensor of the model with its HF name(s), layer by layer (a streaming converter can
    take them one at a time)."""
    if experts_layout not in EXPERT_LAYOUTS:
        raise ValueError(f"experts_layout = {experts_layout!r}: choose one of {EXPERT_LAYOUTS}.")
    mappings = [_rename(key, name) for key, name in GLOBAL_NAMES.items()]
    for layer in range(config.num_layers):
        ours, theirs = f"decoder.layers.{layer}.", f"model.layers.{layer}."
        names = {**LAYER_NAMES, **MIXER_NAMES[config.layer_kind(layer)], ROUTER_KEY: ROUTER_NAMES[experts_layout]}
        mappings += [_rename(ours + suffix, theirs + name) for suffix, name in names.items()]
        if experts_layout == FUSED:
            mappings += [_rename(ours + key, theirs + name) for key, name in FUSED_EXPERT_NAMES.items()]
        else:
            mappings.append(_legacy_fc1(ours + EXPERT_FC1_KEY, theirs, config.num_experts))
            mappings.append(_legacy_fc2(ours + EXPERT_FC2_KEY, theirs, config.num_experts))
    return mappings


def detect_experts_layout(hf_names: Any) -> str:
    """'legacy' or 'fused' from the names of an HF state dict."""
    if any(".block_sparse_moe." in name for name in hf_names):
        return LEGACY
    if any(name.endswith("mlp.experts.gate_up_proj") for name in hf_names):
        return FUSED
    raise ValueError("no MoE experts found among the HF tensor names: expected block_sparse_moe.* or mlp.experts.*.")


# ---------------------------------------------------------------------------------------------
# Config


def _pattern_from_layer_types(layer_types: list[str]) -> str:
    """The shortest string whose repetition gives the layer kinds."""
    by_type = {v: k for k, v in HF_LAYER_TYPES.items()}
    unknown = sorted(set(layer_types) - set(by_type))
    if unknown:
        raise ValueError(f"HF layer_types has unknown kinds {unknown}: expected {sorted(by_type)}.")
    kinds = "".join(by_type[t] for t in layer_types)
    for period in range(1, len(kinds) + 1):
        if len(kinds) % period == 0 and kinds[:period] * (len(kinds) // period) == kinds:
            return kinds[:period]
    raise AssertionError("the whole string is always a period")


def config_from_hf(hf_config: Any, *, rotary_dim: int | None = None) -> HybridModelConfig:
    """Our config from a transformers MiniMaxConfig (or its config.json dict).

    rotary_dim: the rotated channels per head; default the config's own ``rotary_dim`` if it has
    one (original MiniMax configs and ours), else head_dim, which is what HF transformers computes.
    """
    if isinstance(hf_config, Mapping):
        get = hf_config.get
    else:
        def get(name: str, default: Any = None) -> Any:
            return getattr(hf_config, name, default)
    if get("tie_word_embeddings", False):
        raise ValueError("HF config has tie_word_embeddings = true: this model has an untied LM head.")
    hidden, heads = get("hidden_size"), get("num_attention_heads")
    head_dim = get("head_dim") or hidden // heads
    rope = get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(
            f"HF rope_parameters.rope_type = {rope['rope_type']!r}: only plain RoPE ('default') is supported."
        )
    rotary_base = rope.get("rope_theta", get("rope_theta"))
    if rotary_base is None:
        raise ValueError("HF config has no rope_parameters.rope_theta (nor rope_theta): the RoPE base is needed.")
    layer_types = get("layer_types")
    return HybridModelConfig(
        num_layers=get("num_hidden_layers"),
        hidden_size=hidden,
        num_attention_heads=heads,
        head_dim=head_dim,
        num_query_groups=get("num_key_value_heads") or heads,
        rotary_dim=rotary_dim or get("rotary_dim") or head_dim,
        rotary_base=float(rotary_base),
        num_experts=get("num_local_experts"),
        moe_router_topk=get("num_experts_per_tok"),
        moe_ffn_hidden_size=get("intermediate_size"),
        moe_aux_loss_coeff=get("router_aux_loss_coef", 1e-3),
        vocab_size=get("vocab_size"),
        norm_eps=get("rms_norm_eps", 1e-5),
        linear_attn_alpha_factor=float(get("linear_attn_alpha_factor", 1.0)),
        linear_attn_beta_factor=float(get("linear_attn_beta_factor", 1.0)),
        full_attn_alpha_factor=float(get("full_attn_alpha_factor", 1.0)),
        full_attn_beta_factor=float(get("full_attn_beta_factor", 1.0)),
        mlp_alpha_factor=float(get("mlp_alpha_factor", 1.0)),
        mlp_beta_factor=float(get("mlp_beta_factor", 1.0)),
        lightning_block_size=get("block_size", 256),
        layer_pattern=_pattern_from_layer_types(list(layer_types)),
        max_position_embeddings=get("max_position_embeddings"),
    )


def config_to_hf(config: HybridModelConfig) -> dict[str, Any]:
    """Keyword arguments of transformers' MiniMaxConfig (also a config.json body) for our config.

    HF ignores ``rotary_dim`` and rotates whole heads: a model with rotary_dim < head_dim runs
    differently in HF transformers (see the module docstring); the field preserves the width.
    """
    return {
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.moe_ffn_hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_query_groups,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.norm_eps,
        "tie_word_embeddings": False,
        "num_experts_per_tok": config.moe_router_topk,
        "num_local_experts": config.num_experts,
        "router_aux_loss_coef": config.moe_aux_loss_coeff,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rotary_base},
        "rotary_dim": config.rotary_dim,
        "layer_types": [HF_LAYER_TYPES[kind] for kind in config.layer_kinds],
        "block_size": config.lightning_block_size,
        "linear_attn_alpha_factor": config.linear_attn_alpha_factor,
        "linear_attn_beta_factor": config.linear_attn_beta_factor,
        "full_attn_alpha_factor": config.full_attn_alpha_factor,
        "full_attn_beta_factor": config.full_attn_beta_factor,
        "mlp_alpha_factor": config.mlp_alpha_factor,
        "mlp_beta_factor": config.mlp_beta_factor,
    }
