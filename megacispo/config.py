"""The run configuration: one typed tree, loaded from YAML with dotted command-line overrides
(``--set rl.loss.params.eps_high=4.0``) and validated once at start-up. Every error names the dotted
field, the value and the fix."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
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
    """Where prompts and the tokenizer come from, and how long a prompt may be."""

    train_prompts: str = ""
    """.jsonl or .parquet file of RL prompts: a prompt, an answer; the other fields go to the reward."""
    test_prompts: str = ""
    """.jsonl or .parquet file of held-out prompts for evaluation (empty: no evaluation)."""
    sft_pairs: str = ""
    """.jsonl or .parquet file of prompt/answer pairs for the supervised warm start (megacispo.sft)."""
    prompt_key: str = "prompt"
    """The field holding the prompt (a string, or a list of {"role", "content"} messages); dots for nested fields."""
    answer_key: str = "answer"
    """The field holding the reference answer; dots for nested fields (e.g. reward_model.ground_truth)."""
    tokenizer: str = ""
    """A sentencepiece .model file (tools/train_tokenizer.py writes one) or a Hugging Face tokenizer directory."""
    chat_template: bool = False
    """Render prompts (and SFT answers, as the assistant turn) through the tokenizer's chat template."""
    max_prompt_tokens: int = 0
    """Longest RL prompt, in tokens with BOS (0: model.max_position_embeddings - rollout.max_new_tokens)."""
    overlong_prompts: str = "error"
    """A longer prompt, or an SFT pair over the context: error, skip, or truncate_left (keep BOS and the end)."""


# rollout.dtype's choices: the precisions a rollout can generate in.
ROLLOUT_DTYPES = ("float32", "bfloat16")


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
    max_running: int = 0
    """Sequences decoded together per rank; a finished one's slot takes the next waiting sample (0: all at once)."""
    max_cache_gib: float = 0.0
    """Cap on the rollout cache of max_running slots per GPU, GiB, checked at start-up (0: no cap)."""
    dtype: str = "float32"
    """Precision of generation, float32 or bfloat16 (training keeps precision.params_dtype; the LM head follows model.fp32_lm_head)."""
    max_staleness: int = 0
    """Steps a rollout's weights may lag the step it trains (needs placement.rollout_ranks; 0: on-policy, 1: one step behind)."""


@dataclass(kw_only=True)
class LossConfig:
    """The policy loss, chosen by name from the registry in megacispo.losses."""

    name: str = "cispo"
    """One of cispo, grpo, dapo, gspo, reinforce."""
    params: dict[str, Any] = field(default_factory=dict)
    """Parameters of the chosen loss (cispo: eps_low, eps_high, mask_eps_low, mask_eps_high)."""


@dataclass(kw_only=True)
class RolloutCorrectionConfig:
    """Importance-sampling correction for the gap between rollout and training probabilities (any loss)."""

    mode: str = "none"
    """none; tis (weight each token's loss by min(r, threshold_high)); mis_token or mis_sequence (drop
    tokens, or sequences by their geometric-mean r, with r outside [threshold_low, threshold_high]);
    r = pi_train / pi_rollout."""
    threshold_low: float = 0.5
    """The lower end of the kept range of r (mis_*)."""
    threshold_high: float = 2.0
    """The cap of the tis weight, and the upper end of the kept range of r (mis_*)."""


@dataclass(kw_only=True)
class AdaptiveClipConfig:
    """Clip bounds that follow a target capped fraction (megacispo.adaptive_clip); off unless target_capped_frac is set."""

    target_capped_frac: float | None = None
    """The fraction of an optimizer step's loss tokens, over all ranks, whose weight may hit the upper bound (null: off); above 1 / tokens per step."""
    rate: float = 0.05
    """After each optimizer step the bound is multiplied (more capped than the target) or divided (fewer) by 1 + rate."""
    min: float = 0.01
    """The smallest an adapted bound (eps_high, eps_low) gets."""
    max: float = 10.0
    """The largest an adapted bound gets."""
    adapt_low: bool = False
    """Also move eps_low so that loss/clip_frac_low tracks the target (losses with separate eps_low and eps_high)."""


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
    """The reward of a sample whose verifier raised or returned no number (a string, even '1.0', is none)."""
    max_reward_failure_frac: float = 0.5
    """Stop the run when the verifier fails on more than this fraction of a step's samples (1: never)."""
    overlong_max_length: int = 0
    """DAPO overlong shaping: responses longer than this get the full penalty (0: off)."""
    overlong_cache_length: int = 0
    """The penalty ramps up linearly over the last this-many tokens before overlong_max_length."""
    overlong_penalty: float = 1.0
    """The largest overlong penalty."""
    advantage_eps: float = 1e-6
    """Added to the group std when normalizing advantages."""
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    """Importance-sampling correction between rollout and training probabilities."""
    routing_replay: bool = False
    """R3: route every token to the experts the rollout chose, in the old-log-prob and update forwards."""
    adaptive_clip: AdaptiveClipConfig = field(default_factory=AdaptiveClipConfig)
    """Adapt the loss's clip bounds to a target capped fraction."""


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
    """Start from this checkpoint: a megacispo checkpoint or a Hugging Face directory (converted on the fly)."""
    export_hf: str = ""
    """Write the final weights here as a Hugging Face checkpoint, with the tokenizer files (empty: no export)."""
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
    """Start from this checkpoint or Hugging Face directory; empty: random initialization."""
    out: str = ""
    """Where the warm-started checkpoint goes (default: <run_dir>/sft)."""


@dataclass(kw_only=True)
class EvalConfig:
    """Held-out evaluation: greedy accuracy, and pass@k / mean@k over sampled responses."""

    greedy: bool = True
    """Report the greedy accuracy (eval/accuracy)."""
    num_samples: int = 0
    """k: responses sampled per test prompt for pass@k and mean@k (0: greedy only)."""
    temperature: float = 1.0
    """Sampling temperature of the k responses."""
    top_p: float = 1.0
    """Nucleus sampling of the k responses."""


@dataclass(kw_only=True)
class LoggingConfig:
    """Where metrics go besides TensorBoard and the console."""

    wandb: bool = False
    """Also log to Weights & Biases (pip install -e .[wandb]; WANDB_MODE=offline works without a network)."""
    wandb_project: str = "megacispo"
    """The W&B project."""
    wandb_run_name: str = ""
    """The W&B run name (empty: the name of train.run_dir)."""
    probe_token: str = ""
    """Text of one token (the fork task's marker "~"): log its probability at the response's start and its clip fractions under probe/ (empty: off)."""


@dataclass(kw_only=True)
class PlacementConfig:
    """Which processes generate and which train."""

    rollout_ranks: int = 0
    """K: the last K processes only generate (whole-model replicas: TP = PP = EP = 1), the others only train (0: all do both)."""


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
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    """Rollouts on processes of their own."""
    rl: RLConfig = field(default_factory=RLConfig)
    """The RL recipe."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """The optimizer."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """The run."""
    sft: SFTConfig = field(default_factory=SFTConfig)
    """The supervised warm start."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Held-out evaluation."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Metric loggers."""


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
    if annotation is float:
        return _coerce_float(value, path)
    if annotation is Any or (isinstance(annotation, type) and isinstance(value, annotation)
                             and not (annotation is int and isinstance(value, bool))):
        return value
    name = getattr(annotation, "__name__", str(annotation))
    raise ValueError(f"{path}: expected {name}, got {value!r} ({type(value).__name__})")


def _coerce_float(value: Any, path: str) -> float:
    """An int, a float or a numeric string as a finite float: NaN or infinity would reach the optimizer
    or the sampler unnoticed."""
    number = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str):
        # YAML 1.1 reads 1e-3 (no dot) as a string.
        with contextlib.suppress(ValueError):
            number = float(value)
    if number is None:
        raise ValueError(f"{path}: expected float, got {value!r} ({type(value).__name__})")
    if not math.isfinite(number):
        raise ValueError(f"{path}: expected a finite number, got {value!r}")
    return number


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
    return key.strip(), _parse_yaml(raw, f"--set {text!r}")


def _parse_yaml(text: str, where: str) -> Any:
    """``text`` as YAML; a syntax error becomes one line naming ``where``, the line and the column."""
    try:
        return yaml.safe_load(text)
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark
        raise ValueError(
            f"{where}: invalid YAML at line {mark.line + 1}, column {mark.column + 1}: {error.problem}; fix the syntax "
            "(quote a value that holds YAML's special characters)"
        ) from None
    except yaml.YAMLError as error:  # e.g. a control character, which has no problem mark
        raise ValueError(f"{where}: invalid YAML: {str(error).splitlines()[0]}; fix the text") from None


def _read_config_file(path: str) -> dict:
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"--config {path}: no such file")
    try:
        text = file.read_bytes().decode("utf-8")
    except OSError as error:
        raise ValueError(f"--config {path}: cannot read it ({error.strerror}); fix its permissions") from None
    except UnicodeDecodeError as error:
        raise ValueError(
            f"--config {path}: not UTF-8 ({error.reason} at byte {error.start}); save it as UTF-8"
        ) from None
    tree = _parse_yaml(text, f"--config {path}") or {}
    if not isinstance(tree, dict):
        raise ValueError(f"--config {path}: the top level must be a mapping of sections")
    return tree


def load_config(path: str | None, overrides: list[str] = (), load_field: str | None = None) -> Config:
    """Read a YAML file (or start from defaults), apply dotted overrides, build and validate.

    ``load_field``: the entry point's starting checkpoint (train.load or sft.load). When it names a
    Hugging Face directory, the model section is the model of its config.json: the config may
    repeat a field of it but not contradict it."""
    tree = _read_config_file(path) if path else {}
    for text in overrides:
        _set_dotted(tree, *parse_override(text))
    hf_dir = _hf_load(tree, load_field)
    if hf_dir is not None:
        tree["model"] = _model_values_from_hf(tree.get("model", {}), hf_dir, load_field)
    config = _build(Config, tree, "config")
    validate_config(config)
    return config


def _hf_load(tree: dict, load_field: str | None) -> str | None:
    """The Hugging Face directory that ``load_field`` names in the raw config tree, if it names one."""
    from megacispo.hf_checkpoint import is_hf_directory

    if load_field is None:
        return None
    section_name, name = load_field.split(".")
    section = tree.get(section_name)
    value = section.get(name) if isinstance(section, dict) else None
    return value if isinstance(value, str) and value and is_hf_directory(value) else None


# What config.json does not describe: how the model computes, which the run config may choose.
_NOT_IN_HF_CONFIG = ("fp32_lm_head", "freeze_router")


def _model_values_from_hf(explicit: Any, hf_dir: str, load_field: str) -> dict:
    """The model section's values for a run that starts from the HF directory ``hf_dir``: its
    config.json's model, with the explicit fields of the config checked against it (ValueError
    naming the field and both values when one disagrees)."""
    from megacispo.hf_checkpoint import CONFIG_FILE, hf_model_config

    if not isinstance(explicit, dict):
        raise ValueError(f"config.model: expected a mapping of HybridModelConfig fields, got {explicit!r}")
    config_path = Path(hf_dir) / CONFIG_FILE
    if "size" in explicit:
        raise ValueError(f"model.size = {explicit['size']!r}: the model comes from {config_path} ({load_field}); "
                         f"remove model.size")
    try:
        from_hf = dataclasses.asdict(hf_model_config(hf_dir))
    except ValueError as error:
        raise ValueError(f"{load_field}: {error}") from None
    given = _typed_fields(HybridModelConfig, explicit, "model")
    for name, value in given.items():
        if name not in _NOT_IN_HF_CONFIG and value != from_hf[name]:
            raise ValueError(f"model.{name} = {value!r} in the config but {from_hf[name]!r} in {config_path} "
                             f"({load_field}): remove it or make them agree")
    return {**from_hf, **given}


@dataclass(frozen=True)
class _Range:
    """Where a number must lie, written as its error message says it."""

    low: float
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False
    note: str = ""

    def __contains__(self, value: float) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def __str__(self) -> str:
        if self.high == math.inf:
            text = f"{'>' if self.low_open else '>='} {self.low:g}"
        else:
            text = f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"
        return f"{text} ({self.note})" if self.note else text


_AT_LEAST_0, _AT_LEAST_1, _POSITIVE, _FRACTION = _Range(0), _Range(1), _Range(0, low_open=True), _Range(0, 1)

# Every number of the run whose range does not follow from its type, by dotted field.
_RANGES: dict[str, _Range] = {
    "data.max_prompt_tokens": _Range(0, note="0: what the model's context leaves after rollout.max_new_tokens"),
    "rollout.prompts_per_step": _AT_LEAST_1,
    "rollout.group_size": _Range(2, note="group-relative advantages need at least 2 samples per prompt"),
    "rollout.max_new_tokens": _AT_LEAST_1,
    "rollout.temperature": _Range(0, note="0: greedy"),
    "rollout.top_p": _Range(0, 1, low_open=True),
    "rollout.top_k": _Range(0, note="0: off"),
    "rollout.early_truncation_tokens": _Range(0, note="0: off"),
    "rollout.early_truncation_prob": _FRACTION,
    "rollout.max_sampling_rounds": _AT_LEAST_1,
    "rollout.max_running": _Range(0, note="0: all of a rank's samples at once"),
    "rollout.max_cache_gib": _Range(0, note="0: no cap"),
    "rollout.max_staleness": _Range(0, note="0: synchronous"),
    "placement.rollout_ranks": _Range(0, note="0: every process generates and trains"),
    "rl.updates_per_rollout": _AT_LEAST_1,
    "rl.max_reward_failure_frac": _Range(0, 1, note="1: never stop"),
    "rl.overlong_max_length": _Range(0, note="0: off"),
    "rl.overlong_cache_length": _AT_LEAST_0,
    "rl.overlong_penalty": _AT_LEAST_0,
    "rl.advantage_eps": _AT_LEAST_0,
    "rl.rollout_correction.threshold_low": _FRACTION,
    "rl.rollout_correction.threshold_high": _Range(1),
    "rl.adaptive_clip.rate": _Range(0, 1, low_open=True),
    "rl.adaptive_clip.min": _POSITIVE,
    "rl.adaptive_clip.max": _POSITIVE,
    "optimizer.lr": _POSITIVE,
    "optimizer.min_lr": _AT_LEAST_0,
    "optimizer.warmup_steps": _AT_LEAST_0,
    "optimizer.decay_steps": _Range(0, note="0: decay over the whole run"),
    "optimizer.weight_decay": _AT_LEAST_0,
    "optimizer.adam_beta1": _Range(0, 1, high_open=True),
    "optimizer.adam_beta2": _Range(0, 1, high_open=True),
    "optimizer.adam_eps": _POSITIVE,
    "optimizer.clip_grad": _Range(0, note="0: off"),
    "train.steps": _AT_LEAST_1,
    "train.seed": _AT_LEAST_0,
    "train.micro_batch_size": _AT_LEAST_1,
    "train.checkpoint_every": _Range(0, note="0: only at the end"),
    "train.keep_last": _AT_LEAST_1,
    "train.eval_every": _Range(0, note="0: at the start and the end only"),
    "train.max_nonfinite_skips": _AT_LEAST_0,
    "sft.steps": _AT_LEAST_1,
    "sft.batch_size": _AT_LEAST_1,
    "sft.lr": _POSITIVE,
    "sft.decay_steps": _Range(0, note="0: decay over sft.steps"),
    "eval.num_samples": _Range(0, note="0: greedy only"),
    "eval.temperature": _POSITIVE,
    "eval.top_p": _Range(0, 1, low_open=True),
}


def _value(config: Config, dotted: str) -> Any:
    return functools.reduce(getattr, dotted.split("."), config)


def validate_config(config: Config) -> None:
    """Every value and every cross-field rule that needs neither the world size nor the model built;
    each error names the field, the value and the fix."""
    from megacispo.metrics import check_logging

    for name, allowed in _RANGES.items():
        value = _value(config, name)
        if value not in allowed:
            raise ValueError(f"{name} = {value!r}: it must be {allowed}")
    _check_choices(config)
    _check_cross_fields(config)
    _check_adaptive_clip(config)
    _check_placement(config)
    _check_lengths(config)
    _check_compile_decode(config)
    _check_rollout_memory(config)
    check_precision_and_recompute(config.model, config.parallel, config.precision, config.recompute)
    check_logging(config.logging)


def _check_choices(config: Config) -> None:
    """Names: the run directory, the enumerations, the loss and its parameters, the reward (imported now)."""
    from megacispo.data import OVERLONG_PROMPTS
    from megacispo.losses import policy_loss_names, validate_policy_loss_params
    from megacispo.rewards import get_reward_fn
    from megacispo.rollout_correction import CORRECTION_MODES

    rl = config.rl
    if not config.train.run_dir:
        raise ValueError("train.run_dir is empty: name the directory for the run's checkpoints and logs")
    if rl.old_logprobs not in ("recompute", "rollout"):
        raise ValueError(f"rl.old_logprobs = {rl.old_logprobs!r}: use recompute or rollout")
    if config.rollout.dtype not in ROLLOUT_DTYPES:
        raise ValueError(f"rollout.dtype = {config.rollout.dtype!r}: use one of {', '.join(ROLLOUT_DTYPES)}")
    if rl.rollout_correction.mode not in CORRECTION_MODES:
        raise ValueError(f"rl.rollout_correction.mode = {rl.rollout_correction.mode!r}: use one of "
                         f"{', '.join(CORRECTION_MODES)}")
    if config.data.overlong_prompts not in OVERLONG_PROMPTS:
        raise ValueError(f"data.overlong_prompts = {config.data.overlong_prompts!r}: use {', '.join(OVERLONG_PROMPTS)}")
    if rl.loss.name not in policy_loss_names():
        raise ValueError(f"rl.loss.name = {rl.loss.name!r}: use one of {', '.join(policy_loss_names())}")
    try:
        rl.loss.params = validate_policy_loss_params(rl.loss.name, rl.loss.params)
    except ValueError as error:
        raise ValueError(f"rl.loss: {error}") from None
    try:
        get_reward_fn(rl.reward)
    except ValueError as error:
        raise ValueError(f"rl.reward: {error}") from None


def _check_cross_fields(config: Config) -> None:
    rl, optimizer = config.rl, config.optimizer
    if optimizer.min_lr > optimizer.lr:
        raise ValueError(
            f"optimizer.min_lr = {optimizer.min_lr} exceeds optimizer.lr = {optimizer.lr}: the schedule decays "
            "from lr down to min_lr; lower min_lr"
        )
    if rl.overlong_max_length and rl.overlong_cache_length > rl.overlong_max_length:
        raise ValueError(
            f"rl.overlong_cache_length = {rl.overlong_cache_length} exceeds rl.overlong_max_length = "
            f"{rl.overlong_max_length}: the ramp must fit below the limit"
        )


def _check_adaptive_clip(config: Config) -> None:
    """rl.adaptive_clip, when on: a target in (0, 1), a non-empty range holding the loss's starting
    bounds, and a loss with the bounds it moves (after _check_choices completed rl.loss.params)."""
    from megacispo.adaptive_clip import bound_params

    settings, loss = config.rl.adaptive_clip, config.rl.loss
    target = settings.target_capped_frac
    if target is None:
        return
    if not 0 < target < 1:
        raise ValueError(f"rl.adaptive_clip.target_capped_frac = {target!r}: it must be in (0, 1), e.g. 0.01, or "
                         f"null to keep the bounds fixed")
    if settings.min > settings.max:
        raise ValueError(f"rl.adaptive_clip.min = {settings.min} exceeds rl.adaptive_clip.max = {settings.max}: the "
                         f"bounds move between them; lower min or raise max")
    names = bound_params(loss.name)
    if names is None:
        raise ValueError(f"rl.adaptive_clip.target_capped_frac = {target} but rl.loss.name = {loss.name!r} has no "
                         f"clip bound to adapt: use cispo, dapo, grpo or gspo, or unset "
                         f"rl.adaptive_clip.target_capped_frac")
    if settings.adapt_low and names.low is None:
        raise ValueError(f"rl.adaptive_clip.adapt_low = true but rl.loss.name = {loss.name!r} has one symmetric bound "
                         f"({names.high}), adapted from the upper side: set rl.adaptive_clip.adapt_low = false")
    moved = [names.high] + ([names.low] if settings.adapt_low else [])
    for name in moved:
        value = loss.params[name]
        if not settings.min <= value <= settings.max:
            raise ValueError(f"rl.loss.params.{name} = {value} lies outside [rl.adaptive_clip.min, rl.adaptive_clip.max]"
                             f" = [{settings.min}, {settings.max}]: the adapted bound starts from it; move it inside "
                             f"or widen the range")


def _check_placement(config: Config) -> None:
    """What rollouts on their own processes need (the world size is checked by ``training_world_size``)."""
    ranks, staleness = config.placement.rollout_ranks, config.rollout.max_staleness
    if staleness and not ranks:
        raise ValueError(
            f"rollout.max_staleness = {staleness} needs placement.rollout_ranks > 0: processes that generate and "
            "train in turn always sample from the weights they train; set placement.rollout_ranks (e.g. 1) or "
            "rollout.max_staleness = 0"
        )
    if ranks and config.rollout.prompts_per_step % ranks:
        raise ValueError(
            f"rollout.prompts_per_step = {config.rollout.prompts_per_step} is not divisible by "
            f"placement.rollout_ranks = {ranks}: each rollout process generates an equal share; use a multiple of "
            f"{ranks}"
        )
    if ranks and config.rl.routing_replay and config.parallel.pipeline_model_parallel_size > 1:
        raise ValueError(
            f"rl.routing_replay = true with placement.rollout_ranks = {ranks} needs "
            f"parallel.pipeline_model_parallel_size = 1 (it is {config.parallel.pipeline_model_parallel_size}): the "
            "rollout processes record every layer's routes, a pipeline stage replays only its own; set "
            "rl.routing_replay = false or placement.rollout_ranks = 0"
        )


def training_world_size(config: Config, world_size: int) -> int:
    """The processes that train: the world less placement.rollout_ranks, which must leave at least one."""
    ranks = config.placement.rollout_ranks
    if ranks >= world_size:
        raise ValueError(
            f"placement.rollout_ranks = {ranks} leaves no training process in a world of {world_size}: launch more "
            f"than {ranks} processes (torchrun --nproc-per-node) or lower placement.rollout_ranks"
        )
    return world_size - ranks


def _check_lengths(config: Config) -> None:
    """A prompt and its response must fit in the model's context: nothing else bounds a rollout's memory."""
    context, new_tokens = config.model.max_position_embeddings, config.rollout.max_new_tokens
    if new_tokens >= context:
        raise ValueError(
            f"rollout.max_new_tokens = {new_tokens} leaves no room for a prompt in the model's context of "
            f"model.max_position_embeddings = {context} tokens: lower it below {context}"
        )
    prompt_tokens = config.data.max_prompt_tokens
    if prompt_tokens + new_tokens > context:
        raise ValueError(
            f"data.max_prompt_tokens = {prompt_tokens} + rollout.max_new_tokens = {new_tokens} exceeds the model's "
            f"context of model.max_position_embeddings = {context} tokens: lower one of them "
            f"(data.max_prompt_tokens = 0 takes what the context leaves, {context - new_tokens})"
        )


def max_prompt_tokens(config: Config) -> int:
    """The longest RL prompt, in tokens with BOS: data.max_prompt_tokens, or what the context leaves."""
    return config.data.max_prompt_tokens or config.model.max_position_embeddings - config.rollout.max_new_tokens


def check_rl_batches(config: Config, data_parallel_size: int) -> None:
    """The rollout batch splits evenly over the data-parallel ranks, then into the K updates and their
    micro-batches: an uneven split leaves a rank without samples, found only after a rollout."""
    rollout, updates = config.rollout, config.rl.updates_per_rollout
    _check_split("rollout.prompts_per_step", rollout.prompts_per_step, data_parallel_size)
    per_rank = rollout.prompts_per_step // data_parallel_size * rollout.group_size
    if per_rank % updates:
        raise ValueError(
            f"rl.updates_per_rollout = {updates} does not divide the {per_rank} samples of each data-parallel rank "
            f"(rollout.prompts_per_step / {data_parallel_size} ranks x rollout.group_size): "
            f"choose a divisor of {per_rank}"
        )
    _check_micro_batches(config, per_rank // updates, "samples of each update")


def check_sft_batches(config: Config, data_parallel_size: int) -> None:
    """sft.batch_size splits evenly over the data-parallel ranks and into micro-batches."""
    _check_split("sft.batch_size", config.sft.batch_size, data_parallel_size)
    _check_micro_batches(config, config.sft.batch_size // data_parallel_size, "pairs of each SFT step")


def _check_split(name: str, value: int, data_parallel_size: int) -> None:
    if value % data_parallel_size:
        raise ValueError(
            f"{name} = {value} is not divisible by the data-parallel size {data_parallel_size} "
            f"(world size / (TP x PP)): use a multiple of {data_parallel_size}"
        )


def _check_micro_batches(config: Config, per_rank: int, what: str) -> None:
    size = config.train.micro_batch_size
    if size < per_rank and per_rank % size:
        raise ValueError(
            f"train.micro_batch_size = {size} does not divide the {per_rank} {what} on a data-parallel rank: "
            f"choose a divisor of {per_rank}, or {per_rank} or more for one micro-batch"
        )


def _check_rollout_memory(config: Config) -> None:
    from megacispo.rollout import check_rollout_memory

    check_rollout_memory(config)


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
