"""What the entry points share: the command line, start-up validation and the dry-run plan."""

from __future__ import annotations

import argparse
import contextlib
import logging
import warnings

from megacispo.config import Config, load_config
from megacispo.models.config import model_shape, parameter_counts
from megacispo.models.te_specs import INSTALL_HINT, require_transformer_engine, transformer_engine_installed
from megacispo.parallel.layout import validate_layout, world_size_from_env


def build_parser(description: str, load_field: str) -> argparse.ArgumentParser:
    """The shared command line; ``--load`` sets ``load_field`` (train.load for RL, sft.load for SFT)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", help="YAML run config (examples/configs/)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="dotted override, e.g. --set rl.loss.params.eps_high=4.0 (repeatable)")
    parser.add_argument("--load", help=f"start from this checkpoint (sets {load_field})")
    parser.add_argument("--dry-run", action="store_true",
                        help="validate the config and the parallel layout, print the plan, build nothing")
    parser.set_defaults(load_field=load_field)
    return parser


@contextlib.contextmanager
def bad_input_exits():
    """Bad config, layout or data ends the process with its message (exit code 1), no traceback."""
    try:
        yield
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None


def start_up(args: argparse.Namespace) -> tuple[Config, int]:
    """Parse and validate everything that can be checked before a process group exists.

    A run that asks for Transformer Engine (FP8) fails here when this machine lacks it, or lacks the
    version its FP8 recipe needs; a dry run only plans, so it names the missing piece in the plan
    instead (a login node without GPUs can check a GPU run's config)."""
    # Megatron-Core warns at import that Transformer Engine and apex are absent; on the CPU path that
    # is expected, and the warnings would bury the run's own output.
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|apex).*")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    overrides = list(args.set) + ([f"{args.load_field}={args.load}"] if args.load else [])
    config = load_config(args.config, overrides)
    world_size = world_size_from_env()
    validate_layout(config.parallel, world_size, model_shape(config.model))
    if config.precision.transformer_engine and not args.dry_run:
        require_transformer_engine(config.precision.fp8)
    return config, world_size


def precision_plan(config: Config) -> str:
    """One line on the weight dtype, FP8 and recompute, with what is missing here for Transformer Engine."""
    precision, recompute = config.precision, config.recompute
    if precision.fp8:
        gemms = f"FP8 GEMMs ({precision.fp8} scaling) through Transformer Engine"
    elif precision.transformer_engine:
        gemms = "Transformer Engine layers"
    else:
        gemms = "local Megatron layers"
    if precision.transformer_engine and not transformer_engine_installed():
        gemms += f" [Transformer Engine is not installed here: {INSTALL_HINT}]"
    if recompute.granularity == "full" and recompute.method == "block":
        recomputed = f"full (block: the first {recompute.num_layers} layers of each stage)"
    elif recompute.granularity == "full":
        recomputed = "full (uniform: every layer)"
    elif recompute.granularity == "selective":
        recomputed = f"selective ({', '.join(recompute.modules)})"
    else:
        recomputed = "none"
    return (f"precision: {precision.params_dtype} weights, {gemms}, LM head "
            f"{'fp32' if config.model.fp32_lm_head else precision.params_dtype}; recompute {recomputed}")


def plan(config: Config, world_size: int) -> str:
    """A readable summary of what a run would build."""
    total, activated = parameter_counts(config.model)
    parallel = config.parallel
    return "\n".join([
        f"model: {config.model.num_layers} layers, pattern {config.model.layer_pattern}, hidden {config.model.hidden_size}, "
        f"{config.model.num_experts} experts top-{config.model.moe_router_topk}: "
        f"{total / 1e9:.3f}B total, {activated / 1e9:.3f}B activated parameters",
        f"layout: world {world_size} = TP {parallel.tensor_model_parallel_size} x PP {parallel.pipeline_model_parallel_size} "
        f"x DP {parallel.data_parallel_size(world_size)}; EP {parallel.expert_model_parallel_size}, "
        f"sequence parallel {parallel.sequence_parallel}",
        precision_plan(config),
        f"loss: {config.rl.loss.name} {config.rl.loss.params}; {config.rl.updates_per_rollout} updates per rollout batch "
        f"of {config.rollout.prompts_per_step} prompts x {config.rollout.group_size} samples",
        f"run directory: {config.train.run_dir}",
    ])


def load_tokenizer(config: Config):
    """The run's tokenizer, checked against the model's vocabulary."""
    from megacispo.tokenizer import Tokenizer

    tokenizer = Tokenizer.load(config.data.tokenizer)
    if tokenizer.vocab_size > config.model.vocab_size:
        raise ValueError(
            f"data.tokenizer {config.data.tokenizer} has {tokenizer.vocab_size} pieces but model.vocab_size = "
            f"{config.model.vocab_size}: retrain the tokenizer smaller or set model.vocab_size >= {tokenizer.vocab_size}"
        )
    return tokenizer
