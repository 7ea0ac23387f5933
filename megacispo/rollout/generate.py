"""Rollouts: G samples per prompt from the policy being trained (no second copy of the weights).

Generation uses the model's own cache (the d x d state of the lightning layers, KV for the softmax
layers) and batches continuously over slots: ``rollout.max_running`` sequences (the rows of the
cache) decode together, one token each per decode step, and a finished sequence's slot takes the
next waiting sample at once: that prompt alone is prefilled and written into the slot's rows of the
cache (``InferenceCache.write_rows``) while the others keep their state. A long response therefore
holds one slot, not the whole batch, and the cache is bounded by the slots, not by the samples.

The cache's positions are shared by its rows: every decode step appends one position to all of
them, and a refilled row's prompt ends at the newest position, masked before it, like a left-padded
prompt; RoPE positions count each row's own tokens. The softmax layers' KV is preallocated for the
slots at the rollout's longest sequence plus a quarter (``slot_capacity``); when the positions
reach it, the oldest ones no running sequence uses are dropped (``InferenceCache.drop_oldest``, an
in-place move every quarter-length steps at most). Preallocated rather than paged: the decode step
stays one dense masked attention over the slots (the same step as the eager, lean and compiled
paths run), and only the softmax layers (1 in 8) keep KV at all; the lightning states are O(1) per
slot.

A decode step is decided on the device: which rows still decode, what each draws, when a sample
ends (a stop id, its length limit, early truncation); nothing is read back to the host inside it, so
that a GPU never waits for the host between steps. The host looks every ``rollout.host_check_every``
steps (by default 4 on a GPU, 1 on a CPU, where a look costs nothing; outside a lockstep group also
at the step a sample reaches its length limit) with one copy of the rows' state, and only then
frees, refills or drops rows: an ended row idles until then.

Sampling does not depend on the slots: each sample has a 64-bit key (``sample_keys``: from the
seed, the step and the sample's place in the global batch), and its token t is drawn by inverse-CDF
from one uniform that a counter-based hash (splitmix64) computes from (key, t) on the device, so the
same samples come out at any ``max_running`` and ``host_check_every``, in any order slots free up. Under tensor
parallelism the model gathers the vocabulary shards of the last position's logits, so every rank of
the TP group sees the full distribution and draws the same token.

Multi-turn (``conversations``, megacispo.envs.turns): a turn that ends at a stop id goes to its
sample's environment at the next look, and its row waits with its state held (``InferenceCache.live_rows``:
a decode step leaves the row's lightning states and RoPE position as they are and masks its new KV
position), while the other rows decode. When the reply comes, it is prefilled into the row after the
turn's last token, from the held state (``HybridModel.extend``: nothing before it is recomputed), and
the row decodes the next turn from the reply's last logits. A response is every turn's tokens and
every reply's, in the order they were sampled and fed; the loss mask covers the sampled ones.

Generation runs in rollout.dtype (``HybridModel.generation_dtype``: a copy of the weights in that
precision for the rollout, the LM head in fp32 with model.fp32_lm_head), and the log-probs it
reports are those of that computation, as an inference engine's are. Every routing records the
experts each MoE layer of this stage chose for each token (``Samples.routes``, compact integers),
for the trainer's router-disagreement metric and routing replay (models/routing.py).
"""

from __future__ import annotations

import functools
import logging
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from tqdm import tqdm

from megacispo.data.padding import right_padding_mask
from megacispo.envs.turns import Conversations
from megacispo.models.compiling import code_copy
from megacispo.models.config import SOFTMAX, HybridModelConfig
from megacispo.models.routing import route_dtype
from megacispo.rollout.config import RolloutConfig

GIB = 2**30
logger = logging.getLogger(__name__)


@dataclass
class Samples:
    """A batch of generated sequences, right-padded: prompt, response, then padding.

    Position t of the [n, S - 1] tensors describes the prediction of token t + 1.
    """

    tokens: torch.Tensor
    """[n, S] int64 token ids."""
    prompt_lengths: torch.Tensor
    """[n] tokens of each prompt (BOS included)."""
    response_lengths: torch.Tensor
    """[n] tokens after each prompt (its EOS included; multi-turn, every turn's and reply's)."""
    rollout_logprobs: torch.Tensor
    """[n, S - 1] log-prob of each response token under the sampling policy; 0 elsewhere."""
    loss_mask: torch.Tensor
    """[n, S - 1] 1.0 where token t + 1 is a response token the model sampled (not an environment's reply)."""
    truncated_early: torch.Tensor
    """[n] bool: stopped by early truncation (N consecutive tokens above probability p)."""
    routes: torch.Tensor
    """[n, S, L, k] the experts (``route_dtype``) the rollout routed token t to in each of this pipeline
    stage's L MoE layers; recorded for each sample's prompt and response tokens but its last (never fed
    back), 0 elsewhere."""

    def select(self, rows: torch.Tensor | slice) -> Samples:
        return Samples(*(getattr(self, name)[rows] for name in self.__dataclass_fields__))

    def to(self, device: torch.device | str) -> Samples:
        """Every tensor on ``device`` (host copies go between processes: a pickled GPU tensor would be
        unpickled onto the sender's GPU)."""
        return Samples(*(getattr(self, name).to(device) for name in self.__dataclass_fields__))

    def padding_mask(self, width: int) -> torch.Tensor:
        """[n, width] bool: True after each sequence's prompt and response (tokens right-padded to width)."""
        return right_padding_mask(self.prompt_lengths + self.response_lengths, width)


Generator = Callable[..., Samples]
"""What generates a rollout's samples: ``generate`` bound to a model (megacispo's engine:
``functools.partial(generate, model)``) or vLLM's (megacispo.rollout.vllm_engine.VllmRollouts.generate); the
arguments of ``generate`` after the model."""


# ------------------------------------------------------------------------------------------------
# Per-sample random streams

_GOLDEN = 0x9E3779B97F4A7C15 - 2**64  # splitmix64's increment, as a signed int64
_MIX_1 = 0xBF58476D1CE4E5B9 - 2**64
_MIX_2 = 0x94D049BB133111EB - 2**64


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's >> is arithmetic: it copies the sign bit)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 tensors (a bijection of 64-bit patterns; products wrap)."""
    x = (x ^ _shift_right(x, 30)) * _MIX_1
    x = (x ^ _shift_right(x, 27)) * _MIX_2
    return x ^ _shift_right(x, 31)


def _as_int64(value: int) -> int:
    return (value + 2**63) % 2**64 - 2**63


def sample_keys(
    stream: Sequence[int], prompt_indices: Iterable[int], group_size: int, *, device: torch.device | str
) -> torch.Tensor:
    """[len(prompt_indices) * group_size] int64 keys, prompt-major (the order of the trainer's prompt
    list): sample j of prompt i gets a hash of (*stream, i, j). ``stream`` names the rollout (the
    trainer's: seed, step, sampler position), ``prompt_indices`` the prompts' places in the global
    batch, so that the samples depend neither on the data-parallel layout nor on the slots."""
    prompts = torch.tensor([_as_int64(i) for i in prompt_indices], dtype=torch.long, device=device)
    samples = torch.arange(group_size, dtype=torch.long, device=device)
    key = torch.full((), _GOLDEN, dtype=torch.long, device=device)
    for value in stream:
        key = _mix64(key ^ _as_int64(value))
    key = _mix64(key ^ prompts[:, None])
    return _mix64((key + _GOLDEN) ^ samples[None, :]).reshape(-1)


def _uniforms(keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[b] float64 in [0, 1): the draw of each row's token ``positions`` [b] from its stream ``keys``
    [b] (splitmix64's output number positions + 1 of that seed: the top 53 bits)."""
    bits = _mix64(keys + (positions + 1) * _GOLDEN)
    return _shift_right(bits, 11).to(torch.float64) * 2.0**-53


def sample_tokens(
    logits: torch.Tensor, config: RolloutConfig, keys: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draw one token per row of ``logits`` [b, V]: row r's token number ``positions[r]`` of the
    stream ``keys[r]`` (both [b] int64; unused when greedy).

    Returns (tokens [b], logprobs [b], probs [b]): the log-prob of the drawn token under the
    tempered distribution (the one the trainer's ratio compares against) and its probability under
    the truncated sampling distribution (what early truncation watches).
    """
    logits = logits if logits.dtype == torch.float64 else logits.float()
    if config.temperature == 0:
        logprobs = torch.log_softmax(logits, dim=-1)
        tokens = logits.argmax(dim=-1)
        chosen = logprobs.gather(-1, tokens[:, None]).squeeze(-1)
        return tokens, chosen, chosen.exp()
    logprobs = torch.log_softmax(logits / config.temperature, dim=-1)
    sampling_logits = logprobs.clone()
    if config.top_k > 0:
        kth = sampling_logits.topk(min(config.top_k, sampling_logits.shape[-1]), dim=-1).values[:, -1:]
        sampling_logits = sampling_logits.masked_fill(sampling_logits < kth, float("-inf"))
    if config.top_p < 1.0:
        sorted_logits, order = sampling_logits.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens ranked above it already hold top_p of the mass.
        drop = sorted_probs.cumsum(dim=-1) - sorted_probs >= config.top_p
        sampling_logits = sampling_logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    sampling_probs = sampling_logits.softmax(dim=-1)
    # Inverse CDF: the first token whose cumulative probability exceeds the uniform (a token of zero
    # probability adds nothing to the sum, so it is never the first to exceed it).
    cdf = sampling_probs.to(torch.float64).cumsum(dim=-1)
    target = _uniforms(keys, positions) * cdf[:, -1]
    tokens = torch.searchsorted(cdf, target[:, None], right=True).squeeze(-1).clamp(max=logits.shape[-1] - 1)
    chosen = logprobs.gather(-1, tokens[:, None]).squeeze(-1)
    return tokens, chosen, sampling_probs.gather(-1, tokens[:, None]).squeeze(-1)


# ------------------------------------------------------------------------------------------------
# Memory of the slots


def slot_capacity(max_length: int) -> int:
    """Positions the cache holds for sequences of up to ``max_length`` tokens (prompt and response): a
    quarter more (at least 16), so that dropping the unused oldest positions happens at most every
    quarter-length steps."""
    return max_length + max(16, max_length // 4)


def rollout_cache_bytes(
    model: HybridModelConfig, layers: Iterable[int], *, slots: int, max_length: int, tensor_parallel: int,
    kv_bytes: int, state_bytes: int = 4,
) -> int:
    """Bytes of the rollout cache of ``slots`` slots on one GPU holding ``layers`` (global indices)
    under ``tensor_parallel``: the softmax layers' keys and values (``kv_bytes`` per number, the
    model's dtype) for slot_capacity(max_length) positions, the lightning layers' [heads, d, d]
    states (fp32: ``state_bytes``), and the [slots, V] fp32 logits with the sampler's fp32 / fp64
    copies of them (tempered log-probs, filtered logits, probabilities, cumulative sum: 24 bytes a
    number)."""
    heads = max(1, model.num_attention_heads // tensor_parallel)
    kv_heads = max(1, model.num_query_groups // tensor_parallel)
    per_slot = 0
    for layer in layers:
        if model.layer_kind(layer) == SOFTMAX:
            per_slot += 2 * kv_heads * model.head_dim * slot_capacity(max_length) * kv_bytes
        else:
            per_slot += heads * model.head_dim * model.head_dim * state_bytes
    return slots * (per_slot + 24 * model.vocab_size)


def _check_device_fits(model, slots: int, max_length: int, device: torch.device) -> None:
    """On a GPU, the slots' cache must fit in the free memory: an error naming the slots and the memory
    before any of it is allocated, instead of an out-of-memory error midway through a rollout."""
    if device.type != "cuda":
        return
    needed = rollout_cache_bytes(
        model.hybrid_config, [layer.layer_number - 1 for layer in model.decoder.layers], slots=slots,
        max_length=max_length, tensor_parallel=model.pg_collection.tp.size(),
        kv_bytes=next(model.parameters()).element_size(),
    )
    free = torch.cuda.mem_get_info(device)[0]
    if needed > free:
        raise ValueError(
            f"rollout.max_running: {slots} slots of {max_length} tokens need {needed / GIB:.2f} GiB of rollout "
            f"cache, but {free / GIB:.2f} GiB of GPU memory are free: lower rollout.max_running "
            f"(about {max(1, slots * free // needed)} fit)"
        )


# ------------------------------------------------------------------------------------------------
# The engine


@torch.no_grad()
def generate(
    model,
    prompts: list[list[int]],
    config: RolloutConfig,
    *,
    stop_ids: Sequence[int],
    pad_id: int,
    keys: torch.Tensor,
    response_limits: Sequence[int] | None = None,
    lockstep_group: dist.ProcessGroup | None = None,
    progress: tqdm | None = None,
    interrupt: Callable[[], None] | None = None,
    conversations: Conversations | None = None,
) -> Samples:
    """Sample one response per prompt (repeat a prompt G times for a group), in prompt order.

    ``stop_ids``: a sample ends with the first of these it draws (EOS, and a chat template's end of turn).
    ``keys``: [len(prompts)] int64 random stream of each sample (``sample_keys``), on the device of
    the model's logits; the samples are made there too.
    ``response_limits``: a per-sample cap on the generated tokens (at most rollout.max_new_tokens);
    None: rollout.max_new_tokens for all.
    ``lockstep_group``: ranks whose forward passes communicate with each other beyond tensor
    parallelism (expert parallelism's all-to-all spans data-parallel ranks): they all run the same
    forward passes (decode steps, and refill prefills, a one-token dummy where a rank has none)
    until every one of them has finished.
    ``interrupt``: called before every decode step (so at the same steps on every rank); what it
    raises abandons the rollout (the trainer's SIGTERM check).
    ``progress``: a bar the finished samples are counted on, its total grown by ``len(prompts)``
    (the caller owns it: one per RL step on the logging rank); None draws nothing.
    ``conversations``: multi-turn samples (megacispo.envs.turns): a turn that ends at a stop id goes
    to the sample's environment, and its reply is prefilled into the sample's slot, which then decodes
    the next turn; ``rollout.max_new_tokens`` and ``response_limits`` cap the whole response (every
    turn's tokens and every reply's), and the loss mask covers the sampled tokens only.
    """
    if keys.shape != (len(prompts),):
        raise ValueError(f"keys has shape {tuple(keys.shape)}: pass one key per prompt, [{len(prompts)}]")
    limits = [config.max_new_tokens] * len(prompts) if response_limits is None else list(response_limits)
    if len(limits) != len(prompts) or not all(1 <= limit <= config.max_new_tokens for limit in limits):
        raise ValueError(
            f"response_limits: pass one limit in [1, rollout.max_new_tokens = {config.max_new_tokens}] per prompt"
        )
    _check_context(model.hybrid_config.max_position_embeddings, prompts, limits)
    was_training = model.training
    metrics_before = torch._dynamo.utils.get_compilation_metrics()
    # Decoding is inference: Megatron's MoE layer refuses TP without sequence parallelism in
    # training mode, and the model switches sequence parallelism off for single-token steps.
    model.eval()
    try:
        # Compiled steps replay graphs recorded on the rollout weights' addresses: the same tensors every rollout.
        weights = model.generation_dtype(config.torch_dtype(keys.is_cuda), keep=config.compile_decode)
        with weights, model.recording_routes():
            engine = _SlotRollout(model, prompts, config, stop_ids, pad_id, keys, limits, lockstep_group, conversations)
            return engine.run(progress, interrupt)
    finally:
        model.train(was_training)
        if config.compile_decode:
            _report_compiles(metrics_before)
        if config.compile_decode and keys.is_cuda:
            # The rollout's cache and records are its own tensors, static inputs of the graphs it recorded:
            # the next rollout records its own, and inductor's cudagraph trees would keep these (and their
            # memory pool) for good. Freed here; the compiled code stays, so nothing recompiles.
            torch._inductor.cudagraph_trees.reset_cudagraph_trees()


def _check_context(context: int, prompts: list[list[int]], limits: list[int]) -> None:
    """Every prompt and its response limit fit the model's context (RoPE past it is untrained, and the
    rollout would succeed with samples the model cannot score): a prompt exactly at the limit fits."""
    longest = max(range(len(prompts)), key=lambda i: len(prompts[i]) + limits[i])
    length = len(prompts[longest]) + limits[longest]
    if length > context:
        raise ValueError(
            f"prompt {longest} has {len(prompts[longest])} tokens and may get {limits[longest]} more: {length} "
            f"positions, past model.max_position_embeddings = {context}: shorten the prompts (data.max_prompt_tokens) "
            "or lower rollout.max_new_tokens"
        )


def count_samples_on(progress: tqdm | None, num_samples: int) -> tqdm:
    """The caller's bar with this rollout's samples added to its total (a step's rollouts, however many
    rounds dynamic sampling takes, fill one bar), or a bar that draws nothing."""
    if progress is None:
        return tqdm(disable=True)
    progress.total = (progress.total or 0) + num_samples
    progress.refresh()
    return progress


@dataclass
class RowState:
    """The rows' per-step state on the device, [rows] each."""

    sample: torch.Tensor
    """The sample each row decodes; the scratch row (the number of samples) when none."""
    keys: torch.Tensor
    """Its sample's random stream."""
    drawn: torch.Tensor
    """Tokens its sample holds so far (the next one's place in the response)."""
    live: torch.Tensor
    """bool: it decodes (not ended, not waiting for an environment)."""
    limit: torch.Tensor
    """Its sample's length limit."""
    confident: torch.Tensor
    """Its current run of tokens above rollout.early_truncation_prob."""


@dataclass
class SampleRecord:
    """What a rollout writes per sample, [samples + 1, ...] each (the last row is scratch: idle rows write there)."""

    responses: torch.Tensor
    """[n + 1, max_new_tokens] the response tokens."""
    logprobs: torch.Tensor
    """[n + 1, max_new_tokens] their log-probs under the tempered distribution."""
    lengths: torch.Tensor
    """[n + 1] the response length, written when the sample ends."""
    truncated: torch.Tensor
    """[n + 1] bool: stopped by early truncation."""
    sampled: torch.Tensor | None
    """[n + 1, max_new_tokens] bool, multi-turn: the tokens the model sampled (not replies); None single-turn."""


def draw_tokens(logits: torch.Tensor, rows: RowState, record: SampleRecord, config: RolloutConfig,
                stop_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's next token from ``logits`` [rows, V], recorded for its sample while the row is live; a
    row whose sample ends (a stop id, its length limit, early truncation) writes the sample's length and
    truncation flag and stops being live. On the device only, on fixed shapes, ``record`` written in
    place. Returns (tokens, drawn, live, confident): the tokens and the rows' new state [rows]."""
    # The scratch row is the record's last, read from its shape: a graph's size, not a number it guards on.
    scratch = record.lengths.shape[0] - 1
    tokens, logprobs, probs = sample_tokens(logits, config, rows.keys, rows.drawn)
    live = rows.live
    target = torch.where(live, rows.sample, scratch)
    column = rows.drawn.clamp(max=config.max_new_tokens - 1)
    record.responses[target, column] = tokens
    record.logprobs[target, column] = logprobs.to(record.logprobs.dtype)
    if record.sampled is not None:
        record.sampled[target, column] = True
    stop = torch.isin(tokens, stop_ids) | (rows.drawn + 1 >= rows.limit)
    truncate = torch.zeros_like(stop)
    confident = rows.confident
    if config.early_truncation_tokens > 0:
        confident = torch.where(probs > config.early_truncation_prob, confident + 1, torch.zeros_like(confident))
        truncate = ~stop & (confident >= config.early_truncation_tokens)
    drawn = rows.drawn + live.long()
    ends = live & (stop | truncate)
    ended = torch.where(ends, rows.sample, scratch)
    record.lengths[ended] = drawn
    record.truncated[ended] = truncate
    return tokens, drawn, live & ~ends, confident


def _sampling_setting(config: RolloutConfig) -> tuple:
    """The fields of rollout.* that ``draw_tokens`` reads as constants of its graph."""
    return (config.temperature, config.top_p, config.top_k, config.early_truncation_tokens,
            config.early_truncation_prob, config.max_new_tokens)


@functools.cache
def compiled_draw(cuda: bool) -> Callable:
    """``draw_tokens`` through torch.compile (fullgraph), shared by every rollout of the process; on CUDA
    run as CUDA graphs (one per row count). Each sampling setting (a run's training rollouts, its greedy
    and its sampled evaluation) compiles a ``code_copy`` of its own: dynamo counts a function's graphs
    against torch._dynamo.config.recompile_limit (8), and a fullgraph function past it fails the rollout.
    A setting's rows, record and logits are dynamic from its first call (``_mark_draw_dynamic``), so it
    compiles at most two graphs, one row and more (dynamo specializes a size of 1)."""
    options = {"triton.cudagraphs": True} if cuda else None

    @functools.cache
    def for_setting(setting: tuple) -> Callable:
        return torch.compile(code_copy(draw_tokens), fullgraph=True, options=options)

    def draw(logits, rows: RowState, record: SampleRecord, config: RolloutConfig, stop_ids: torch.Tensor):
        return for_setting(_sampling_setting(config))(logits, rows, record, config, stop_ids)

    return draw


def _mark_draw_dynamic(logits: torch.Tensor, rows: RowState, record: SampleRecord) -> None:
    """For torch.compile: the rows and the samples change between steps and rollouts; marked dynamic
    before the first call, one graph serves them all, rather than a static graph, then a dynamic one."""
    tensors = [logits, *vars(rows).values(), *(t for t in vars(record).values() if t is not None)]
    for tensor in tensors:
        torch._dynamo.maybe_mark_dynamic(tensor, 0)


def _report_compiles(metrics_before: list) -> None:
    """After a compiled rollout, one line on the graphs torch.compile made during it (the compilation
    metrics not in ``metrics_before``, which it holds: their ids stay unique) with the latest reason, and
    one when a compiled function reached torch._dynamo.config.recompile_limit (its new shapes then run
    eagerly: the same numbers, slower): a recompile in every rollout, or an eager fall-back, is said
    once per rollout, not per step, and a rollout that compiles nothing says nothing."""
    seen = {id(m) for m in metrics_before}
    new = [m for m in torch._dynamo.utils.get_compilation_metrics() if id(m) not in seen]
    if not new:
        return
    limited = [m for m in new if m.fail_reason and "recompile limit" in m.fail_reason]
    compiled = [m for m in new if m.co_name and not m.fail_reason]
    names = sorted({m.co_name for m in compiled})
    reasons = [m.recompile_reason for m in compiled if m.recompile_reason]
    why = reasons[-1].splitlines()[0][:200] if reasons else "first calls"
    if compiled:
        logger.warning(
            "rollout.compile_decode: %d graph(s) of %s compiled during this rollout (latest reason: %s); later "
            "rollouts compile only for shapes or a sampling setting not seen yet",
            len(compiled), ", ".join(names), why)
    if limited:
        limit = torch._dynamo.config.recompile_limit
        logger.warning(
            "rollout.compile_decode: a decode function reached torch._dynamo.config.recompile_limit = %d (%s): "
            "its new shapes run eagerly from now on (the same samples, slower); raise the limit or set "
            "rollout.compile_decode=false", limit, (limited[-1].recompile_reason or "").splitlines()[0][:200])


class _SlotRollout:
    """One rollout over ``slots`` rows of the model's cache.

    The device decides each step: which rows still decode (``row_live_t``), what each draws, when a
    sample ends (its length and early-truncation flag are written on the device), so that a decode
    step reads nothing back to the host. The host looks every rollout.host_check_every steps, and at
    the step a row's sample reaches its length limit (the host counts the steps), with one copy of
    the rows' live flags and token counts: then finished rows are freed, refilled, or dropped. It
    keeps which sample each row decodes (-1: none), its token count as of the last look, and the
    first cache position of its sequence (to know which old positions are unused). A finished row
    idles (decodes a pad, records nothing) until the host looks; the samples do not depend on when.
    """

    def __init__(self, model, prompts, config: RolloutConfig, stop_ids, pad_id: int, keys: torch.Tensor,
                 limits: list[int], lockstep_group, conversations: Conversations | None = None) -> None:
        self.model, self.prompts, self.config, self.pad_id = model, prompts, config, pad_id
        self.keys, self.limits, self.group = keys, limits, lockstep_group
        self.conversations = conversations
        self.device = keys.device
        self.num_samples = len(prompts)
        self.slots = min(config.max_running or self.num_samples, self.num_samples)
        self.prompt_width = max(len(p) for p in prompts)
        self.capacity = slot_capacity(self.prompt_width + max(limits))
        _check_device_fits(model, self.slots, self.prompt_width + max(limits), self.device)
        self.stop_ids = torch.tensor(list(stop_ids), dtype=torch.long, device=self.device)
        self.stop_id_set = frozenset(stop_ids)
        # Row num_samples is scratch: idle rows write their draws there. The log-probs' precision is the
        # logits' (``run``).
        responses = torch.full((self.num_samples + 1, config.max_new_tokens), pad_id, dtype=torch.long,
                               device=self.device)
        self.record = SampleRecord(
            responses=responses, logprobs=torch.zeros(0, device=self.device),
            lengths=torch.zeros(self.num_samples + 1, dtype=torch.long, device=self.device),
            truncated=torch.zeros(self.num_samples + 1, dtype=torch.bool, device=self.device),
            sampled=None if conversations is None else torch.zeros_like(responses, dtype=torch.bool))
        hybrid = model.hybrid_config
        # Row num_samples is scratch here too; a sample's tokens sit at positions 0 .. prompt + response.
        self.routes = torch.zeros(
            (self.num_samples + 1, self.prompt_width + config.max_new_tokens, len(model.decoder.layers),
             hybrid.moe_router_topk), dtype=route_dtype(hybrid.num_experts), device=self.device)
        self.waiting = deque(range(self.num_samples))
        self.row_sample: list[int] = []
        self.row_drawn: list[int] = []
        self.row_steps: list[int] = []
        self.row_start: list[int] = []
        # Multi-turn: whether a row's sample waits for its environment, and where its current turn began.
        self.row_waiting: list[bool] = []
        self.row_turn_start: list[int] = []
        self.decode_steps = 0
        self.host_checks = 0

    def run(self, progress: tqdm | None, interrupt: Callable[[], None] | None) -> Samples:
        first = [self.waiting.popleft() for _ in range(self.slots)]
        logits, cache = self._prefill(first, self.prompt_width)
        # fp32 log-probs, fp64 for an fp64 model (the sampler's precision).
        self.record.logprobs = torch.zeros((self.num_samples + 1, self.config.max_new_tokens),
                                           dtype=torch.promote_types(logits.dtype, torch.float32), device=self.device)
        if self.config.compile_decode:
            # Written in place by the compiled draw, a CUDA graph on GPUs (megacispo.models: mark_static_addresses).
            for tensor in vars(self.record).values():
                if tensor is not None:
                    torch._dynamo.mark_static_address(tensor)
        cache.reserve(self.capacity - cache.length)
        self.row_sample, self.row_drawn, self.row_steps = first, [0] * len(first), [0] * len(first)
        self.row_waiting, self.row_turn_start = [False] * len(first), [0] * len(first)
        self.row_start = [cache.length - len(self.prompts[s]) for s in first]
        self._sync_rows()
        self.confident_run = torch.zeros(len(first), dtype=torch.long, device=self.device)
        progress = count_samples_on(progress, self.num_samples)
        self.rows_agree = self._rows_agree()
        while True:
            if interrupt is not None:
                interrupt()
            tokens = self._draw(logits)
            replies, extend_rounds = [], 0
            if self._host_looks():
                self._free_finished(progress)
                replies = self._take_replies(progress)
                refills = self._assign_waiting()
                live_rows = sum(s >= 0 for s in self.row_sample)
                any_refill, extend_rounds, any_busy, most_live = self._agree(
                    bool(refills), len(replies), bool(self.waiting or refills or replies), live_rows)
                if not most_live and not any_busy:
                    break
                if not any_busy:
                    cache, tokens = self._shrink(cache, tokens, most_live)
                if self.rows_changed:
                    self._sync_rows()
            else:
                refills, any_refill = [], False
            if cache.length + 2 > self.capacity:
                self._drop_unused(cache)
            step_tokens = torch.where(self.row_live_t, tokens, self.pad_id)
            if self.conversations is not None:
                cache.live_rows = self.row_live_t  # rows waiting for a reply keep their state
            cache.rows_agree = self.rows_agree
            logits, cache = self.model.decode_step(step_tokens, cache, compiled=self.config.compile_decode)
            self.decode_steps += 1
            self._record_step_routes()
            if any_refill:
                self._refill(refills, logits, cache)
            if extend_rounds:
                self._feed_replies(replies, extend_rounds, logits, cache)
        return self._samples()

    def _prefill(self, samples: list[int], width: int):
        """Left-padded prefill of the prompts of ``samples`` to ``width`` positions: (logits [k, V], cache)."""
        prompts = [self.prompts[s] for s in samples]
        input_ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in prompts], dtype=torch.long,
                                 device=self.device)
        lengths = torch.tensor([len(p) for p in prompts], device=self.device)
        attention_mask = torch.arange(width, device=self.device) >= width - lengths[:, None]
        logits, cache = self.model.prefill(input_ids, attention_mask)
        routes = self.model.last_routes(len(samples), width).to(self.routes.dtype)
        for row, (sample, prompt) in enumerate(zip(samples, prompts)):
            self.routes[sample, :len(prompt)] = routes[row, width - len(prompt):]
        return logits, cache

    def _record_step_routes(self) -> None:
        """The experts of the token each row just fed (the one it drew last, at position prompt + drawn
        - 1 of its sample); rows not decoding, or refilled and not yet drawing, write the scratch row.
        Right after the step: a compiled step's routes are outputs of its graph, freed on CUDA when the
        next compiled call (the draw) starts."""
        fed = self.row_live_t & (self.row_drawn_t > 0)
        rows = torch.where(fed, self.row_sample_t, self.num_samples)
        positions = (self.row_prompt_t + self.row_drawn_t - 1).clamp(0, self.routes.shape[1] - 1)
        self.routes[rows, positions] = self.model.last_routes(len(self.row_sample), 1)[:, 0].to(self.routes.dtype)

    def _sync_rows(self) -> None:
        """The per-row device tensors from the host's bookkeeping (after rows finished or were refilled)."""
        sample = [s if s >= 0 else self.num_samples for s in self.row_sample]
        self.row_sample_t = torch.tensor(sample, dtype=torch.long, device=self.device)
        self.row_live_t = torch.tensor([s >= 0 and not waiting for s, waiting in zip(self.row_sample, self.row_waiting)],
                                       dtype=torch.bool, device=self.device)
        self.row_drawn_t = torch.tensor(self.row_drawn, dtype=torch.long, device=self.device)
        self.row_limit_t = torch.tensor([self.limits[s] if s >= 0 else 1 for s in self.row_sample],
                                        dtype=torch.long, device=self.device)
        self.row_prompt_t = torch.tensor([len(self.prompts[s]) if s >= 0 else 0 for s in self.row_sample],
                                         dtype=torch.long, device=self.device)
        padded_keys = torch.cat([self.keys, self.keys.new_zeros(1)])
        self.row_keys_t = padded_keys[self.row_sample_t]
        self.rows_changed = False

    def _draw(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's next token from ``logits`` [rows, V] (``draw_tokens``, through torch.compile with
        rollout.compile_decode: on CUDA a CUDA graph of its own); the host counts the live rows' steps.
        Compiled, the draw's outputs are copied ([rows] each): the next compiled call (the decode step)
        starts a new cudagraph-tree generation, which frees them, and the rows' state is read after it."""
        draw = draw_tokens
        rows = RowState(self.row_sample_t, self.row_keys_t, self.row_drawn_t, self.row_live_t, self.row_limit_t,
                        self.confident_run)
        if self.config.compile_decode:
            draw = compiled_draw(self.device.type == "cuda")
            # A tensor of its own: the logits are views of bases of other shapes (the prefill's, an eager
            # step's, a compiled step's), and dynamo guards on a view's base, a graph for each.
            logits = logits.clone()
            _mark_draw_dynamic(logits, rows, self.record)
        drawn = draw(logits, rows, self.record, self.config, self.stop_ids)
        if self.config.compile_decode:
            drawn = tuple(output.clone() for output in drawn)
        tokens, self.row_drawn_t, self.row_live_t, self.confident_run = drawn
        self.row_steps = [steps + 1 if sample >= 0 and not waiting else steps
                          for steps, sample, waiting in zip(self.row_steps, self.row_sample, self.row_waiting)]
        return tokens

    def _host_looks(self) -> bool:
        """Whether the host reads the rows' state after this step's draw: every rollout.host_check_every
        decode steps, and, outside a lockstep group, as soon as a row has run as many steps as its
        sample's length limit (it has ended, then or before). The ranks of a lockstep group look at
        the same steps only, since they agree (a collective) when they look."""
        every = self.config.steps_between_looks(self.device.type == "cuda")
        at_limit = any(s >= 0 and not waiting and steps >= self.limits[s]
                       for s, steps, waiting in zip(self.row_sample, self.row_steps, self.row_waiting))
        return self.group is None and at_limit or (self.decode_steps + 1) % every == 0

    def _free_finished(self, progress: tqdm) -> None:
        """One copy of the rows' live flags and token counts to the host; frees the rows whose sample ended.
        Multi-turn, a turn that ended at a stop id goes to the sample's environment (one more copy: the
        ended turns' tokens), and its row waits for the reply; a sample at its length limit or truncated
        early is over."""
        self.host_checks += 1
        live, drawn = torch.stack([self.row_live_t.long(), self.row_drawn_t]).tolist()
        self.row_drawn = drawn
        ended = [row for row, sample in enumerate(self.row_sample)
                 if sample >= 0 and not live[row] and not self.row_waiting[row]]
        if self.conversations is None:
            for row in ended:
                self._free(row, progress)
            return
        if not ended:
            return
        samples = torch.tensor([self.row_sample[row] for row in ended], device=self.device)
        record = self.record
        turns = torch.cat([record.responses[samples], record.truncated[samples, None].long()], dim=1).tolist()
        for row, values in zip(ended, turns):
            sample, count = self.row_sample[row], drawn[row]
            turn = values[self.row_turn_start[row]:count]
            if values[-1] or count >= self.limits[sample] or turn[-1] not in self.stop_id_set:
                self.conversations.end(sample, turn)
                self._free(row, progress)
            else:
                self.conversations.submit(sample, turn)
                self.row_waiting[row] = True

    def _free(self, row: int, progress: tqdm) -> None:
        self.row_sample[row] = -1
        self.row_waiting[row] = False
        self.rows_changed = True
        progress.update(1)

    def _take_replies(self, progress: tqdm) -> list[tuple[int, int, list[int]]]:
        """Multi-turn: the environments' replies that came in: [(row, sample, ids to feed)], fed after the
        next decode step; a row whose conversation is over is freed. When no row decodes and nothing
        waits to be refilled (outside a lockstep group, whose ranks step together), waits for a reply
        instead of stepping idle rows."""
        if self.conversations is None:
            return []
        row_of = {sample: row for row, sample in enumerate(self.row_sample) if sample >= 0}
        answered = self.conversations.replies()
        while not answered and self.group is None and self.conversations.pending and not self.waiting \
                and not any(s >= 0 and not w for s, w in zip(self.row_sample, self.row_waiting)):
            answered = self.conversations.wait_any()
        replies = []
        for sample, ids in answered:
            row = row_of[sample]
            # The reply and at least one more sampled token must fit the sample's length limit.
            if ids is not None and self.row_drawn[row] + len(ids) + 1 > self.limits[sample]:
                self.conversations.shorten(sample, len(ids))
                ids = None
            if ids is None:
                self._free(row, progress)
            else:
                replies.append((row, sample, ids))
        return replies

    def _feed_replies(self, replies: list[tuple[int, int, list[int]]], rounds: int, logits: torch.Tensor,
                      cache) -> None:
        """Prefill each reply into its row's cache after the turn's last sampled token (not yet fed), from
        the row's held state, and let the row decode its next turn from the reply's last logits; a rank of
        a lockstep group runs a one-token dummy prefill for each of the group's ``rounds`` it has no reply for."""
        for row, sample, ids in replies:
            drawn = self.row_drawn[row]
            span = cache.length - self.row_start[row]
            fed = torch.tensor([0, *ids], dtype=torch.long, device=self.device)
            fed[0] = self.record.responses[sample, drawn - 1]  # the turn's last token, drawn but not fed yet
            # The row's sequence grows by len(fed) positions at the newest end: room for it at the front.
            room = len(fed) - self.row_start[row]
            if room > 0:
                cache.pad_front(room)
                self.row_start = [start + room for start in self.row_start]
            index = torch.tensor([row], dtype=torch.long, device=self.device)
            logits[index] = self.model.extend(cache, index, fed).to(logits.dtype)
            prompt = len(self.prompts[sample])
            routes = self.model.last_routes(1, len(fed)).to(self.routes.dtype)[0]
            self.routes[sample, prompt + drawn - 1:prompt + drawn - 1 + len(fed)] = routes
            self.record.responses[sample, drawn:drawn + len(ids)] = fed[1:]
            self.row_live_t[index] = True
            self.row_drawn_t[index] = drawn + len(ids)
            self.confident_run[index] = 0
            self.row_drawn[row] += len(ids)
            self.row_steps[row] += len(ids)
            self.row_turn_start[row] = self.row_drawn[row]
            self.row_waiting[row] = False
            self.row_start[row] = cache.length - span - len(fed)
        for _ in range(rounds - len(replies)):
            self.model.prefill(torch.full((1, 1), self.pad_id, dtype=torch.long, device=self.device))

    def _assign_waiting(self) -> list[tuple[int, int]]:
        """Give free rows the next waiting samples: [(row, sample)], refilled after the next decode step."""
        refills = []
        for row, sample in enumerate(self.row_sample):
            if sample < 0 and self.waiting:
                refills.append((row, self.waiting.popleft()))
        for row, sample in refills:
            self.row_sample[row], self.row_drawn[row], self.row_steps[row] = sample, 0, 0
            self.row_waiting[row], self.row_turn_start[row] = False, 0
            self.rows_changed = True
        return refills

    def _agree(self, refill: bool, replies: int, busy: bool, live_rows: int) -> tuple[bool, int, bool, int]:
        """(whether any rank of the lockstep group refills now, the most replies any feeds now, whether any
        has samples waiting for a row, a refill or a reply, the most rows any still decodes or holds for
        an environment): one all-reduce. The ranks shrink together (``_shrink``), so rows that agree stay so."""
        if self.group is None:
            return refill, replies, busy, live_rows
        flags = torch.tensor([int(refill), replies, int(busy), live_rows], device=self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        any_refill, most_replies, any_busy, most_live = flags.tolist()
        return bool(any_refill), most_replies, bool(any_busy), most_live

    def _rows_agree(self) -> bool:
        """Whether every rank of the lockstep group starts with as many rows (slots) as this one: one
        all-reduce. They then decode as many rows step for step (``InferenceCache.rows_agree``: the MoE
        layers under EP gather the group's tokens rather than run Megatron's all-to-all)."""
        if self.group is None:
            return False
        slots = torch.tensor([self.slots, -self.slots], device=self.device)
        dist.all_reduce(slots, op=dist.ReduceOp.MAX, group=self.group)
        most, fewest = slots.tolist()
        return most == -fewest

    def _refill(self, refills: list[tuple[int, int]], logits: torch.Tensor, cache) -> None:
        """Prefill the refilled rows' prompts alone and write them into their rows of ``cache`` and of
        ``logits`` (in place); a rank of a lockstep group with nothing to refill runs a one-token dummy
        prefill, so that every rank runs the same forward passes."""
        if not refills:
            self.model.prefill(torch.full((1, 1), self.pad_id, dtype=torch.long, device=self.device))
            return
        rows = [row for row, _ in refills]
        new_logits, new_cache = self._prefill([s for _, s in refills], max(len(self.prompts[s]) for _, s in refills))
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        cache.write_rows(index, new_cache)
        logits[index] = new_logits.to(logits.dtype)
        self.confident_run[index] = 0
        for row, sample in refills:
            self.row_start[row] = cache.length - len(self.prompts[sample])

    def _shrink(self, cache, tokens: torch.Tensor, most_live: int):
        """Once nothing waits (on any rank of a lockstep group), drop idle rows when at most half the rows
        still decode, keeping ``most_live`` (the most live rows of any rank of the group; at least one row
        stays: a rank of a lockstep group keeps stepping): the tail of long responses runs at its own
        batch size, every rank of the group at the same one. A compiled step keeps a power of two of rows
        (idle ones added): a captured graph then serves every shrink to its bucket. Returns (cache, tokens)
        of the rows kept."""
        live = [row for row, sample in enumerate(self.row_sample) if sample >= 0]
        rows = max(most_live, 1)
        if self.config.compile_decode:
            rows = 1 << (rows - 1).bit_length()
        if rows > len(self.row_sample) // 2 or len(self.row_sample) == 1:
            return cache, tokens
        idle = [row for row, sample in enumerate(self.row_sample) if sample < 0]
        live = sorted(live + idle[:rows - len(live)])
        index = torch.tensor(live, dtype=torch.long, device=self.device)
        self.row_sample = [self.row_sample[row] for row in live]
        self.row_drawn = [self.row_drawn[row] for row in live]
        self.row_steps = [self.row_steps[row] for row in live]
        self.row_start = [self.row_start[row] for row in live]
        self.row_waiting = [self.row_waiting[row] for row in live]
        self.row_turn_start = [self.row_turn_start[row] for row in live]
        self.confident_run = self.confident_run[index]
        self.rows_changed = True
        return cache.select(index), tokens[index]

    def _drop_unused(self, cache) -> None:
        """Drop the oldest positions that no running sequence (nor a prompt yet to come) needs."""
        live_starts = [start for start, sample in zip(self.row_start, self.row_sample) if sample >= 0]
        oldest = min(live_starts, default=cache.length)
        drop = min(oldest, cache.length - self.prompt_width)
        cache.drop_oldest(drop)
        self.row_start = [max(0, start - drop) for start in self.row_start]

    def _samples(self) -> Samples:
        record, n = self.record, self.num_samples
        lengths = record.lengths[:n]
        sampled = None if record.sampled is None else record.sampled[:n]
        return _assemble(self.prompts, record.responses[:n], record.logprobs[:n], lengths.tolist(), lengths,
                         record.truncated[:n], self.pad_id,
                         self.routes[: self.num_samples], sampled)


def _assemble(prompts, responses, response_logprobs, lengths: list[int], response_lengths, truncated,
              pad_id, routes: torch.Tensor, sampled: torch.Tensor | None = None) -> Samples:
    """The samples, right-padded; ``sampled`` [n, max_new_tokens] bool marks the response tokens the
    loss covers (multi-turn: not the environments' replies); None: all of them."""
    device = responses.device
    width = max(len(prompt) + r for prompt, r in zip(prompts, lengths))
    tokens = torch.full((len(prompts), width), pad_id, dtype=torch.long, device=device)
    rollout_logprobs = torch.zeros((len(prompts), width - 1), dtype=response_logprobs.dtype, device=device)
    loss_mask = torch.zeros((len(prompts), width - 1), device=device)
    for row, (prompt, r) in enumerate(zip(prompts, lengths)):
        p = len(prompt)
        tokens[row, :p] = torch.tensor(prompt, device=device)
        tokens[row, p:p + r] = responses[row, :r]
        # Response token p + i is predicted at position p + i - 1.
        rollout_logprobs[row, p - 1:p - 1 + r] = response_logprobs[row, :r]
        loss_mask[row, p - 1:p - 1 + r] = 1.0 if sampled is None else sampled[row, :r].to(loss_mask.dtype)
    prompt_lengths = torch.tensor([len(p) for p in prompts], device=device)
    return Samples(tokens, prompt_lengths, response_lengths, rollout_logprobs, loss_mask, truncated,
                   routes[:, :width].contiguous())


def response_token_ids(samples: Samples, row: int) -> list[int]:
    start = int(samples.prompt_lengths[row])
    return samples.tokens[row, start:start + int(samples.response_lengths[row])].tolist()
