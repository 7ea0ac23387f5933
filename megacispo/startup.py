"""What the entry points share, in the order a run starts: the command line; the config checked as a
whole (the checks that span sections or need a subsystem: the loss registry, the reward module, the
rollout cache), then against the world size; loading the tokenizer and the prompts; the dry-run plan;
and the one way bad input ends a process. Everything here runs before any model is built."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import sys
import time
import warnings
from typing import Callable

import psutil
import torch

from megacispo.config import Config, load_config
from megacispo.data.prompts import PromptLimit, PromptRecord, RecordFields, load_prompts
from megacispo.data.rewards import get_reward_fn
from megacispo.data.tokenizer import Tokenizer
from megacispo.envs.base import get_environment_factory, make_environment
from megacispo.envs.turns import build_renderer
from megacispo.fields import check_choice
from megacispo.metrics.logger import check_logging
from megacispo.models.config import M2, check_precision_and_recompute, model_shape, parameter_counts
from megacispo.models.routing import route_dtype
from megacispo.models.te_specs import INSTALL_HINT, require_transformer_engine, transformer_engine_installed
from megacispo.parallel.layout import CONTEXT_PARALLEL_COMMS, validate_layout, world_size_from_env
from megacispo.rl import adaptive_clip
from megacispo.rl.losses import policy_loss_names, validate_policy_loss_params
from megacispo.rollout.config import VLLM
from megacispo.rollout.generate import GIB, rollout_cache_bytes
from megacispo.rollout.vllm_install import vllm_version


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
def bad_input_exits(kind: type[ValueError] | tuple[type[ValueError], ...] = ValueError):
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
    _check_vllm_layout(config, world_size)
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
    return run_config(args.config, overrides, load_field=args.load_field)


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
        f"x CP {parallel.context_parallel_size} x DP {parallel.data_parallel_size(world_size)}; "
        f"EP {parallel.expert_model_parallel_size}, "
        f"sequence parallel {parallel.sequence_parallel}",
        precision_plan(config),
        f"lengths: prompts up to {config.max_prompt_tokens} tokens (longer: {config.data.overlong_prompts}) + "
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
    bound = f"data.max_prompt_tokens = {config.max_prompt_tokens}"
    if not data.max_prompt_tokens:
        bound += f" (model.max_position_embeddings {context} - rollout.max_new_tokens {config.rollout.max_new_tokens})"
    limit = PromptLimit(tokenizer, config.max_prompt_tokens, bound, data.overlong_prompts)
    records = _load_data_file(config, name, limit)
    return records, {f"data/{name}_skipped": limit.num_skipped, f"data/{name}_truncated": limit.num_truncated}


def load_sft_data(config: Config, tokenizer) -> list[PromptRecord]:
    """data.sft_pairs, each pair tokenized once: prompt, answer and EOS must fit in the model's context,
    and their inputs (all tokens but the last) in a packed micro-batch. A pair with "turns" is a
    multi-turn demonstration, rendered as env.name's rollouts lay conversations out (megacispo.data.chat)."""
    context = config.model.max_position_embeddings
    render_turns = None
    if config.env.multi_turn:
        render_turns = build_renderer(config.env, get_environment_factory(config.env.name), tokenizer,
                                      config.data.chat_template).turn_ids
    limit = PromptLimit(tokenizer, context, f"model.max_position_embeddings = {context}", config.data.overlong_prompts,
                        with_answer=True, render_turns=render_turns)
    pairs = _load_data_file(config, "sft_pairs", limit)
    longest = max((len(pair.prompt_ids) + len(pair.target_ids) - 1 for pair in pairs), default=0)
    config.train.check_fits(longest, f"the longest pair of data.sft_pairs = {config.data.sft_pairs}, without its last token")
    return pairs


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


# ---------------------------------------------------------------------------------------------
# The config as a whole
# ---------------------------------------------------------------------------------------------


def run_config(path: str | None, overrides: list[str] = (), load_field: str | None = None) -> Config:
    """The config an entry point runs: loaded (``load_config``) and checked as a whole (``check_config``)."""
    return check_config(load_config(path, overrides, load_field=load_field))


def check_config(config: Config) -> Config:
    """Every rule that spans sections or needs a subsystem, and that needs neither the world size nor a
    model: the loss and its parameters (the registry), the reward (its module imported now), the clip
    bounds adaptive clipping moves, rollouts on their own processes, lengths, the compiled decode
    step, the rollout cache, precision and recompute, logging. Returns ``config`` with the loss's
    parameters completed by its defaults; each error names the field, the value and the fix."""
    rl = config.rl
    check_choice("rl.loss.name", rl.loss.name, policy_loss_names())
    try:
        params = validate_policy_loss_params(rl.loss.name, rl.loss.params)
    except ValueError as error:
        raise ValueError(f"rl.loss: {error}") from None
    try:
        get_reward_fn(rl.reward)
    except ValueError as error:
        raise ValueError(f"rl.reward: {error}") from None
    adaptive_clip.check_bounds(rl.adaptive_clip, rl.loss, params)
    _check_environment(config)
    _check_placement(config)
    _check_rollout_engine(config)
    _check_lora(config)
    _check_context_parallel(config)
    _check_lengths(config)
    _check_compile_decode(config)
    _check_rollout_memory(config)
    check_precision_and_recompute(config.model, config.parallel, config.precision, config.recompute)
    check_logging(config.logging)
    loss = dataclasses.replace(rl.loss, params=params)
    return dataclasses.replace(config, rl=dataclasses.replace(rl, loss=loss))


def _check_context_parallel(config: Config) -> None:
    """What splitting every packed row over parallel.context_parallel_size ranks needs: packed rows, and
    nothing that sees a sequence whole outside the loss (whose per-sequence sums span the CP ranks:
    megacispo.rl.losses.Sequences), nor rollout processes apart."""
    check_choice("parallel.context_parallel_comm", config.parallel.context_parallel_comm, CONTEXT_PARALLEL_COMMS)
    cp = config.parallel.context_parallel_size
    if cp == 1:
        return
    field = f"parallel.context_parallel_size = {cp}"
    if not config.train.pack_sequences:
        raise ValueError(f"{field} splits packed rows over its ranks, but train.pack_sequences is false: set it true")
    if config.logging.metric_hooks:
        raise ValueError(
            f"{field} with logging.metric_hooks: a hook sees its micro-batch's tokens as whole sequences, and "
            f"context parallelism splits them over ranks; remove the hooks or set parallel.context_parallel_size = 1"
        )
    if config.placement.rollout_ranks:
        raise ValueError(
            f"{field} with placement.rollout_ranks = {config.placement.rollout_ranks}: the CP ranks generate as "
            f"replicas of their own in the training processes; set placement.rollout_ranks = 0 or "
            f"parallel.context_parallel_size = 1"
        )


def _check_environment(config: Config) -> None:
    """env.name names an environment that can be made with env.params (one is made now)."""
    env = config.env
    if env.multi_turn:
        make_environment(get_environment_factory(env.name), env.params, env.name)


def check_environment_tokens(config: Config, tokenizer) -> None:
    """env.stop_tokens are single tokens of the run's tokenizer, and the chat template can place replies."""
    if config.env.multi_turn:
        build_renderer(config.env, get_environment_factory(config.env.name), tokenizer, config.data.chat_template)


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


def _check_rollout_engine(config: Config) -> None:
    """What rollout.engine = vllm needs: a family vLLM serves, vLLM installed at a supported version, and no
    option that only megacispo's engine honours (vLLM would ignore it, or its log-probs would mean another
    thing than the trainer's)."""
    rollout = config.rollout
    if rollout.engine != VLLM:
        return
    field = "rollout.engine = vllm"
    if config.model.family != M2:
        raise ValueError(f"{field} with model.family = {config.model.family}: vLLM does not serve MiniMax-M1 (it "
                         "removed MiniMaxText01 after 0.23); set rollout.engine=megacispo")
    truncated = "vLLM's log-probs of such a draw are of the truncated distribution, the trainer's of the tempered one"
    refused = [  # (field, its value, the value that works on vLLM, why)
        ("placement.rollout_ranks", config.placement.rollout_ranks, 0, "vLLM runs in every training process"),
        ("rl.routing_replay", config.rl.routing_replay, False,
         "replay needs the experts the rollout routed each token to; vLLM 0.32 returns them only from its model "
         "runner V2 (Triton, GPUs), which megacispo does not read"),
        ("rollout.early_truncation_tokens", rollout.early_truncation_tokens, 0, "vLLM has no early truncation"),
        ("rollout.top_k", rollout.top_k, 0, truncated),
        ("rollout.top_p", rollout.top_p, 1.0, truncated),
        ("rollout.compile_decode", rollout.compile_decode, False,
         "it compiles megacispo's decode step; vLLM compiles its own (CUDA graphs on GPUs)"),
        ("rollout.max_cache_gib", rollout.max_cache_gib, 0,
         "it caps megacispo's cache; vLLM's is rollout.vllm_cache_gib"),
        ("rollout.host_check_every", rollout.host_check_every, 0, "it paces megacispo's decode loop, not vLLM's"),
    ]
    for name, value, works, why in refused:
        if value != works:
            raise ValueError(f"{field} with {name} = {value}: {why}; set {name}={str(works).lower()} or "
                             "rollout.engine=megacispo")
    try:
        vllm_version()
    except ValueError as error:
        raise ValueError(f"{field}: {error}") from None


def _check_lora(config: Config) -> None:
    """LoRA: targets the model has, a rank below their dimensions, a base to adapt (train.load), and local
    layers (not Transformer Engine's)."""
    lora = config.lora
    lora.check_model(config.model)
    if not lora.enabled:
        return
    field = f"lora.rank = {lora.rank}"
    if not config.train.load:
        raise ValueError(f"{field} trains adapters on a frozen base, but train.load is unset: set train.load to the "
                         "base (a megacispo checkpoint or a Hugging Face directory), or lora.rank=0")
    precision = config.precision
    if precision.transformer_engine:
        raise ValueError(f"{field} with precision.fp8 = {precision.fp8} and precision.use_transformer_engine = "
                         f"{precision.use_transformer_engine}: adapters sit on Megatron's local linears, not Transformer "
                         "Engine's; set precision.fp8=null and precision.use_transformer_engine=false, or lora.rank=0")


def _check_vllm_layout(config: Config, world_size: int) -> None:
    """rollout.vllm_tensor_parallel splits the world into vLLM engines of consecutive processes."""
    tensor_parallel = config.rollout.vllm_tensor_parallel
    if config.rollout.engine == VLLM and world_size % tensor_parallel:
        raise ValueError(
            f"rollout.vllm_tensor_parallel = {tensor_parallel} does not divide the {world_size} processes: each vLLM "
            f"engine spans that many consecutive ones; use a divisor of {world_size}"
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


def check_rl_batches(config: Config, data_parallel_size: int) -> None:
    """The rollout batch splits evenly over the data-parallel ranks, then into the K updates and their
    micro-batches: an uneven split leaves a rank without samples, found only after a rollout."""
    rollout, updates = config.rollout, config.rl.updates_per_rollout
    _check_split("rollout.prompts_per_step", rollout.prompts_per_step, data_parallel_size)
    cp = config.parallel.context_parallel_size
    if rollout.prompts_per_step // data_parallel_size % cp:
        raise ValueError(
            f"rollout.prompts_per_step = {rollout.prompts_per_step} gives each of the {data_parallel_size} data-parallel "
            f"ranks {rollout.prompts_per_step // data_parallel_size} prompts, which its parallel.context_parallel_size "
            f"= {cp} ranks cannot share evenly (each generates an equal part): use a multiple of "
            f"{data_parallel_size * cp}"
        )
    per_rank = rollout.prompts_per_step // data_parallel_size * rollout.group_size
    if per_rank % updates:
        raise ValueError(
            f"rl.updates_per_rollout = {updates} does not divide the {per_rank} samples of each data-parallel rank "
            f"(rollout.prompts_per_step / {data_parallel_size} ranks x rollout.group_size): "
            f"choose a divisor of {per_rank}"
        )
    _check_micro_batches(config, per_rank // updates, "samples of each update")
    config.train.check_fits(config.max_prompt_tokens + rollout.max_new_tokens,
                            "data.max_prompt_tokens, or what the context leaves, + rollout.max_new_tokens")
    _check_rollout_host_memory(config, per_rank)


# Host bytes of one sample in Python objects, whatever its length: its prompt's token list, and its
# entries in the rollout's waiting queue and per-sample lists and in the repeated prompt records.
SAMPLE_OBJECT_BYTES = 200
# Host bytes of one position of one sample outside the expert routes: the rollout's response tokens
# (int64) and log-probs (fp32), and the batch's tokens (int64) and log-probs (fp32) made from them.
POSITION_BYTES = 24


def rollout_bytes(config: Config, samples: int) -> tuple[int, int]:
    """Lower bounds on one process's rollout of ``samples`` samples, as (the host memory of the samples:
    their tokens, log-probs and expert routes at 1 + rollout.max_new_tokens positions each, the
    shortest a prompt makes them; the rollout cache of rollout.max_running slots, or of every sample
    when it is 0, on the device that generates)."""
    model, parallel = config.model, config.parallel
    layers = model.num_layers // parallel.pipeline_model_parallel_size
    positions = 1 + config.rollout.max_new_tokens
    route_bytes = layers * model.moe_router_topk * route_dtype(model.num_experts).itemsize
    held = samples * (SAMPLE_OBJECT_BYTES + positions * (POSITION_BYTES + route_bytes))
    cache = rollout_cache_bytes(model, range(layers), slots=min(config.rollout.max_running or samples, samples),
                                max_length=positions, tensor_parallel=parallel.tensor_model_parallel_size,
                                kv_bytes=config.rollout.torch_dtype(torch.cuda.is_available()).itemsize)
    return held, cache


def _check_rollout_host_memory(config: Config, samples_per_rank: int) -> None:
    """A rollout batch whose samples cannot fit in this machine's memory is refused before any work,
    rather than growing until the machine runs out. The processes on this machine are torchrun's
    LOCAL_WORLD_SIZE (a plain dry run: one). The cache is host memory only where torchrun runs the
    processes here without CUDA (the CPU back-end): a dry run on a login node cannot tell where a
    run will generate, and a GPU's cache is checked against its free memory when the rollout starts."""
    rollout = config.rollout
    samples = samples_per_rank
    if config.placement.rollout_ranks:
        samples = max(samples, rollout.prompts_per_step // config.placement.rollout_ranks * rollout.group_size)
    held, cache = rollout_bytes(config, samples)
    if "LOCAL_WORLD_SIZE" not in os.environ or torch.cuda.is_available():
        cache = 0
    processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    total = psutil.virtual_memory().total
    if (held + cache) * processes <= total:
        return
    fixes = ["lower rollout.group_size or rollout.prompts_per_step", "spread the batch over more data-parallel ranks"]
    if cache > held and rollout.max_running == 0:
        fixes.insert(0, "set rollout.max_running (e.g. 256: the cache of that many slots, not of every sample)")
    cache_part = (f" and {cache / GIB:.1f} GiB for the rollout cache of rollout.max_running = {rollout.max_running} "
                  f"({'every sample at once' if rollout.max_running == 0 else 'slots'})") if cache else ""
    raise ValueError(
        f"rollout.prompts_per_step = {rollout.prompts_per_step} x rollout.group_size = {rollout.group_size} puts "
        f"{samples} samples on each process that generates: at least {held / GIB:.1f} GiB of host memory per process "
        f"for their tokens, log-probs and expert routes{cache_part}, {(held + cache) * processes / GIB:.1f} GiB for "
        f"the {processes} process(es) on this machine, over its {total / GIB:.1f} GiB: " + ", or ".join(fixes)
    )


def check_sft_batches(config: Config, data_parallel_size: int) -> None:
    """sft.batch_size splits evenly over the data-parallel ranks and into micro-batches; SFT trains every weight."""
    if config.lora.enabled:
        raise ValueError(f"lora.rank = {config.lora.rank}: megacispo.sft trains every weight (adapters are for RL, "
                         "megacispo.train); set lora.rank=0")
    _check_split("sft.batch_size", config.sft.batch_size, data_parallel_size)
    _check_micro_batches(config, config.sft.batch_size // data_parallel_size, "pairs of each SFT step")


def _check_split(name: str, value: int, data_parallel_size: int) -> None:
    if value % data_parallel_size:
        raise ValueError(
            f"{name} = {value} is not divisible by the data-parallel size {data_parallel_size} "
            f"(world size / (TP x PP)): use a multiple of {data_parallel_size}"
        )


def _check_micro_batches(config: Config, per_rank: int, what: str) -> None:
    """Padded rows (train.pack_sequences off) come train.micro_batch_size to a micro-batch."""
    size = config.train.micro_batch_size
    if not config.train.pack_sequences and size < per_rank and per_rank % size:
        raise ValueError(
            f"train.micro_batch_size = {size} does not divide the {per_rank} {what} on a data-parallel rank: "
            f"choose a divisor of {per_rank}, or {per_rank} or more for one micro-batch"
        )


def _check_compile_decode(config: Config) -> None:
    """rollout.compile_decode traces the lean decode step, which needs every layer on one pipeline stage;
    where torchrun runs the processes here without CUDA (the CPU back-end), inductor compiles it with a
    C++ compiler, which must be found now rather than at the first rollout's first step (a traceback
    deep in inductor). A dry run cannot tell where a run will generate: it checks the layout only."""
    if not config.rollout.compile_decode:
        return
    pipeline = config.parallel.pipeline_model_parallel_size
    if pipeline != 1:
        raise ValueError(
            f"rollout.compile_decode = true needs parallel.pipeline_model_parallel_size = 1, got {pipeline}: "
            "the compiled decode step is the lean step of every layer on one stage; set rollout.compile_decode=false"
        )
    if "LOCAL_WORLD_SIZE" not in os.environ or torch.cuda.is_available():
        return
    # Imported here: inductor's import takes a second, which only a CPU run that compiles needs.
    from torch._inductor import config as inductor_config, cpp_builder, exc

    try:
        cpp_builder.get_cpp_compiler()
    except exc.InvalidCxxCompiler:
        raise ValueError(
            f"rollout.compile_decode = true on a CPU compiles the decode step with a C++ compiler, and none of "
            f"{[c for c in inductor_config.cpp.cxx if c]} runs here: install g++ (or set CXX to one), or set "
            "rollout.compile_decode=false"
        ) from None


def config_rollout_bytes(config: Config) -> int:
    """Rollout cache bytes (``rollout_cache_bytes``) of rollout.max_running slots on the pipeline
    stage that holds the most, at data.max_prompt_tokens + rollout.max_new_tokens."""
    parallel, model = config.parallel, config.model
    pp = parallel.pipeline_model_parallel_size
    per_stage = model.num_layers // pp
    kv_bytes = config.rollout.torch_dtype(torch.cuda.is_available()).itemsize
    return max(
        rollout_cache_bytes(
            model, range(stage * per_stage, (stage + 1) * per_stage), slots=config.rollout.max_running,
            max_length=config.max_prompt_tokens + config.rollout.max_new_tokens,
            tensor_parallel=parallel.tensor_model_parallel_size, kv_bytes=kv_bytes,
        )
        for stage in range(pp)
    )


def _check_rollout_memory(config: Config) -> None:
    """rollout.max_cache_gib caps the rollout cache of rollout.max_running slots (start-up check)."""
    cap = config.rollout.max_cache_gib
    if not cap:
        return
    slots = config.rollout.max_running
    if slots == 0:
        raise ValueError(
            f"rollout.max_cache_gib = {cap:g} needs rollout.max_running > 0: 0 decodes all of a rank's samples "
            "at once, which no cap bounds; set rollout.max_running"
        )
    needed = config_rollout_bytes(config) / GIB
    if needed <= cap:
        return
    # A slot's cache is the same at any slot count: the cap holds cap / per_slot of them, exactly.
    per_slot = needed / slots
    length = f"{config.max_prompt_tokens + config.rollout.max_new_tokens} tokens per sequence"
    if config.rollout.dtype == "auto" and not torch.cuda.is_available():
        # A dry run of a GPU config on a login node: auto is float32 here, bfloat16 on the GPUs (half the bytes).
        length += (" in float32 (rollout.dtype auto, on this machine without a GPU; GPUs generate in bfloat16: "
                   "set rollout.dtype=bfloat16 to check the cap for them)")
    if per_slot > cap:
        raise ValueError(
            f"rollout.max_cache_gib = {cap:g} is below the {per_slot:.3g} GiB of rollout cache one slot needs at "
            f"{length}: raise rollout.max_cache_gib to at least {per_slot:.3g}, or lower rollout.max_new_tokens "
            "or data.max_prompt_tokens"
        )
    # Refused rather than lowered: the slots set the rollout's throughput, which a week-long run plans on;
    # the fix costs one restart now, a silently slower rollout costs every step.
    raise ValueError(
        f"rollout.max_running = {slots} slots need {needed:.3g} GiB of rollout cache at {length} "
        f"({per_slot:.3g} GiB each), over rollout.max_cache_gib = {cap:g}: lower rollout.max_running to "
        f"{int(cap // per_slot)} (what the cap holds) or raise the cap to {needed:.3g}"
    )
