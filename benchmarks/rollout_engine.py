"""Rollout engines on long-tailed response lengths: today's lockstep engine, the slot engine at a few
``rollout.max_running`` N, and transformers' generate, on the same weights of the ``small`` model.

The samples: random prompts of 16-128 tokens, and response lengths drawn from a long-tailed
distribution, forced by a per-sample length stop (``generate``'s ``response_limits``; no stop ids),
so that the random model's lengths are controlled: a few samples of --long tokens (1,024), the others
geometric with mean 20, under 64. Sampling at temperature 1.

- lockstep: the engine megacispo had before the slot engine (this file keeps it as the baseline):
  every sample prefilled at once, then decode steps for all of them until the longest finishes
  (finished rows keep decoding a pad), its KV cache growing to the longest length for every sample;
- slots N: ``megacispo.rollout.generate.generate`` with rollout.max_running = N (0: every sample in a slot);
- HF: ``MiniMaxForCausalLM.generate(do_sample=True)`` on the whole batch, left-padded, with a
  stopping criterion that ends each row at its length (HF decodes in lockstep too).

Each measurement runs in a fresh process (a world of one, gloo, fp32, one torch thread by default:
on a shared machine more threads measure the other jobs more than the engine) that builds the HF
model from a fixed seed and loads its weights into ours (rotary_dim = head_dim, as in
benchmarks/rl_vs_hf.py): the sides hold the same weights. Tokens/s = generated tokens / seconds of
the whole call (prefills included), of this process's CPU time (the ratio column) and of wall
clock. Peak memory: the process's resident memory, sampled every millisecond during the call,
above what it was just before (glibc's mmap threshold is pinned at 64 KiB so that freed buffers
leave the resident set at once and every engine's allocations show). Each engine runs the workload
twice and the second call is reported: the first call's peak also holds what the CPU layer
(parallel/cpu, oneDNN) caches for each new matmul shape, which grows with the number of distinct
prefill shapes (a CPU artifact; the column "first call peak" shows it).

    .venv/bin/python benchmarks/rollout_engine.py [--samples 64] [--long 1024] [--slots 8 16 32 0]
        [--flat-samples 32 128] [--flat-slots 16]

Multi-turn (``--multi-turn``, issue #38): the slot engine with ``conversations`` on the same ``small``
model (rotary_dim = head_dim as above; our own initialization from seed 0, no HF side), where every
sample talks for --turns model turns to ``SleepyToolEnv``, whose step() sleeps --env-sleep-ms and
replies with a fixed tool message of TOOL_REPLY's few tokens (done at the last turn). A turn ends at
a stop id: the random model's next-token distribution is close to uniform over its vocabulary, so
MULTI_TURN_STOP_FRACTION of the ids are stop ids (the first ones after PAD / BOS / EOS) and a turn's
length is about geometric with mean 1 / that fraction (20 tokens; the script prints the measured
mean). A per-turn length stop would control the lengths exactly, but ``generate`` caps only a
sample's whole response (rollout.max_new_tokens = MULTI_TURN_TOKENS_PER_TURN x --turns, which ends a
rare long conversation early). Random prompts of 16-128 tokens, temperature 1. Two modes, each in a
fresh process after a warm-up rollout without sleeps (the CPU layer's per-shape plans):

- concurrent: ``megacispo.envs.turns.EnvWorkers`` (env.workers threads): a sleeping call holds its
  own sample's slot while the other slots decode;
- synchronous: ``SynchronousWorkers``, the same interface running each call at once in the calling
  thread: the decode loop stops for every call, as an engine without a pool of workers would.

Tokens/s = sampled tokens (the loss mask's, not the fed replies) / wall seconds of conversations.prompts
and generate together, the median of --repeats rollouts; "sleep hidden" = (synchronous - concurrent
wall seconds) / the environment's total sleep (env calls x --env-sleep-ms): 100% when every sleep
overlaps decoding. The script asserts that both modes produce the same samples (tokens and loss
mask): sampling depends on each sample's key, not on when replies arrive.

    .venv/bin/python benchmarks/rollout_engine.py --multi-turn [--env-sleep-ms 50] [--turns 3]
        [--samples 32] [--slots 16] [--repeats 3]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import threading
import time

import torch

from megacispo.testing.harness import run_distributed

LONG_SAMPLES = 4
SHORT_MEAN = 20
SHORT_MAX = 63
PAD = 0


def workload(num_samples: int, long_tokens: int, vocab_size: int) -> tuple[list[list[int]], list[int]]:
    """(prompts, response lengths): LONG_SAMPLES of ``long_tokens`` at random places, the others
    geometric with mean SHORT_MEAN, at most SHORT_MAX; prompts of 16-128 random tokens."""
    generator = torch.Generator().manual_seed(1)
    prompt_lengths = torch.randint(16, 129, (num_samples,), generator=generator).tolist()
    prompts = [torch.randint(3, vocab_size, (length,), generator=generator).tolist() for length in prompt_lengths]
    short = torch.empty(num_samples).geometric_(1 / SHORT_MEAN, generator=generator).clamp(max=SHORT_MAX)
    lengths = short.long().tolist()
    for index in torch.randperm(num_samples, generator=generator)[:LONG_SAMPLES].tolist():
        lengths[index] = long_tokens
    return prompts, lengths


class PeakResident:
    """The peak of this process's resident memory above its value at the start, sampled every ms."""

    def __init__(self) -> None:
        self._page = os.sysconf("SC_PAGE_SIZE")
        self.start = self._resident()
        self.peak = self.start
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _resident(self) -> int:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * self._page

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._resident())
            time.sleep(0.001)

    def __enter__(self) -> PeakResident:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._resident())

    @property
    def above_start_mib(self) -> float:
        return (self.peak - self.start) / 2**20


@torch.no_grad()
def lockstep_generate(model, prompts: list[list[int]], limits: list[int], config) -> int:
    """The engine before slots (the baseline): a left-padded prefill of every prompt, then decode
    steps for all rows until the longest response is done. Returns the tokens generated."""
    from megacispo.rollout.generate import sample_keys, sample_tokens

    model.eval()
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts], dtype=torch.long, device="cpu")
    lengths = torch.tensor([len(p) for p in prompts], device="cpu")
    attention_mask = torch.arange(width, device="cpu") >= width - lengths[:, None]
    keys = sample_keys((0,), range(len(prompts)), 1, device="cpu")
    limit = torch.tensor(limits, device="cpu")
    logits, cache = model.prefill(input_ids, attention_mask)
    finished = torch.zeros(len(prompts), dtype=torch.bool, device="cpu")
    for step in range(max(limits)):
        positions = torch.full((len(prompts),), step, dtype=torch.long, device="cpu")
        tokens, _, _ = sample_tokens(logits, config, keys, positions)
        finished |= positions + 1 >= limit
        if bool(finished.all()):
            break
        # Finished rows keep decoding a pad (cheaper than reshaping the cache); their output is ignored.
        logits, cache = model.decode_step(torch.where(finished, PAD, tokens), cache)
    return sum(limits)


def slot_generate(model, prompts: list[list[int]], limits: list[int], config) -> int:
    from megacispo.rollout.generate import generate, sample_keys

    samples = generate(model, prompts, config, stop_ids=[], pad_id=PAD,
                       keys=sample_keys((0,), range(len(prompts)), 1, device="cpu"), response_limits=limits)
    return int(samples.response_lengths.sum())


def hf_generate(hf_model, prompts: list[list[int]], limits: list[int]) -> int:
    from transformers import StoppingCriteria, StoppingCriteriaList

    from megacispo.parallel import cpu

    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts], dtype=torch.long, device="cpu")
    attention_mask = (input_ids != PAD).long()
    limit = torch.tensor(limits, device="cpu")

    class EachAtItsLength(StoppingCriteria):
        def __call__(self, ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
            return torch.full_like(limit, ids.shape[1] - width) >= limit

    cpu.disable_products()  # HF as its users run it: torch's own CPU products
    try:
        output = hf_model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=max(limits),
                                   do_sample=True, top_k=0, pad_token_id=PAD, eos_token_id=None,
                                   stopping_criteria=StoppingCriteriaList([EachAtItsLength()]))
    finally:
        cpu.enable_kernels()
    if output.shape[1] - width != max(limits):
        raise RuntimeError(f"HF generated {output.shape[1] - width} tokens, not the longest length {max(limits)}")
    return sum(limits)


def measure(engine: str, slots: int, num_samples: int, long_tokens: int, threads: int) -> dict:
    """One engine's run in this (fresh) process: generated tokens, wall and CPU seconds, peak MiB above
    the start."""
    from transformers import MiniMaxConfig, MiniMaxForCausalLM

    from megacispo.models import hf_names
    from megacispo.models.config import model_config, transformer_config
    from megacispo.models.model import HybridModel
    from megacispo.parallel.layout import ParallelConfig, init_distributed
    from megacispo.rollout.config import RolloutConfig
    from megacispo.testing import hf_models

    torch.set_num_threads(threads)
    small = model_config("small")
    config = small.replace(rotary_dim=small.head_dim)
    init_distributed(ParallelConfig(), seed=0)
    torch.manual_seed(0)
    hf_model = MiniMaxForCausalLM(MiniMaxConfig(**hf_names.config_to_hf(config))).eval()
    prompts, limits = workload(num_samples, long_tokens, config.vocab_size)
    rollout = RolloutConfig(max_new_tokens=long_tokens, temperature=1.0, max_running=slots)
    if engine == "HF":
        run = lambda: hf_generate(hf_model, prompts, limits)  # noqa: E731
    else:
        model = HybridModel(config, transformer_config(config, ParallelConfig()))
        tensors = {name: tensor.detach() for name, tensor in hf_model.state_dict().items()}
        model.load_state_dict(hf_models.full_to_single_process(hf_models.hf_to_full(tensors, config)), strict=False)
        del hf_model, tensors
        step = lockstep_generate if engine == "lockstep" else slot_generate
        run = lambda: step(model, prompts, limits, rollout)  # noqa: E731
    with PeakResident() as first_call:
        run()
    with PeakResident() as memory:
        start, cpu_start = time.perf_counter(), time.process_time()
        tokens = run()
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    return {"tokens": tokens, "seconds": seconds, "cpu_seconds": cpu_seconds, "peak_mib": memory.above_start_mib,
            "first_peak_mib": first_call.above_start_mib}


# ------------------------------------------------------------------------------------------------
# Multi-turn: an environment that sleeps per call, its calls on threads or in the decode loop

MULTI_TURN_STOP_FRACTION = 1 / 20
MULTI_TURN_TOKENS_PER_TURN = 96
TOOL_REPLY = "tool: ok"
REPLY_BASE = 1000
"""Reply ids are REPLY_BASE + a character's code: past the stop ids, so a reply reads as text, not as turn ends."""


class ToolTokenizer:
    """What ``ReplyRenderer`` (no chat template) and ``Conversations`` need of a tokenizer: the stop ids,
    and text <-> ids one character each for the tool replies."""

    bos_id, eos_id, pad_id = 1, 2, PAD

    def __init__(self, vocab_size: int):
        first = self.eos_id + 1
        self.stop_ids = (self.eos_id, *range(first, first + round(vocab_size * MULTI_TURN_STOP_FRACTION)))
        if REPLY_BASE < self.stop_ids[-1] + 1 or REPLY_BASE + 128 > vocab_size:
            raise ValueError(f"vocab_size = {vocab_size}: the stop ids end at {self.stop_ids[-1]}, and the reply ids "
                             f"({REPLY_BASE}-{REPLY_BASE + 127}) must lie past them and inside the vocabulary")

    def encode(self, text: str) -> list[int]:
        return [REPLY_BASE + ord(c) % 128 for c in text]

    def decode(self, ids) -> str:
        return "".join(chr(i) for i in ids)


class SleepyToolEnv:
    """An environment whose step() sleeps ``sleep_ms`` (a tool's latency) and answers TOOL_REPLY as a tool
    message; the conversation is over at model turn ``turns``."""

    def __init__(self, sleep_ms: float, turns: int):
        self.sleep_s, self.turns, self.turn = sleep_ms / 1000, turns, 0

    def reset(self, record) -> None:
        return None

    def step(self, assistant_message: str):
        from megacispo.envs.base import EnvStep

        self.turn += 1
        time.sleep(self.sleep_s)
        if self.turn >= self.turns:
            return EnvStep(reward=1.0, done=True, metrics={"calls": 1})
        return EnvStep(messages=[{"role": "tool", "content": TOOL_REPLY}], metrics={"calls": 1})


class SynchronousWorkers:
    """``EnvWorkers``' interface with no threads: submit() runs the call at once in the calling thread (the
    decode loop), so every environment call stops decoding for as long as it takes."""

    def __init__(self) -> None:
        self._ready: list[tuple[object, object, str | None, float]] = []

    def submit(self, tag, fn) -> None:
        started = time.monotonic()
        try:
            result, error = fn(), None
        except Exception as raised:  # as EnvWorkers: an environment's error is its sample's failure
            result, error = None, f"raised {type(raised).__name__}: {raised}"
        self._ready.append((tag, result, error, time.monotonic() - started))

    def results(self, timeout_s: float = 0.0) -> list[tuple[object, object, str | None, float]]:
        """Every call's result since the last look (all are ready: ``timeout_s`` never waits)."""
        ready, self._ready = self._ready, []
        return ready

    def close(self) -> None:
        """Nothing runs beside the caller."""


def multi_turn_rollout(model, prompts: list[list[int]], tokenizer: ToolTokenizer, mode: str, sleep_ms: float,
                       turns: int, slots: int) -> dict:
    """One multi-turn rollout of ``prompts`` with the environment's calls run as ``mode`` says: its samples
    (tokens, loss mask), env sums, decode steps, wall and CPU seconds of conversations.prompts and generate
    together."""
    from megacispo.data.chat import ReplyRenderer
    from megacispo.data.prompts import PromptRecord
    from megacispo.envs.config import EnvConfig
    from megacispo.envs.turns import Conversations, EnvWorkers, sum_metrics
    from megacispo.rollout.config import RolloutConfig
    from megacispo.rollout.generate import generate, sample_keys

    env = EnvConfig(name="sleepy", params={"sleep_ms": sleep_ms, "turns": turns}, max_turns=turns, timeout_s=30.0)
    workers = EnvWorkers(env.workers) if mode == "concurrent" else SynchronousWorkers()
    records = [PromptRecord(prompt="", answer=str(index)) for index in range(len(prompts))]
    config = RolloutConfig(max_new_tokens=MULTI_TURN_TOKENS_PER_TURN * turns, temperature=1.0, max_running=slots)
    steps = model.decode_steps = 0
    try:
        start, cpu_start = time.perf_counter(), time.process_time()
        conversations = Conversations(env, SleepyToolEnv, ReplyRenderer(tokenizer, chat_template=False), records,
                                      workers, max_prompt_tokens=model.hybrid_config.max_position_embeddings)
        first = conversations.prompts(lambda record: prompts[int(record.answer)])
        samples = generate(model, first, config, stop_ids=tokenizer.stop_ids, pad_id=PAD,
                           keys=sample_keys((0,), range(len(prompts)), 1, device="cpu"),
                           conversations=conversations)
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
        steps = model.decode_steps
    finally:
        workers.close()
    failures = [failure for failure in conversations.failures() if failure]
    if failures:
        raise RuntimeError(f"{len(failures)} samples failed their environment, the first: {failures[0]}")
    sums = sum_metrics(conversations.sample_metrics())
    return {"tokens": samples.tokens, "loss_mask": samples.loss_mask, "generated": int(samples.loss_mask.sum()),
            "fed": int(sums["env/fed_tokens"]), "env_calls": int(sums["env/calls"]), "turns": int(sums["env/turns"]),
            "decode_steps": steps, "seconds": seconds, "cpu_seconds": cpu_seconds}


def measure_multi_turn(mode: str, slots: int, num_samples: int, sleep_ms: float, turns: int, threads: int,
                       repeats: int) -> dict:
    """One mode's multi-turn rollout in this (fresh) process, after a warm-up rollout without sleeps: the
    run of median wall time of ``repeats`` (the machine is shared), each checked to give the same samples."""
    from megacispo.models.config import model_config, transformer_config
    from megacispo.models.model import HybridModel
    from megacispo.parallel.layout import ParallelConfig, init_distributed

    torch.set_num_threads(threads)
    small = model_config("small")
    config = small.replace(rotary_dim=small.head_dim)
    init_distributed(ParallelConfig(), seed=0)
    torch.manual_seed(0)
    model = HybridModel(config, transformer_config(config, ParallelConfig()))
    decode_step = model.decode_step

    def counted_decode_step(*args, **kwargs):
        model.decode_steps += 1
        return decode_step(*args, **kwargs)

    model.decode_step = counted_decode_step  # the engine's decode steps, idle rows' steps included
    tokenizer = ToolTokenizer(config.vocab_size)
    prompts, _ = workload(num_samples, 1, config.vocab_size)
    multi_turn_rollout(model, prompts, tokenizer, mode, 0.0, turns, slots)
    runs = [multi_turn_rollout(model, prompts, tokenizer, mode, sleep_ms, turns, slots) for _ in range(repeats)]
    for run in runs[1:]:
        if not (torch.equal(run["tokens"], runs[0]["tokens"]) and torch.equal(run["loss_mask"], runs[0]["loss_mask"])):
            raise AssertionError(f"{mode}, slots {slots}: a repeated rollout's samples differ from the first's")
    return sorted(runs, key=lambda run: run["seconds"])[len(runs) // 2]


def multi_turn_main(args: argparse.Namespace) -> None:
    print(f"{describe_machine()}, {args.threads} threads, load average {os.getloadavg()[0]:.1f}")
    print(f"{args.samples} samples, {args.turns} turns, env.step sleeps {args.env_sleep_ms:g} ms, "
          f"stop ids {MULTI_TURN_STOP_FRACTION:.3f} of the vocabulary, median of {args.repeats} runs\n")
    print("| mode | samples | slots | env calls | model turns | generated tokens | tokens / turn | fed tokens "
          "| decode steps | CPU s | wall s | tokens / wall s | vs synchronous | sleep hidden |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for slots in args.slots:
        results = {}
        for mode in ("synchronous", "concurrent"):
            (result,) = run_distributed(measure_multi_turn, 1, mode, slots, args.samples, args.env_sleep_ms,
                                        args.turns, args.threads, args.repeats, timeout_s=900.0)
            results[mode] = result
            rate = result["generated"] / result["seconds"]
            sync = results["synchronous"]
            # The share of the environment's total sleep that the concurrent mode no longer waits for.
            slept = result["env_calls"] * args.env_sleep_ms / 1000
            saved = sync["seconds"] - result["seconds"]
            hidden = "-" if mode == "synchronous" or not slept else f"{saved / slept:.0%}"
            label = "all" if slots == 0 else str(slots)
            print(f"| {mode} | {args.samples} | {label} | {result['env_calls']} | {result['turns']} | "
                  f"{result['generated']} | {result['generated'] / result['turns']:.1f} | {result['fed']} | "
                  f"{result['decode_steps']} | {result['cpu_seconds']:.1f} | {result['seconds']:.1f} | {rate:.0f} | "
                  f"{rate / (sync['generated'] / sync['seconds']):.2f}x | {hidden} |", flush=True)
        sync, concurrent = results["synchronous"], results["concurrent"]
        if not (torch.equal(sync["tokens"], concurrent["tokens"]) and torch.equal(sync["loss_mask"],
                                                                                  concurrent["loss_mask"])):
            raise AssertionError(f"slots {slots}: the concurrent rollout's samples differ from the synchronous one's; "
                                 "sampling must not depend on when the environment answers")
    print(f"\nsamples identical in both modes; load average at the end {os.getloadavg()[0]:.1f}")


def describe_machine() -> str:
    model = "unknown CPU"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as cpuinfo:
        model = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), model)
    return f"{model}, {os.cpu_count()} cores, torch {torch.__version__}"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, help="samples of the main comparison (default 64; multi-turn 32)")
    parser.add_argument("--long", type=int, default=1024, help="tokens of the few long responses")
    parser.add_argument("--slots", type=int, nargs="+",
                        help="max_running values, 0: all (default 8 16 32 0; multi-turn 16)")
    parser.add_argument("--flat-samples", type=int, nargs="*", default=[32, 128],
                        help="more sample counts for the slot engine at --flat-slots (peak vs samples)")
    parser.add_argument("--flat-slots", type=int, default=16)
    parser.add_argument("--skip-hf", action="store_true", help="leave transformers' generate out")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--multi-turn", action="store_true",
                        help="only the multi-turn rows: the environment's calls on threads vs in the decode loop")
    parser.add_argument("--env-sleep-ms", type=float, default=50.0, help="multi-turn: each env.step call's sleep")
    parser.add_argument("--turns", type=int, default=3, help="multi-turn: model turns per sample")
    parser.add_argument("--repeats", type=int, default=3, help="multi-turn: timed rollouts per mode (median reported)")
    args = parser.parse_args()
    if args.samples is None:
        args.samples = 32 if args.multi_turn else 64
    if args.slots is None:
        args.slots = [16] if args.multi_turn else [8, 16, 32, 0]
    return args


def main() -> None:
    args = parse_args()
    if args.multi_turn:
        multi_turn_main(args)
        return
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(64 * 1024)  # inherited by each measurement's process
    _, limits = workload(args.samples, args.long, 16384)
    print(f"{describe_machine()}, {args.threads} threads, load average {os.getloadavg()[0]:.1f}")
    print(f"{args.samples} samples: {sum(limits)} tokens, longest {max(limits)}, "
          f"{sum(length < 64 for length in limits)} under 64\n")
    runs = [("lockstep", 0, args.samples), *(("slots", n, args.samples) for n in args.slots)]
    runs += [("slots", args.flat_slots, count) for count in args.flat_samples]
    if not args.skip_hf:
        runs.append(("HF", 0, args.samples))
    print("| engine | N | samples | tokens | CPU s | tokens / CPU s | vs lockstep | wall s | tokens / wall s "
          "| peak MiB | first call peak MiB |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    baseline = None
    for engine, slots, count in runs:
        (result,) = run_distributed(measure, 1, engine, slots, count, args.long, args.threads, timeout_s=3600.0)
        rate = result["tokens"] / result["cpu_seconds"]
        baseline = baseline or rate
        label = "all" if engine == "slots" and slots == 0 else (str(slots) if engine == "slots" else "-")
        print(f"| {engine} | {label} | {count} | {result['tokens']} | {result['cpu_seconds']:.1f} | {rate:.0f} | "
              f"{rate / baseline:.2f}x | {result['seconds']:.1f} | {result['tokens'] / result['seconds']:.0f} | "
              f"{result['peak_mib']:.0f} | {result['first_peak_mib']:.0f} |", flush=True)
    print(f"\nload average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
