"""The run configuration: one typed tree of sections, loaded from YAML with dotted command-line
overrides (``--set rl.loss.params.eps_high=4.0``). Every error names the dotted field, the value and
the fix.

Each subsystem owns its section (its dataclass, defaults and checks) beside its code; this module
only assembles them, reads YAML and ``--set``, and has each section check its own fields. Checks that
span sections, or that need a subsystem (the loss registry, the reward module), run once at start-up
(megacispo.startup.check_config): loading a config imports no subsystem and no user module."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from megacispo.checkpoint.formats import CONFIG_FILE, hf_model_config, is_hf_directory
from megacispo.data.config import DataConfig
from megacispo.envs.config import EnvConfig
from megacispo.evaluation.config import EvalConfig
from megacispo.metrics.config import LoggingConfig
from megacispo.models.config import HybridModelConfig, LoraConfig, PrecisionConfig, RecomputeConfig, model_config
from megacispo.parallel.layout import ParallelConfig
from megacispo.rl.config import RLConfig
from megacispo.rollout.config import PlacementConfig, RolloutConfig
from megacispo.training.config import OptimizerConfig, SFTConfig, TrainConfig


@dataclass(kw_only=True)
class Config:
    """Everything a run needs."""

    model: HybridModelConfig = field(default_factory=lambda: model_config("tiny"))
    """The model; in YAML, `size: tiny|small|minimax-m1|tiny-m2|minimax-m2` plus fields to override."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """The parallel layout."""
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    """Weight dtype, Transformer Engine and FP8."""
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    """Activation recompute."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """Low-rank adapters: train them on a frozen base (rank 0: train every weight)."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompts and tokenizer."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Generation."""
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    """Rollouts on processes of their own."""
    rl: RLConfig = field(default_factory=RLConfig)
    """The RL recipe."""
    env: EnvConfig = field(default_factory=EnvConfig)
    """Multi-turn rollouts: the environment that answers the model."""
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

    @property
    def max_prompt_tokens(self) -> int:
        """The longest RL prompt, in tokens with BOS: data.max_prompt_tokens, or what the context leaves."""
        return self.data.max_prompt_tokens or self.model.max_position_embeddings - self.rollout.max_new_tokens


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
    """``text`` as YAML; a syntax error or a repeated key becomes one line naming ``where``, the line and
    the column."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _refuse_duplicate_keys(node, where, "", set())
        return loader.construct_document(node)
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark
        raise ValueError(
            f"{where}: invalid YAML at line {mark.line + 1}, column {mark.column + 1}: {error.problem}; fix the syntax "
            "(quote a value that holds YAML's special characters)"
        ) from None
    except yaml.YAMLError as error:  # e.g. a control character, which has no problem mark
        raise ValueError(f"{where}: invalid YAML: {str(error).splitlines()[0]}; fix the text") from None
    finally:
        loader.dispose()


_MERGE_TAG = "tag:yaml.org,2002:merge"


def _refuse_duplicate_keys(node: yaml.Node, where: str, path: str, seen: set[int]) -> None:
    """A key written twice in one mapping is an error: YAML keeps the last silently, so a second
    ``rollout:`` section would drop the first whole. Keys that a merge (``<<: *anchor``) brings in may be
    overridden: only the keys written in the mapping itself count."""
    if id(node) in seen:  # an alias: checked where its anchor is
        return
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        first_lines: dict[tuple[str, str], int] = {}
        for key_node, value_node in node.value:
            if key_node.tag == _MERGE_TAG:
                _refuse_duplicate_keys(value_node, where, path, seen)
                continue
            if isinstance(key_node, yaml.ScalarNode):
                key, mark = (key_node.tag, key_node.value), key_node.start_mark
                dotted = f"{path}.{key_node.value}" if path else key_node.value
                if key in first_lines:
                    raise ValueError(f"{where}: duplicate key {dotted!r} at line {mark.line + 1}, column "
                                     f"{mark.column + 1} (first at line {first_lines[key]}): YAML would keep only "
                                     f"the last; keep one")
                first_lines[key] = mark.line + 1
            else:
                dotted = path
            _refuse_duplicate_keys(value_node, where, dotted, seen)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _refuse_duplicate_keys(item, where, f"{path}[{index}]", seen)


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
    """Read a YAML file (or start from defaults), apply dotted overrides, build, and check each section
    on its own (megacispo.startup.check_config checks the whole).

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
    for section in (config.data, config.rollout, config.placement, config.rl, config.env, config.optimizer, config.train,
                    config.sft, config.eval, config.logging):
        section.check()
    return config


def _hf_load(tree: dict, load_field: str | None) -> str | None:
    """The Hugging Face directory that ``load_field`` names in the raw config tree, if it names one."""
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


def to_dict(config: Config) -> dict:
    """The resolved config as plain data (saved with every checkpoint and in the run directory)."""
    return dataclasses.asdict(config)
