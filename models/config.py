"""The MiniMax MoE models' configuration: its fields, their validation, the named sizes, the
parameter count, and its translation to Megatron-Core's TransformerConfig.

Two families share the layers (``model.family``):

- ``minimax-m1``: the hybrid lightning-attention model. The layer pattern is a string of ``L``
  (lightning attention) and ``S`` (softmax attention) repeated over the layers: MiniMax-M1's 80
  layers are ``"LLLLLLLS"`` ten times (softmax attention at 0-based layers 7, 15, ..., 79). The
  residual carries the normalized input, scaled (``*_alpha_factor``); the router is a softmax.
- ``minimax-m2``: MiniMax-M2 / M2.1 / M2.5, every layer softmax attention with QK-norm (an RMSNorm
  over all heads' projected queries, and one over the keys), the plain pre-norm residual, and a
  sigmoid router whose per-expert score-correction bias chooses the experts but does not weigh them.

How the model computes (weight dtype, FP8 GEMMs through Transformer Engine, activation recompute)
is not architecture: ``PrecisionConfig`` and ``RecomputeConfig`` hold it, and ``transformer_config``
turns all three into Megatron-Core's TransformerConfig.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from megacispo.parallel.layout import FP32_MATMUL_PRECISIONS, ModelShape, ParallelConfig, run_device

LIGHTNING = "L"
SOFTMAX = "S"
M1 = "minimax-m1"
M2 = "minimax-m2"
FAMILIES = (M1, M2)


@dataclass(kw_only=True)
class HybridModelConfig:
    """Dimensions and numerics of a MiniMax MoE decoder: M1's hybrid lightning attention or M2's."""

    family: str = "minimax-m1"
    """minimax-m1 (hybrid lightning/softmax, scaled post-norm residual, softmax router) or minimax-m2 (softmax attention with QK-norm, pre-norm residual, sigmoid router with a selection bias)."""
    num_layers: int
    """Decoder layers L (lightning and softmax together)."""
    hidden_size: int
    """Residual stream width H."""
    num_attention_heads: int
    """Query heads of every mixer (lightning attention has as many key/value heads)."""
    head_dim: int
    """Channels per head d; the attention width num_attention_heads * head_dim may differ from H."""
    num_query_groups: int
    """Key/value heads of the softmax-attention layers (GQA)."""
    rotary_dim: int
    """RoPE rotates the first rotary_dim channels of each softmax head (MiniMax: head_dim / 2; HF: head_dim)."""
    rotary_base: float
    """RoPE base (theta)."""
    num_experts: int
    """Routed experts per MoE layer (every layer has one; no shared expert)."""
    moe_router_topk: int
    """Experts each token is sent to; their softmax weights are renormalized to sum to 1."""
    moe_ffn_hidden_size: int
    """Intermediate width I of each SwiGLU expert."""
    moe_aux_loss_coeff: float = 1e-3
    """Coefficient of the Switch-style load-balancing loss."""
    moe_router_bias_update_rate: float = 0.0
    """minimax-m2: each update moves every expert's selection bias this far toward equal loads (aux-loss-free balancing; 0: the bias stays as loaded)."""
    vocab_size: int
    """Vocabulary size V (untied embedding and LM head)."""
    norm_eps: float = 1e-5
    """Epsilon of the layer RMSNorms and the final RMSNorm."""
    lightning_norm_eps: float = 1e-6
    """Epsilon of the RMSNorm over the nh * d lightning-attention output channels (HF's default)."""
    linear_attn_alpha_factor: float
    """Weight of the normalized input in the residual after a lightning-attention mixer."""
    linear_attn_beta_factor: float = 1.0
    """Weight of the lightning-attention output in its residual."""
    full_attn_alpha_factor: float
    """Weight of the normalized input in the residual after a softmax-attention mixer."""
    full_attn_beta_factor: float = 1.0
    """Weight of the softmax-attention output in its residual."""
    mlp_alpha_factor: float
    """Weight of the normalized input in the residual after the MoE."""
    mlp_beta_factor: float = 1.0
    """Weight of the MoE output in its residual."""
    lightning_block_size: int = 256
    """Block length B of the block-wise lightning attention (numerics do not depend on it)."""
    layer_pattern: str = "LLLLLLLS"
    """Mixer kinds, L = lightning, S = softmax, repeated over the layers; its length must divide num_layers."""
    max_position_embeddings: int = 131072
    """Longest sequence: bounds prompt plus response at start-up, recorded for conversion (RoPE has no limit)."""
    fp32_lm_head: bool = True
    """Compute the LM head and everything after it in fp32 even when the model runs in bf16."""
    freeze_router: bool = False
    """Train without updating the MoE routers' weights (they get requires_grad = False, so no gradient or optimizer state)."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the field, its value and the fix."""
        for name in ("num_layers", "hidden_size", "num_attention_heads", "head_dim", "num_query_groups",
                     "num_experts", "moe_router_topk", "moe_ffn_hidden_size", "vocab_size",
                     "lightning_block_size", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"model.{name} = {value!r}: it must be a positive integer.")
        for name in ("norm_eps", "lightning_norm_eps", "rotary_base"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model.{name} = {getattr(self, name)!r}: it must be positive.")
        if self.family not in FAMILIES:
            raise ValueError(f"model.family = {self.family!r}: choose one of {', '.join(FAMILIES)}.")
        if self.moe_router_bias_update_rate < 0:
            raise ValueError(
                f"model.moe_router_bias_update_rate = {self.moe_router_bias_update_rate!r}: it must be >= 0 (0: off)."
            )
        if self.family == M1 and self.moe_router_bias_update_rate:
            raise ValueError(
                f"model.moe_router_bias_update_rate = {self.moe_router_bias_update_rate!r} with model.family = "
                f"{M1!r}: M1's softmax router has no selection bias; set it to 0."
            )
        if self.moe_aux_loss_coeff < 0:
            raise ValueError(
                f"model.moe_aux_loss_coeff = {self.moe_aux_loss_coeff!r}: it must be >= 0 (0 turns it off)."
            )
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"model.num_query_groups = {self.num_query_groups} does not divide num_attention_heads = "
                f"{self.num_attention_heads}: choose a divisor of the head count."
            )
        if self.rotary_dim < 2 or self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise ValueError(
                f"model.rotary_dim = {self.rotary_dim}: it must be even and in [2, head_dim = {self.head_dim}] "
                f"(MiniMax uses head_dim / 2, HF transformers head_dim)."
            )
        if self.moe_router_topk > self.num_experts:
            raise ValueError(
                f"model.moe_router_topk = {self.moe_router_topk} exceeds num_experts = {self.num_experts}: "
                f"route to at most num_experts experts."
            )
        if not self.layer_pattern or set(self.layer_pattern) - {LIGHTNING, SOFTMAX}:
            raise ValueError(
                f"model.layer_pattern = {self.layer_pattern!r}: use only {LIGHTNING!r} (lightning) and "
                f"{SOFTMAX!r} (softmax), e.g. 'LLLLLLLS'."
            )
        if self.num_layers % len(self.layer_pattern):
            raise ValueError(
                f"model.layer_pattern = {self.layer_pattern!r} (length {len(self.layer_pattern)}) does not "
                f"divide num_layers = {self.num_layers}: give a pattern whose length divides the layer count "
                f"(or one character per layer)."
            )
        if self.family == M2:
            self._validate_m2()

    def _validate_m2(self) -> None:
        if set(self.layer_pattern) != {SOFTMAX}:
            raise ValueError(
                f"model.layer_pattern = {self.layer_pattern!r} with model.family = {M2!r}: every M2 layer is softmax "
                f"attention; set model.layer_pattern = {SOFTMAX!r}."
            )
        for name in RESIDUAL_FACTORS:
            if getattr(self, name) != 1.0:
                raise ValueError(
                    f"model.{name} = {getattr(self, name)!r} with model.family = {M2!r}: M2's residual is the "
                    f"plain pre-norm x + f(norm(x)); set it to 1.0."
                )

    @property
    def prenorm_residual(self) -> bool:
        """x + f(norm(x)) (M2) rather than M1's alpha * norm(x) + beta * f(norm(x))."""
        return self.family == M2

    @property
    def qk_norm(self) -> bool:
        """RMSNorms over the projected queries and keys (all heads together) before RoPE (M2)."""
        return self.family == M2

    @property
    def router_score_function(self) -> str:
        """Megatron's moe_router_score_function: softmax (M1) or sigmoid with the selection bias (M2)."""
        return "sigmoid" if self.family == M2 else "softmax"

    def layer_kind(self, layer_idx: int) -> str:
        """'L' or 'S' for the 0-based global layer index."""
        return self.layer_pattern[layer_idx % len(self.layer_pattern)]

    @property
    def layer_kinds(self) -> str:
        """One character per layer."""
        return "".join(self.layer_kind(i) for i in range(self.num_layers))

    def residual_factors(self, layer_idx: int) -> tuple[float, float, float, float]:
        """(mixer alpha, mixer beta, mlp alpha, mlp beta) of a layer."""
        if self.layer_kind(layer_idx) == LIGHTNING:
            mixer = (self.linear_attn_alpha_factor, self.linear_attn_beta_factor)
        else:
            mixer = (self.full_attn_alpha_factor, self.full_attn_beta_factor)
        return (*mixer, self.mlp_alpha_factor, self.mlp_beta_factor)

    def replace(self, **changes) -> HybridModelConfig:
        """A validated copy with some fields changed."""
        return dataclasses.replace(self, **changes)


RESIDUAL_FACTORS = ("linear_attn_alpha_factor", "linear_attn_beta_factor", "full_attn_alpha_factor",
                    "full_attn_beta_factor", "mlp_alpha_factor", "mlp_beta_factor")


def deepnorm_alpha(num_layers: int) -> float:
    """MiniMax's residual weight alpha = (2 L)^(1/4)."""
    return (2 * num_layers) ** 0.25


# What makes a shape MiniMax-M2's: softmax attention in every layer, the residual factors 1.
M2_FIELDS = {"family": M2, "layer_pattern": SOFTMAX, "linear_attn_alpha_factor": 1.0, "full_attn_alpha_factor": 1.0,
             "mlp_alpha_factor": 1.0}


def _sized_m2(**fields) -> HybridModelConfig:
    return HybridModelConfig(**M2_FIELDS, **fields)


def _sized(num_layers: int, **fields) -> HybridModelConfig:
    alpha = deepnorm_alpha(num_layers)
    return HybridModelConfig(
        num_layers=num_layers,
        linear_attn_alpha_factor=alpha,
        full_attn_alpha_factor=alpha,
        mlp_alpha_factor=alpha,
        **fields,
    )


MODEL_SIZES = {
    # CPU tests: ~0.6M parameters, two lightning blocks in a 32-token sequence.
    "tiny": lambda: _sized(
        8, hidden_size=64, num_attention_heads=4, head_dim=16, num_query_groups=2, rotary_dim=8,
        rotary_base=10_000.0, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=64, vocab_size=512,
        lightning_block_size=16, max_position_embeddings=4096,
    ),
    # CPU benchmarks: ~30M parameters.
    "small": lambda: _sized(
        8, hidden_size=256, num_attention_heads=8, head_dim=32, num_query_groups=2, rotary_dim=16,
        rotary_base=10_000.0, num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=384, vocab_size=16384,
        lightning_block_size=64, max_position_embeddings=8192,
    ),
    # MiniMax-M1 / MiniMax-Text-01 (456B total, 45.9B activated).
    "minimax-m1": lambda: _sized(
        80, hidden_size=6144, num_attention_heads=64, head_dim=128, num_query_groups=8, rotary_dim=64,
        rotary_base=10_000_000.0, num_experts=32, moe_router_topk=2, moe_ffn_hidden_size=9216,
        vocab_size=200_064, lightning_block_size=256, max_position_embeddings=10_240_000,
    ),
    # CPU tests of the M2 family: the tiny shape with M2's layers.
    "tiny-m2": lambda: _sized_m2(
        num_layers=8, hidden_size=64, num_attention_heads=4, head_dim=16, num_query_groups=2, rotary_dim=8,
        rotary_base=5_000_000.0, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=64, vocab_size=512,
        norm_eps=1e-6, max_position_embeddings=4096,
    ),
    # MiniMax-M2 / M2.1 / M2.5 (about 230B total, 10B activated).
    "minimax-m2": lambda: _sized_m2(
        num_layers=62, hidden_size=3072, num_attention_heads=48, head_dim=128, num_query_groups=8, rotary_dim=64,
        rotary_base=5_000_000.0, num_experts=256, moe_router_topk=8, moe_ffn_hidden_size=1536, vocab_size=200_064,
        norm_eps=1e-6, max_position_embeddings=196_608,
    ),
}


def model_config(name: str, **overrides) -> HybridModelConfig:
    """A named size, optionally with some fields changed."""
    if name not in MODEL_SIZES:
        raise ValueError(f"model size {name!r} is unknown: choose one of {sorted(MODEL_SIZES)}.")
    config = MODEL_SIZES[name]()
    return config.replace(**overrides) if overrides else config


def parameter_breakdown(config: HybridModelConfig) -> dict[str, int]:
    """Parameter counts per component (all layers together)."""
    hidden, width = config.hidden_size, config.num_attention_heads * config.head_dim
    kv_width = config.num_query_groups * config.head_dim
    num_lightning = config.layer_kinds.count(LIGHTNING)
    num_softmax = config.num_layers - num_lightning
    expert = 3 * hidden * config.moe_ffn_hidden_size  # gate, up and down projections
    return {
        "embedding": config.vocab_size * hidden,
        "lm_head": config.vocab_size * hidden,
        # qkv_proj, output_gate, out_proj and the output RMSNorm over nh * d channels.
        "lightning_attention": num_lightning * (3 * hidden * width + 2 * hidden * width + width),
        "softmax_attention": num_softmax * (2 * hidden * width + 2 * hidden * kv_width
                                            + (width + kv_width if config.qk_norm else 0)),
        "router": config.num_layers * config.num_experts * hidden,
        "experts": config.num_layers * config.num_experts * expert,
        "norms": (2 * config.num_layers + 1) * hidden,
    }


def parameter_counts(config: HybridModelConfig) -> tuple[int, int]:
    """(total, activated) parameters; activated excludes the embedding and the LM head and counts
    only the top-k experts of each layer, as the MiniMax model card does."""
    parts = parameter_breakdown(config)
    total = sum(parts.values())
    inactive_experts = config.num_layers * (config.num_experts - config.moe_router_topk)
    inactive = inactive_experts * 3 * config.hidden_size * config.moe_ffn_hidden_size
    activated = total - parts["embedding"] - parts["lm_head"] - inactive
    return total, activated


def model_shape(config: HybridModelConfig) -> ModelShape:
    """The dimensions a parallel layout must divide (for parallel.layout.validate_layout)."""
    return ModelShape(
        num_layers=config.num_layers,
        num_attention_heads=config.num_attention_heads,
        num_query_groups=config.num_query_groups,
        num_experts=config.num_experts,
        moe_ffn_hidden_size=config.moe_ffn_hidden_size,
    )


PARAMS_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Megatron-Core's fp8_recipe names; "tensorwise" is Transformer Engine's per-tensor current scaling.
FP8_RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8")
FP8_FORMATS = ("hybrid", "e4m3")
# Transformer Engine's default format per recipe (Float8BlockScaling and MXFP8BlockScaling use E4M3).
DEFAULT_FP8_FORMAT = {"delayed": "hybrid", "tensorwise": "hybrid", "blockwise": "e4m3", "mxfp8": "e4m3"}
FP8_AMAX_COMPUTE_ALGOS = ("max", "most_recent")
RECOMPUTE_GRANULARITIES = ("none", "selective", "full")
RECOMPUTE_METHODS = ("uniform", "block")
# Megatron recompute_modules that the hybrid layers honour: MoELayer checkpoints itself ("moe"),
# Transformer Engine's grouped experts recompute their SwiGLU ("moe_act"). Megatron's "core_attn" and
# "layernorm" act inside its own TransformerLayer and attention, which this model does not use.
SELECTIVE_RECOMPUTE_MODULES = ("moe", "moe_act")


@dataclass(kw_only=True)
class PrecisionConfig:
    """Numerics of training: the weight dtype and FP8 GEMMs through Transformer Engine.

    FP8 covers the GEMMs of the mixers' projections and of the experts. The embedding, the LM head
    (fp32 with model.fp32_lm_head), the router (fp32), the RMSNorms and the attention kernels stay
    out of it.
    """

    params_dtype: str = "float32"
    """Weights and activations: float32, or bfloat16 (the optimizer keeps fp32 master weights and the
    gradients accumulate in fp32)."""
    fp8: str | None = None
    """FP8 scaling recipe, Megatron-Core's names: delayed (amax history), tensorwise (per-tensor current
    scaling), blockwise (1x128 / 128x128 blocks, Transformer Engine >= 2.3), mxfp8 (Blackwell GPUs);
    null: no FP8. Needs params_dtype bfloat16 and Transformer Engine (pip install -e .[fp8])."""
    fp8_format: str | None = None
    """hybrid (E4M3 forward, E5M2 gradients) or e4m3; null: Transformer Engine's default for the
    recipe (hybrid for delayed and tensorwise, e4m3 for blockwise and mxfp8)."""
    fp8_margin: int = 0
    """delayed: scale = (fp8 max / amax) / 2^margin."""
    fp8_amax_history_len: int = 1024
    """delayed: how many steps of amax the scale is computed from."""
    fp8_amax_compute_algo: str = "max"
    """delayed: max (the largest amax in the history) or most_recent."""
    use_transformer_engine: bool = False
    """Build the projections and experts from Transformer Engine layers even without FP8 (FP8 always
    does)."""
    fp32_matmul: str = "ieee"
    """How fp32 matrix products run on GPUs (fp32 weights, the fp32 LM head, the routers): ieee (full fp32,
    what the fp32 LM head is there for) or tf32 (tensor cores, a 10-bit mantissa); set on every rank."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the field, its value and the fix."""
        if self.params_dtype not in PARAMS_DTYPES:
            raise ValueError(
                f"precision.params_dtype = {self.params_dtype!r}: choose one of {', '.join(PARAMS_DTYPES)}."
            )
        if self.fp32_matmul not in FP32_MATMUL_PRECISIONS:
            raise ValueError(
                f"precision.fp32_matmul = {self.fp32_matmul!r}: choose one of {', '.join(FP32_MATMUL_PRECISIONS)} "
                f"(ieee: full fp32; tf32: tensor cores, faster and less precise)."
            )
        if self.fp8 is None:
            return
        if self.fp8 not in FP8_RECIPES:
            raise ValueError(
                f"precision.fp8 = {self.fp8!r}: choose one of {', '.join(FP8_RECIPES)} (tensorwise is "
                f"current scaling), or null for no FP8."
            )
        if self.params_dtype != "bfloat16":
            raise ValueError(
                f"precision.fp8 = {self.fp8!r} with precision.params_dtype = {self.params_dtype!r}: FP8 GEMMs "
                f"take bf16 weights and activations; set precision.params_dtype = bfloat16."
            )
        if self.fp8_format is not None and self.fp8_format not in FP8_FORMATS:
            raise ValueError(
                f"precision.fp8_format = {self.fp8_format!r}: choose one of {', '.join(FP8_FORMATS)}, or null "
                f"for the recipe's default."
            )
        if self.fp8_margin < 0:
            raise ValueError(f"precision.fp8_margin = {self.fp8_margin}: it must be >= 0.")
        if self.fp8_amax_history_len < 1:
            raise ValueError(f"precision.fp8_amax_history_len = {self.fp8_amax_history_len}: it must be >= 1.")
        if self.fp8_amax_compute_algo not in FP8_AMAX_COMPUTE_ALGOS:
            raise ValueError(
                f"precision.fp8_amax_compute_algo = {self.fp8_amax_compute_algo!r}: choose one of "
                f"{', '.join(FP8_AMAX_COMPUTE_ALGOS)}."
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        return PARAMS_DTYPES[self.params_dtype]

    @property
    def transformer_engine(self) -> bool:
        """Whether the layers are built from Transformer Engine."""
        return self.use_transformer_engine or self.fp8 is not None


@dataclass(kw_only=True)
class RecomputeConfig:
    """Activation recompute: keep less for backward and compute it again.

    full: a layer keeps only its input and is run again in backward (the hybrid layer checkpoints
    itself: Megatron's block-level full recompute does not pass the RoPE cos / sin on to the layers).
    selective: Megatron's per-module recompute inside the MoE (``modules``).
    """

    granularity: str = "none"
    """none, selective or full (tools/plan.py --recompute takes the same names)."""
    method: str = "uniform"
    """full only: uniform (every layer) or block (the first num_layers layers of each pipeline stage)."""
    num_layers: int = 1
    """full only: layers recomputed per pipeline stage with method block; 1 with method uniform."""
    modules: list[str] = field(default_factory=lambda: ["moe"])
    """selective only: Megatron recompute_modules, of moe (the whole MoE layer) and moe_act (the
    experts' SwiGLU; Transformer Engine's grouped experts only)."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the field, its value and the fix."""
        if self.granularity not in RECOMPUTE_GRANULARITIES:
            raise ValueError(
                f"recompute.granularity = {self.granularity!r}: choose one of {', '.join(RECOMPUTE_GRANULARITIES)}."
            )
        if self.granularity == "full":
            if self.method not in RECOMPUTE_METHODS:
                raise ValueError(
                    f"recompute.method = {self.method!r}: choose one of {', '.join(RECOMPUTE_METHODS)}."
                )
            if self.method == "uniform" and self.num_layers != 1:
                raise ValueError(
                    f"recompute.num_layers = {self.num_layers} with recompute.method = 'uniform': hybrid layers "
                    f"are recomputed one at a time; set recompute.num_layers = 1, or use method block to "
                    f"recompute only the first num_layers layers of each stage."
                )
            if self.num_layers < 1:
                raise ValueError(f"recompute.num_layers = {self.num_layers}: it must be at least 1.")
        if self.granularity == "selective":
            unknown = sorted(set(self.modules) - set(SELECTIVE_RECOMPUTE_MODULES))
            if unknown or not self.modules:
                raise ValueError(
                    f"recompute.modules = {self.modules!r}: choose a non-empty list of "
                    f"{', '.join(SELECTIVE_RECOMPUTE_MODULES)}."
                )


# The linears an adapter can sit on, by their module names: the lightning layers' projections, the
# softmax layers' projections, and every expert's fc1 ([gate; up]) and fc2 (down).
LORA_LIGHTNING_TARGETS = ("qkv_proj", "output_gate", "out_proj")
LORA_SOFTMAX_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
LORA_EXPERT_TARGETS = ("linear_fc1", "linear_fc2")
LORA_TARGETS = LORA_LIGHTNING_TARGETS + LORA_SOFTMAX_TARGETS + LORA_EXPERT_TARGETS
ALL_LINEAR = "all-linear"  # every target the model has (PEFT's name for it)


@dataclass(kw_only=True)
class LoraConfig:
    """Low-rank adapters: each targeted linear computes W x + (alpha / rank) B A x with W frozen, A
    [rank, in] and B [out, rank] trained (B starts at zero: the model starts as the base). Every expert
    has its own A and B. The embedding, the norms, the routers and the LM head stay frozen."""

    rank: int = 0
    """The adapters' rank; 0: no adapters (every weight trains)."""
    alpha: float = 16.0
    """The update's scale is alpha / rank."""
    dropout: float = 0.0
    """Dropout on the adapters' input while training (rollouts and scoring run without it)."""
    targets: list[str] = field(default_factory=lambda: ["all-linear"])
    """The linears that get adapters, by module name: qkv_proj, output_gate, out_proj (lightning
    layers), q_proj, k_proj, v_proj, o_proj (softmax layers), linear_fc1, linear_fc2 (experts); all-linear:
    every one the model has."""

    def __post_init__(self) -> None:
        self.validate()

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        """alpha / rank: what B A x is multiplied by."""
        return self.alpha / self.rank

    def validate(self) -> None:
        """Raise ValueError naming the field, its value and the fix."""
        if self.rank < 0:
            raise ValueError(f"lora.rank = {self.rank}: use a positive rank, or 0 for no adapters.")
        if not self.enabled:
            return
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora.dropout = {self.dropout}: use a probability in [0, 1).")
        unknown = sorted(set(self.targets) - {*LORA_TARGETS, ALL_LINEAR})
        if unknown or not self.targets:
            raise ValueError(
                f"lora.targets = {self.targets!r}: {unknown or 'empty'}; choose [{ALL_LINEAR}] or a non-empty list of "
                f"{', '.join(LORA_TARGETS)} (the router, the norms, the embedding and the LM head take no adapters)."
            )

    def merged(self, weight: torch.Tensor, down: torch.Tensor, up: torch.Tensor,
               dtype: torch.dtype | None = None) -> torch.Tensor:
        """``weight + scale * up @ down`` (W + s B A; A = ``down``, B = ``up``, any leading expert axes), computed
        in at least fp32, in ``dtype`` (default: weight's): what rollouts and the merged export multiply."""
        wide = torch.promote_types(weight.dtype, torch.float32)
        merged = torch.add(weight.to(wide), up.to(wide) @ down.to(wide), alpha=self.scale)
        return merged.to(dtype or weight.dtype)

    def adapts(self, target: str) -> bool:
        """Whether the linears named ``target`` (a LORA_TARGETS name) get adapters."""
        return self.enabled and (target in self.targets or ALL_LINEAR in self.targets)

    def adapted_targets(self, config: HybridModelConfig) -> list[str]:
        """The targets (LORA_TARGETS names, in that order) that get adapters in ``config``'s model."""
        dims = lora_target_dims(config)
        return [target for target in LORA_TARGETS if target in dims and self.adapts(target)]

    def check_model(self, config: HybridModelConfig) -> None:
        """Every target names a linear the model has, and the rank is below every adapted layer's
        dimensions (a low-rank update of rank >= min(in, out) is a full one with more parameters)."""
        if not self.enabled:
            return
        dims = lora_target_dims(config)
        absent = [target for target in self.targets if target not in dims and target != ALL_LINEAR]
        if absent:
            raise ValueError(
                f"lora.targets = {self.targets!r}: {absent} name no layer of this {config.family} model (its "
                f"linears: {', '.join(dims)}); remove them."
            )
        for target in self.adapted_targets(config):
            in_features, out_features = dims[target]
            if self.rank >= min(in_features, out_features):
                raise ValueError(
                    f"lora.rank = {self.rank}: {target} is [{out_features}, {in_features}], so a rank-{self.rank} "
                    f"update is not low-rank; use lora.rank < {min(in_features, out_features)} or drop {target} "
                    f"from lora.targets."
                )


def is_adapter_parameter(name: str) -> bool:
    """Whether a parameter name or checkpoint key names an adapter's A or B (models/lora.py)."""
    return name.endswith((".lora_A", ".lora_B"))


# A part of a model's weights (what a checkpoint or a weight sync holds of a LoRA model): every weight, the
# adapters alone, or the base alone.
ALL_WEIGHTS, ADAPTERS, BASE = "all", "adapters", "base"


def in_weights(name: str, weights: str) -> bool:
    """Whether the parameter name or checkpoint key ``name`` belongs to ``weights`` (ALL_WEIGHTS, ADAPTERS, BASE)."""
    return weights == ALL_WEIGHTS or is_adapter_parameter(name) == (weights == ADAPTERS)


def lora_target_dims(config: HybridModelConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each linear an adapter can sit on, in this model (whole, not sharded)."""
    hidden, ffn = config.hidden_size, config.moe_ffn_hidden_size
    dims = {"linear_fc1": (hidden, 2 * ffn), "linear_fc2": (ffn, hidden)}
    if LIGHTNING in config.layer_pattern:
        lightning = config.num_attention_heads * config.head_dim
        dims |= {"qkv_proj": (hidden, 3 * lightning), "output_gate": (hidden, lightning),
                 "out_proj": (lightning, hidden)}
    if SOFTMAX in config.layer_pattern:
        queries = config.num_attention_heads * config.head_dim
        keys = config.num_query_groups * config.head_dim
        dims |= {"q_proj": (hidden, queries), "k_proj": (hidden, keys), "v_proj": (hidden, keys),
                 "o_proj": (queries, hidden)}
    return dims


def check_precision_and_recompute(
    config: HybridModelConfig, parallel: ParallelConfig, precision: PrecisionConfig, recompute: RecomputeConfig
) -> None:
    """The checks that span the model, the layout, precision and recompute."""
    if recompute.granularity == "selective" and "moe_act" in recompute.modules:
        if not precision.transformer_engine:
            raise ValueError(
                "recompute.modules has moe_act, which only Transformer Engine's grouped experts honour: set "
                "precision.use_transformer_engine = true (or precision.fp8), or use recompute.modules = [moe]."
            )
        if precision.fp8 == "delayed":
            raise ValueError(
                "recompute.modules has moe_act with precision.fp8 = 'delayed': Megatron-Core does not "
                "recompute the SwiGLU under delayed scaling; use fp8 tensorwise or blockwise, or modules [moe]."
            )
    layers_per_stage = config.num_layers // parallel.pipeline_model_parallel_size
    if recompute.granularity == "full" and recompute.method == "block" and recompute.num_layers > layers_per_stage:
        raise ValueError(
            f"recompute.num_layers = {recompute.num_layers} exceeds the {layers_per_stage} layers of a pipeline "
            f"stage (model.num_layers {config.num_layers} / pipeline_model_parallel_size "
            f"{parallel.pipeline_model_parallel_size}): choose at most {layers_per_stage}."
        )


def precision_kwargs(precision: PrecisionConfig) -> dict:
    """TransformerConfig fields for ``precision`` (separate so they can be checked without Transformer
    Engine: TransformerConfig itself asks Transformer Engine for its version once fp8 is set)."""
    kwargs = {
        "params_dtype": precision.torch_dtype,
        "pipeline_dtype": precision.torch_dtype,
        "bf16": precision.params_dtype == "bfloat16",
        "transformer_impl": "transformer_engine" if precision.transformer_engine else "local",
        # Transformer Engine's experts are grouped GEMMs (TEGroupedMLP); the local ones a loop.
        "moe_grouped_gemm": precision.transformer_engine,
    }
    if precision.fp8 is not None:
        kwargs.update(
            fp8=precision.fp8_format or DEFAULT_FP8_FORMAT[precision.fp8],
            fp8_recipe=precision.fp8,
            fp8_margin=precision.fp8_margin,
            fp8_amax_history_len=precision.fp8_amax_history_len,
            fp8_amax_compute_algo=precision.fp8_amax_compute_algo,
        )
    return kwargs


def recompute_kwargs(recompute: RecomputeConfig) -> dict:
    """TransformerConfig fields for ``recompute``.

    Full recompute sets recompute_method and recompute_num_layers but leaves recompute_granularity
    unset: with granularity "full", Megatron's TransformerBlock would checkpoint the layers itself and
    drop the RoPE cos / sin on the way (transformer_block.py _checkpointed_forward passes only
    rotary_pos_emb). The hybrid layer reads the two fields and checkpoints itself
    (decoder_layer.recomputes_layer).
    """
    if recompute.granularity == "full":
        return {"recompute_method": recompute.method, "recompute_num_layers": recompute.num_layers}
    if recompute.granularity == "selective":
        return {"recompute_granularity": "selective", "recompute_modules": list(recompute.modules)}
    return {}


def transformer_config(
    config: HybridModelConfig,
    parallel: ParallelConfig,
    *,
    params_dtype: torch.dtype | None = None,
    precision: PrecisionConfig | None = None,
    recompute: RecomputeConfig | None = None,
    init_method_std: float = 0.02,
):
    """Megatron-Core's TransformerConfig for this model under ``parallel``.

    precision: weight dtype, Transformer Engine and FP8 (default: fp32, local layers); or, for a
    plain float32 / bfloat16 model, just params_dtype. bf16 sets Megatron's bf16 flag, so that its
    mixed-precision optimizer keeps fp32 master weights. recompute: activation recompute (default
    none). On a CPU-only torch weights are created on the CPU. Dense-MLP fields are unused: every
    layer's MLP is the MoE.
    """
    from megatron.core.transformer import TransformerConfig

    if precision is None:
        dtype = torch.float32 if params_dtype is None else params_dtype
        names = {value: name for name, value in PARAMS_DTYPES.items()}
        if dtype not in names:
            raise ValueError(f"params_dtype = {dtype}: use torch.float32 or torch.bfloat16.")
        precision = PrecisionConfig(params_dtype=names[dtype])
    elif params_dtype is not None and params_dtype != precision.torch_dtype:
        raise ValueError(
            f"params_dtype = {params_dtype} contradicts precision.params_dtype = {precision.params_dtype!r}: "
            f"pass only precision."
        )
    recompute = recompute or RecomputeConfig()
    check_precision_and_recompute(config, parallel, precision, recompute)
    return TransformerConfig(
        num_layers=config.num_layers,
        hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads,
        kv_channels=config.head_dim,
        num_query_groups=config.num_query_groups,
        ffn_hidden_size=config.moe_ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=config.norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        init_method_std=init_method_std,
        num_moe_experts=config.num_experts,
        moe_router_topk=config.moe_router_topk,
        moe_ffn_hidden_size=config.moe_ffn_hidden_size,
        moe_aux_loss_coeff=config.moe_aux_loss_coeff,
        moe_router_load_balancing_type="aux_loss",
        # M1: top-k of the logits, then softmax over the k: the same as softmax, top-k, renormalize.
        # M2: sigmoid scores, top-k of the scores plus the selection bias, the k scores renormalized.
        moe_router_pre_softmax=False,
        moe_router_score_function=config.router_score_function,
        moe_router_enable_expert_bias=config.family == M2,
        moe_router_bias_update_rate=config.moe_router_bias_update_rate,
        moe_router_dtype="fp32",
        moe_token_dispatcher_type="alltoall",
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        expert_model_parallel_size=parallel.expert_model_parallel_size,
        expert_tensor_parallel_size=parallel.expert_tp,
        sequence_parallel=parallel.sequence_parallel,
        cp_comm_type=parallel.context_parallel_comm,
        # Full weights made on the CPU, then split: TP-invariant initialization where it is cheap
        # (the CPU runs: tests compare layouts from one seed); each GPU makes its own shard.
        use_cpu_initialization=run_device().type == "cpu",
        **precision_kwargs(precision),
        **recompute_kwargs(recompute),
    )
