"""What the entry points share: the command line, start-up validation, loading the tokenizer and the
prompts, the dry-run plan, and the one way bad input ends a process."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import time
import warnings
from typing import Callable

from megacispo.config import Config, load_config, max_prompt_tokens, training_world_size
from megacispo.data import PromptLimit, PromptRecord, RecordFields, load_prompts
from megacispo.models.config import model_shape, parameter_counts
from megacispo.models.te_specs import INSTALL_HINT, require_transformer_engine, transformer_engine_installed
from megacispo.parallel.layout import validate_layout, world_size_from_env
from megacispo.tokenizer import Tokenizer



def build_parser(description: str, load_field: str) -> argparse.ArgumentParser:
    """The shared command line; ``--load`` sets ``load_field`` (train.load for RL, sft.load for SFT)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML run config (examples/configs/)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="dotted override, e.g. --set rl.loss.params.eps_high=4.0 (repeatable)")
    parser.add_argument("--load", help=f"start from this checkpoint (sets {load_field})")
    parser.add_argument("--dry-run", action="store_true",
                        help="validate the config and the parallel layout, print the plan, build nothing")
    parser.set_defaults(load_field=load_field)
    return parser


BAD_INPUT_EXIT_CODE = 2  # argparse's status for a bad command line: one status for every bad input
# How long the ranks that do not print a bad-input error wait before exiting (rank 0 exits at once).
QUIET_RANK_EXIT_DELAY_S = 10.0


class BadInput(SystemExit):
    """Exits with BAD_INPUT_EXIT_CODE; its text is the ``error:`` line, for callers that run an entry
    point in-process."""

    def __init__(self, message: str):
        super().__init__(BAD_INPUT_EXIT_CODE)
        self.message = message

    def __str__(self) -> str:
        return self.message


def is_rank_zero() -> bool:
    """Rank 0 of torchrun's world (or a plain process); known before any process group exists."""
    return os.environ.get("RANK", "0") == "0"


@contextlib.contextmanager
def bad_input_exits(kind: type[ValueError] = ValueError):
    """Bad input (a ``kind`` of ValueError naming the field, the value and the fix) ends the process
    with exit code 2 and one ``error:`` line, without a traceback. Every rank checks the same input and
    finds the same error: rank 0 prints it, the others exit quietly with the same code. Once the run
    has started, pass the narrower ``kind`` that every rank raises alike (a ValueError of one rank
    alone must keep its traceback)."""
    try:
        yield
    except kind as error:
        message = f"error: {error}"
        if is_rank_zero():
            print(message, file=sys.stderr, flush=True)
        else:
            # torchrun stops every worker once the first one exits: a rank that found the error before
            # rank 0 (a loaded machine) would otherwise take rank 0 down before it prints it.
            time.sleep(QUIET_RANK_EXIT_DELAY_S)
        raise BadInput(message) from None


def start_up(args: argparse.Namespace, check_batches: Callable[[Config, int], None]) -> tuple[Config, int]:
    """Parse and validate everything that can be checked before a process group exists;
    ``check_batches`` splits the entry point's batches over the data-parallel ranks.

    A run that asks for Transformer Engine (FP8) fails here when this machine lacks it, or lacks the
    version its FP8 recipe needs; a dry run only plans, so it names the missing piece in the plan
    instead (a login node without GPUs can check a GPU run's config)."""
    config = load_run_config(args)
    # The training processes: the layout and the batches split over them, not over the rollout processes.
    world_size = training_world_size(config, world_size_from_env())
    validate_layout(config.parallel, world_size, model_shape(config.model))
    check_batches(config, config.parallel.data_parallel_size(world_size))
    if config.precision.transformer_engine and not args.dry_run:
        require_transformer_engine(config.precision.fp8)
    return config, world_size


def load_run_config(args: argparse.Namespace) -> Config:
    """The config of --config, --set and --load, validated on its own (not yet against a world size)."""
    # Megatron-Core warns at import that Transformer Engine and apex are absent; on the CPU path that
    # is expected, and the warnings would bury the run's own output.
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|apex).*")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    overrides = list(args.set) + ([f"{args.load_field}={args.load}"] if args.load else [])
    return load_config(args.config, overrides, load_field=args.load_field)


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
        f"lengths: prompts up to {max_prompt_tokens(config)} tokens (longer: {config.data.overlong_prompts}) + "
        f"{config.rollout.max_new_tokens} new tokens, in a context of {config.model.max_position_embeddings}",
        f"loss: {config.rl.loss.name} {config.rl.loss.params}; {config.rl.updates_per_rollout} updates per rollout batch "
        f"of {config.rollout.prompts_per_step} prompts x {config.rollout.group_size} samples",
        f"run directory: {config.train.run_dir}",
    ])


def load_tokenizer(config: Config) -> Tokenizer:
    """The run's tokenizer, checked against the model's vocabulary and data.chat_template."""
    path = _data_path(config, "tokenizer")
    try:
        tokenizer = Tokenizer.load(path)
    except (FileNotFoundError, ValueError) as error:
        raise ValueError(f"data.tokenizer: {error}") from None
    if tokenizer.vocab_size > config.model.vocab_size:
        raise ValueError(
            f"data.tokenizer {config.data.tokenizer} has {tokenizer.vocab_size} pieces but model.vocab_size = "
            f"{config.model.vocab_size}: retrain the tokenizer smaller or set model.vocab_size >= {tokenizer.vocab_size}"
        )
    if config.logging.probe_token:
        try:
            tokenizer.single_token_id(config.logging.probe_token)
        except ValueError as error:
            raise ValueError(f"logging.probe_token: {error}; choose a text that is one token of data.tokenizer") from None
    if config.data.chat_template and not tokenizer.has_chat_template:
        raise ValueError(
            f"data.chat_template = true but data.tokenizer {config.data.tokenizer} has no chat template: set "
            "data.tokenizer to a Hugging Face tokenizer directory whose tokenizer_config.json (or "
            "chat_template.jinja) defines one, or set data.chat_template: false"
        )
    return tokenizer


def load_rl_prompts(config: Config, tokenizer) -> tuple[list[PromptRecord], list[PromptRecord], dict[str, float]]:
    """data.train_prompts and data.test_prompts (optional), each prompt tokenized once and held to the
    RL prompt limit; with the counts of prompts data.overlong_prompts skipped or truncated, as metrics."""
    names = ["train_prompts", "test_prompts"] if config.data.test_prompts else ["train_prompts"]
    loaded, metrics = {"test_prompts": []}, {}
    for name in names:
        loaded[name], counts = load_rl_prompt_file(config, tokenizer, name)
        metrics.update(counts)
    return loaded["train_prompts"], loaded["test_prompts"], metrics


def load_rl_prompt_file(config: Config, tokenizer, name: str) -> tuple[list[PromptRecord], dict[str, float]]:
    """The records of data.<name> (train_prompts or test_prompts) held to the RL prompt limit, with
    data/<name>_skipped and data/<name>_truncated: what data.overlong_prompts did to them."""
    data, context = config.data, config.model.max_position_embeddings
    bound = f"data.max_prompt_tokens = {max_prompt_tokens(config)}"
    if not data.max_prompt_tokens:
        bound += f" (model.max_position_embeddings {context} - rollout.max_new_tokens {config.rollout.max_new_tokens})"
    limit = PromptLimit(tokenizer, max_prompt_tokens(config), bound, data.overlong_prompts)
    records = _load_data_file(config, name, limit)
    return records, {f"data/{name}_skipped": limit.num_skipped, f"data/{name}_truncated": limit.num_truncated}


def load_sft_data(config: Config, tokenizer) -> list[PromptRecord]:
    """data.sft_pairs, each pair tokenized once: prompt, answer and EOS must fit in the model's context."""
    context = config.model.max_position_embeddings
    limit = PromptLimit(tokenizer, context, f"model.max_position_embeddings = {context}", config.data.overlong_prompts,
                        with_answer=True)
    return _load_data_file(config, "sft_pairs", limit)


def _data_path(config: Config, name: str) -> str:
    path = getattr(config.data, name)
    if not path:
        raise ValueError(f"data.{name} is not set: give its path in the config or with --set data.{name}=PATH")
    return path


def _load_data_file(config: Config, name: str, limit: PromptLimit) -> list[PromptRecord]:
    """The records of data.<name>, their fields at data.prompt_key and data.answer_key, rendered through the
    chat template with data.chat_template; says on rank 0 how many data.overlong_prompts changed."""
    path = _data_path(config, name)
    data = config.data
    try:
        fields = RecordFields(data.prompt_key, data.answer_key, data.chat_template)
        records = load_prompts(path, limit, fields)
    except ValueError as error:
        raise ValueError(f"data.{name}: {error}") from None
    changed = limit.num_skipped or limit.num_truncated
    if changed and is_rank_zero():
        done = "skipped" if limit.num_skipped else "cut at the left to fit"
        print(f"data.{name}: {changed} of {len(records) + limit.num_skipped} records longer than {limit.bound} "
              f"{done} (data.overlong_prompts = {limit.overlong})")
    return records
