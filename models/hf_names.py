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

MiniMax-M2 (transformers' ``minimax_m2``: MiniMaxM2Config, MiniMaxM2ForCausalLM) has the same names
for what it shares with M1's softmax layers and MoE, and three more per layer: the QK-norms
``self_attn.q_norm.weight`` / ``self_attn.k_norm.weight`` and the router's selection bias
``block_sparse_moe.e_score_correction_bias`` (fused: ``mlp.e_score_correction_bias``), Megatron's
``mlp.router.expert_bias``. transformers honours M2's partial RoPE (``rotary_dim``, or
``partial_rotary_factor`` of head_dim), so HF and megacispo compute the same rotation. The released
configs carry fields transformers drops (``scoring_func``, ``use_routing_bias``, ``use_qk_norm``...):
``config_from_hf`` reads them and refuses what this model does not compute.

M2's multi-token-prediction (MTP) modules are not part of this model: no implementation defines what
they compute (transformers' MiniMaxM2 has none; vLLM's and SGLang's loaders skip their tensors) and the
released checkpoints publish no trained ones. A checkpoint that holds them keeps them under the layers
after the last (``mtp_layer_prefixes``); the readers pass over those tensors, saying so, and config_to_hf
writes ``num_mtp_modules = 0``, what the exported directory holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from megacispo.models.config import LIGHTNING, M1, M2, RESIDUAL_FACTORS, SOFTMAX, HybridModelConfig

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
QK_NORM_NAMES = {
    "self_attention.q_norm.weight": "self_attn.q_norm.weight",
    "self_attention.k_norm.weight": "self_attn.k_norm.weight",
}
ROUTER_KEY = "mlp.router.weight"
ROUTER_BIAS_KEY = "mlp.router.expert_bias"
ROUTER_BIAS_NAMES = {LEGACY: "block_sparse_moe.e_score_correction_bias", FUSED: "mlp.e_score_correction_bias"}
STACKED_EXPERTS = "mlp.experts.experts"  # the experts' keys stack every expert's tensor along a leading axis
EXPERT_FC1_KEY = f"{STACKED_EXPERTS}.linear_fc1.weight"  # [E, 2I, H]: per expert [W1; W3]
EXPERT_FC2_KEY = f"{STACKED_EXPERTS}.linear_fc2.weight"  # [E, H, I]: per expert W2
ROUTER_NAMES = {LEGACY: "block_sparse_moe.gate.weight", FUSED: "mlp.gate.weight"}
FUSED_EXPERT_NAMES = {EXPERT_FC1_KEY: "mlp.experts.gate_up_proj", EXPERT_FC2_KEY: "mlp.experts.down_proj"}
LEGACY_EXPERT_NAME = "block_sparse_moe.experts.{expert}.{matrix}.weight"

HF_LAYER_TYPES = {LIGHTNING: "linear_attention", SOFTMAX: "full_attention"}
# config.json's model_type and architectures of each family, as transformers saves them.
HF_MODEL_TYPES = {M1: "minimax", M2: "minimax_m2"}
HF_ARCHITECTURES = {M1: "MiniMaxForCausalLM", M2: "MiniMaxM2ForCausalLM"}


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
        if config.family == M2:
            names.update({**QK_NORM_NAMES, ROUTER_BIAS_KEY: ROUTER_BIAS_NAMES[experts_layout]})
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


def hf_family(model_type: Any) -> str | None:
    """The family of a config.json's model_type (None: not a MiniMax model megacispo reads)."""
    return next((family for family, name in HF_MODEL_TYPES.items() if name == model_type), None)


def mtp_layer_prefixes(hf_config: Mapping[str, Any]) -> tuple[str, ...]:
    """The name prefixes of an M2 config.json's multi-token-prediction modules, which the checkpoint
    keeps as the ``num_mtp_modules`` layers after its ``num_hidden_layers`` (as vLLM's loader reads
    them); () for any other config."""
    if hf_family(hf_config.get("model_type")) != M2:
        return ()
    first = hf_config.get("num_hidden_layers", 0)
    return tuple(f"model.layers.{first + module}." for module in range(hf_config.get("num_mtp_modules") or 0))


def config_from_hf(hf_config: Any, *, rotary_dim: int | None = None) -> HybridModelConfig:
    """Our config from a transformers MiniMaxConfig or MiniMaxM2Config (or its config.json dict).

    rotary_dim: the rotated channels per head; default the config's own ``rotary_dim`` if it has
    one (original MiniMax configs, M2's and ours), else M2's partial_rotary_factor x head_dim, else
    head_dim, which is what HF transformers computes for M1.
    """
    if isinstance(hf_config, Mapping):
        get = hf_config.get
    else:
        def get(name: str, default: Any = None) -> Any:
            return getattr(hf_config, name, default)
    family = hf_family(get("model_type")) or M1
    if family == M2:
        _check_m2_fields(get)
    if get("tie_word_embeddings", False):
        raise ValueError("HF config has tie_word_embeddings = true: this model has an untied LM head.")
    hidden, heads = get("hidden_size"), get("num_attention_heads")
    head_dim = get("head_dim") or hidden // heads
    # Released M2 configs say rope_scaling (null); transformers says rope_parameters.
    rope = dict(get("rope_parameters") or get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"HF config rope type {rope_type!r} (rope_parameters or rope_scaling): megacispo computes "
                         "plain RoPE ('default') only; use a checkpoint without RoPE scaling")
    rotary_base = rope.get("rope_theta", get("rope_theta"))
    if rotary_base is None:
        raise ValueError("HF config has no rope_parameters.rope_theta (nor rope_theta): the RoPE base is needed.")
    factor = rope.get("partial_rotary_factor", get("partial_rotary_factor")) if family == M2 else None
    common = dict(
        family=family,
        num_layers=get("num_hidden_layers"),
        hidden_size=hidden,
        num_attention_heads=heads,
        head_dim=head_dim,
        num_query_groups=get("num_key_value_heads") or heads,
        rotary_dim=rotary_dim or get("rotary_dim") or (round(factor * head_dim) if factor else head_dim),
        rotary_base=float(rotary_base),
        num_experts=get("num_local_experts"),
        moe_router_topk=get("num_experts_per_tok"),
        moe_ffn_hidden_size=get("intermediate_size"),
        moe_aux_loss_coeff=get("router_aux_loss_coef", 1e-3),
        vocab_size=get("vocab_size"),
        max_position_embeddings=get("max_position_embeddings"),
    )
    if family == M2:
        return HybridModelConfig(**common, norm_eps=get("rms_norm_eps", 1e-6), layer_pattern=SOFTMAX,
                                 **{name: 1.0 for name in RESIDUAL_FACTORS})
    return HybridModelConfig(
        **common,
        norm_eps=get("rms_norm_eps", 1e-5),
        **{name: float(get(name, 1.0)) for name in RESIDUAL_FACTORS},
        lightning_block_size=get("block_size", 256),
        layer_pattern=_pattern_from_layer_types(list(get("layer_types"))),
    )


# M2 config.json fields that transformers drops, and the one value of each that megacispo computes.
M2_FIXED_FIELDS = {
    "scoring_func": "sigmoid", "use_routing_bias": True, "use_qk_norm": True, "qk_norm_type": "per_layer",
    "shared_intermediate_size": 0, "routed_scaling_factor": 1.0, "sliding_window": None, "attn_window_size": None,
}


def _check_m2_fields(get: Callable[..., Any]) -> None:
    """Every field of an M2 config.json whose value this model does not compute, refused by name."""
    for name, value in M2_FIXED_FIELDS.items():
        found = get(name, value)
        if found != value and not (name == "sliding_window" and found in (0, -1)):
            raise ValueError(f"HF config field {name} = {found!r}: megacispo's MiniMax-M2 computes {name} = {value!r} "
                             "only; use a checkpoint with that value")
    if get("num_expert_group") not in (None, 1) or get("topk_group") not in (None, 1):
        raise ValueError(f"HF config fields num_expert_group = {get('num_expert_group')!r}, topk_group = "
                         f"{get('topk_group')!r}: megacispo's MiniMax-M2 routes over all experts as one group; use "
                         "a checkpoint without grouped routing")


def config_to_hf(config: HybridModelConfig) -> dict[str, Any]:
    """Keyword arguments of transformers' MiniMaxConfig or MiniMaxM2Config (also a config.json body, with
    model_type and architectures) for our config; M2's with the released configs' fields that
    transformers drops.

    M1: HF ignores ``rotary_dim`` and rotates whole heads: a model with rotary_dim < head_dim runs
    differently in HF transformers (see the module docstring); the field preserves the width.
    """
    common = {
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
    }
    if config.family == M2:
        common["rope_parameters"]["partial_rotary_factor"] = config.rotary_dim / config.head_dim
        return {**common, **{name: value for name, value in M2_FIXED_FIELDS.items() if value is not None},
                "use_mtp": False, "num_mtp_modules": 0}
    return {
        **common,
        "layer_types": [HF_LAYER_TYPES[kind] for kind in config.layer_kinds],
        "block_size": config.lightning_block_size,
        **{name: getattr(config, name) for name in RESIDUAL_FACTORS},
    }


def config_file(config: HybridModelConfig, dtype: str) -> dict[str, Any]:
    """The config.json of a Hugging Face directory of ``config``'s model, its weights in ``dtype`` (a
    safetensors dtype name, e.g. "float32")."""
    return {"architectures": [HF_ARCHITECTURES[config.family]], "model_type": HF_MODEL_TYPES[config.family],
            "dtype": dtype, **config_to_hf(config)}
