"""The run configuration: one typed tree, loaded from YAML with dotted command-line overrides
(``--set rl.loss.eps_high=4.0``) and validated once at start-up. Every error names the dotted
field, the value and the fix."""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from megacispo.models.config import (
    HybridModelConfig,
    PrecisionConfig,
    RecomputeConfig,
    check_precision_and_recompute,
    model_config,
)
from megacispo.parallel.layout import ParallelConfig


@dataclass(kw_only=True)
class DataConfig:
    """Where prompts and the tokenizer come from."""

    train_prompts: str = ""
    """JSONL file of RL prompts: {"prompt": ..., "answer": ..., extra fields go to the reward}."""
    test_prompts: str = ""
    """JSONL file of held-out prompts for evaluation (empty: no evaluation)."""
    sft_pairs: str = ""
    """JSONL file of {"prompt", "answer"} pairs for the supervised warm start (megacispo.sft)."""
    tokenizer: str = ""
    """Path to a sentencepiece .model file (tools/train_tokenizer.py writes one)."""


@dataclass(kw_only=True)
class RolloutConfig:
    """Generation of G samples per prompt by the policy being trained."""

    prompts_per_step: int = 8
    """Prompt groups in one rollout batch (after dynamic sampling)."""
    group_size: int = 8
    """G: samples per prompt; advantages are relative within a group."""
    max_new_tokens: int = 16
    """Generation stops after this many tokens."""
    temperature: float = 1.0
    """Sampling temperature; 0 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest token set with this much probability."""
    top_k: int = 0
    """Keep only the k most likely tokens (0: off)."""
    early_truncation_tokens: int = 0
    """Stop a sample after this many consecutive tokens each above early_truncation_prob (0: off; M1 used 3000)."""
    early_truncation_prob: float = 0.99
    """The probability threshold of early truncation."""
    dynamic_sampling: bool = True
    """Drop groups whose rewards are all equal and sample more until the batch is full."""
    max_sampling_rounds: int = 4
    """Cap on rollout rounds spent filling one batch under dynamic sampling."""
    compile_decode: bool = False
    """Run each decode step through torch.compile (TP = PP = EP = 1, no Transformer Engine); the first steps compile."""


@dataclass(kw_only=True)
class LossConfig:
    """The policy loss, chosen by name from the registry in megacispo.losses."""

    name: str = "cispo"
    """One of cispo, grpo, dapo, reinforce."""
    params: dict[str, Any] = field(default_factory=dict)
    """Parameters of the chosen loss (cispo: eps_low, eps_high, mask_eps_low, mask_eps_high)."""


@dataclass(kw_only=True)
class RLConfig:
    """The CISPO recipe around the loss."""

    loss: LossConfig = field(default_factory=LossConfig)
    """The policy loss and its parameters."""
    updates_per_rollout: int = 4
    """K: optimizer steps on mini-batches of one rollout batch (M1 used 16)."""
    old_logprobs: str = "recompute"
    """recompute (the training engine recomputes them before the first update) or rollout."""
    reward: str = "exact_match"
    """A verifier name (exact_match, numeric, boxed_math) or module:function."""
    failure_reward: float = 0.0
    """The reward of a sample whose verifier raised."""
    overlong_max_length: int = 0
    """DAPO overlong shaping: responses longer than this get the full penalty (0: off)."""
    overlong_cache_length: int = 0
    """The penalty ramps up linearly over the last this-many tokens before overlong_max_length."""
    overlong_penalty: float = 1.0
    """The largest overlong penalty."""
    advantage_eps: float = 1e-6
    """Added to the group std when normalizing advantages."""


@dataclass(kw_only=True)
class OptimizerConfig:
    """AdamW as MiniMax-M1 set it, with warm-up and cosine decay."""

    lr: float = 1e-4
    """Peak learning rate."""
    min_lr: float = 0.0
    """Learning rate at the end of the cosine decay."""
    warmup_steps: int = 0
    """Linear warm-up from 0 over this many optimizer steps."""
    decay_steps: int = 0
    """Cosine decay to min_lr over this many optimizer steps (0: the whole run), like Megatron's
    lr_decay_iters; set it to keep the schedule fixed when a run is extended or resumed longer."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.95
    """AdamW beta2."""
    adam_eps: float = 1e-15
    """AdamW epsilon; M1's gradients span 1e-18..1e-5, 1e-8 would swamp the small ones."""
    clip_grad: float = 1.0
    """Clip the global gradient norm to this (0: off)."""
    use_distributed_optimizer: bool = True
    """Shard optimizer states across data-parallel ranks (Megatron's distributed optimizer)."""


@dataclass(kw_only=True)
class TrainConfig:
    """The run: length, batching, checkpoints, logs."""

    run_dir: str = "runs/quickstart"
    """Where TensorBoard events, checkpoints and the resolved config go."""
    steps: int = 10
    """RL steps (one rollout batch and its K updates each)."""
    seed: int = 1234
    """Seeds model initialization, sampling and data order."""
    micro_batch_size: int = 8
    """Sequences per micro-batch in the training forward/backward."""
    checkpoint_every: int = 0
    """Save a checkpoint every this many steps (0: only at the end)."""
    keep_last: int = 2
    """Keep this many newest checkpoints."""
    load: str = ""
    """Start from this checkpoint (a megacispo or converted Megatron checkpoint directory)."""
    eval_every: int = 0
    """Evaluate held-out accuracy every this many steps (0: at the start and the end only)."""
    max_nonfinite_skips: int = 3
    """Stop after this many updates skipped for a non-finite loss or gradient."""


@dataclass(kw_only=True)
class SFTConfig:
    """The supervised warm start (megacispo.sft)."""

    steps: int = 200
    """Optimizer steps."""
    batch_size: int = 32
    """Prompt/answer pairs per optimizer step."""
    lr: float = 1e-3
    """Peak learning rate (warm-up then cosine decay, AdamW settings from optimizer)."""
    decay_steps: int = 0
    """Cosine decay over this many steps (0: sft.steps); more than sft.steps stops SFT part-way down the schedule."""
    load: str = ""
    """Start from this checkpoint (e.g. a converted Hugging Face model); empty: random initialization."""
    out: str = ""
    """Where the warm-started checkpoint goes (default: <run_dir>/sft)."""


@dataclass(kw_only=True)
class Config:
    """Everything a run needs."""

    model: HybridModelConfig = field(default_factory=lambda: model_config("tiny"))
    """The model; in YAML, `size: tiny|small|minimax-m1` plus fields to override."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """The parallel layout."""
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    """Weight dtype, Transformer Engine and FP8."""
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    """Activation recompute."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompts and tokenizer."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Generation."""
    rl: RLConfig = field(default_factory=RLConfig)
    """The RL recipe."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """The optimizer."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """The run."""
    sft: SFTConfig = field(default_factory=SFTConfig)
    """The supervised warm start."""


def _coerce(value: Any, annotation: Any, path: str) -> Any:
    """Check (and where lossless, convert) a YAML value against a field's annotation."""
    origin = typing.get_origin(annotation)
    if dataclasses.is_dataclass(annotation):
        if not isinstance(value, dict):
            raise ValueError(f"{path}: expected a mapping of {annotation.__name__} fields, got {value!r}")
        return _build(annotation, value, path)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in (o for o in options if o is not type(None)):
            try:
                return _coerce(value, option, path)
            except ValueError as error:
                errors.append(str(error))
        raise ValueError(errors[0])
    if origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{path}: expected a mapping, got {value!r}")
        return dict(value)
    if origin is list:
        if not isinstance(value, list):
            raise ValueError(f"{path}: expected a list, got {value!r}")
        return list(value)
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if annotation is float and isinstance(value, str):
        # YAML 1.1 reads 1e-3 (no dot) as a string.
        try:
            return float(value)
        except ValueError:
            pass
    if annotation is Any or (isinstance(annotation, type) and isinstance(value, annotation)
                             and not (annotation is int and isinstance(value, bool))):
        return value
    name = getattr(annotation, "__name__", str(annotation))
    raise ValueError(f"{path}: expected {name}, got {value!r} ({type(value).__name__})")


def _build(cls, values: dict, path: str):
    """Instantiate dataclass ``cls`` from a mapping, refusing unknown keys."""
    if cls is HybridModelConfig:
        return _build_model(values, path)
    return cls(**_typed_fields(cls, values, path))


def _typed_fields(cls, values: dict, path: str, also_valid: tuple[str, ...] = ()) -> dict:
    types_by_name = typing.get_type_hints(cls)
    unknown = sorted(set(values) - set(types_by_name))
    if unknown:
        valid = ", ".join([*also_valid, *sorted(types_by_name)])
        raise ValueError(f"{path}.{unknown[0]}: unknown field; valid fields of {path}: {valid}")
    return {name: _coerce(value, types_by_name[name], f"{path}.{name}") for name, value in values.items()}


def _build_model(values: dict, path: str) -> HybridModelConfig:
    """A named size (``size``, default tiny) with some of its fields overridden."""
    values = dict(values)
    size = values.pop("size", "tiny")
    overrides = _typed_fields(HybridModelConfig, values, path, also_valid=("size",))
    try:
        return model_config(size, **overrides)
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from None


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for key in keys[:-1]:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ValueError(f"--set {dotted}: {key} is not a section")
    node[keys[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """``key.sub=value`` with the value parsed as YAML (numbers, booleans, lists)."""
    if "=" not in text:
        raise ValueError(f"--set {text!r}: expected key=value, e.g. --set rl.loss.name=dapo")
    key, raw = text.split("=", 1)
    return key.strip(), yaml.safe_load(raw)


def load_config(path: str | None, overrides: list[str] = ()) -> Config:
    """Read a YAML file (or start from defaults), apply dotted overrides, build and validate."""
    tree: dict = {}
    if path:
        file = Path(path)
        if not file.is_file():
            raise ValueError(f"--config {path}: no such file")
        tree = yaml.safe_load(file.read_text()) or {}
        if not isinstance(tree, dict):
            raise ValueError(f"--config {path}: the top level must be a mapping of sections")
    for text in overrides:
        _set_dotted(tree, *parse_override(text))
    config = _build(Config, tree, "config")
    validate_config(config)
    return config


def validate_config(config: Config) -> None:
    """Cross-field checks that no single section can make; names the field and the fix."""
    from megacispo.losses import validate_policy_loss_params

    rollout, rl, train = config.rollout, config.rl, config.train
    positive = {
        "rollout.prompts_per_step": rollout.prompts_per_step,
        "rollout.max_new_tokens": rollout.max_new_tokens,
        "rollout.max_sampling_rounds": rollout.max_sampling_rounds,
        "rl.updates_per_rollout": rl.updates_per_rollout,
        "train.steps": train.steps,
        "train.micro_batch_size": train.micro_batch_size,
        "train.keep_last": train.keep_last,
        "sft.batch_size": config.sft.batch_size,
    }
    for name, value in positive.items():
        if value < 1:
            raise ValueError(f"{name} = {value}: it must be at least 1")
    for name, value in {"optimizer.decay_steps": config.optimizer.decay_steps, "sft.decay_steps": config.sft.decay_steps}.items():
        if value < 0:
            raise ValueError(f"{name} = {value}: it must be >= 0 (0: decay over the whole run)")
    if rollout.group_size < 2:
        raise ValueError(f"rollout.group_size = {rollout.group_size}: group-relative advantages need at least 2")
    if rollout.temperature < 0:
        raise ValueError(f"rollout.temperature = {rollout.temperature}: use 0 for greedy or a positive value")
    if not 0 < rollout.top_p <= 1:
        raise ValueError(f"rollout.top_p = {rollout.top_p}: it must be in (0, 1]")
    if rl.old_logprobs not in ("recompute", "rollout"):
        raise ValueError(f"rl.old_logprobs = {rl.old_logprobs!r}: use recompute or rollout")
    batch = rollout.prompts_per_step * rollout.group_size
    if batch % rl.updates_per_rollout:
        raise ValueError(
            f"rl.updates_per_rollout = {rl.updates_per_rollout} does not divide the rollout batch of "
            f"rollout.prompts_per_step * rollout.group_size = {batch} samples: choose a divisor"
        )
    try:
        rl.loss.params = validate_policy_loss_params(rl.loss.name, rl.loss.params)
    except ValueError as error:
        raise ValueError(f"rl.loss: {error}") from None
    if rl.overlong_max_length and rl.overlong_cache_length > rl.overlong_max_length:
        raise ValueError(
            f"rl.overlong_cache_length = {rl.overlong_cache_length} exceeds rl.overlong_max_length = "
            f"{rl.overlong_max_length}: the ramp must fit below the limit"
        )
    _check_compile_decode(config)
    check_precision_and_recompute(config.model, config.parallel, config.precision, config.recompute)


def _check_compile_decode(config: Config) -> None:
    """rollout.compile_decode traces the lean decode step, which needs every weight in this process."""
    if not config.rollout.compile_decode:
        return
    parallel = config.parallel
    blockers = [
        ("parallel.tensor_model_parallel_size", parallel.tensor_model_parallel_size, 1),
        ("parallel.pipeline_model_parallel_size", parallel.pipeline_model_parallel_size, 1),
        ("parallel.expert_model_parallel_size", parallel.expert_model_parallel_size, 1),
        ("precision.transformer_engine", config.precision.transformer_engine, False),
    ]
    for name, value, needed in blockers:
        if value != needed:
            raise ValueError(
                f"rollout.compile_decode = true needs {name} = {needed}, got {value}: the compiled decode "
                f"step runs every layer's weights in one process; set rollout.compile_decode=false"
            )


def to_dict(config: Config) -> dict:
    """The resolved config as plain data (saved with every checkpoint and in the run directory)."""
    return dataclasses.asdict(config)
