"""One RL update and greedy generation of the ``small`` model: megacispo vs Hugging Face transformers.

One process, a world of one (gloo), fp32, torch threads = all cores. Both sides hold the same
weights: transformers' MiniMaxForCausalLM is built from ``hf_names.config_to_hf`` and randomly
initialized, and its tensors are loaded into our model through ``hf_names`` (our rotary_dim is set
to head_dim, because HF rotates whole heads: the two models then compute the same function). With
``--family minimax-m2`` both sides are the ``small`` shape as MiniMax-M2 (every layer softmax
attention with QK-norm and partial RoPE, the sigmoid router with its selection bias):
transformers' MiniMaxM2ForCausalLM, which honours partial RoPE.

Training, one RL update on the same batch (random tokens, a prompt of a quarter of the sequence,
loss on the rest, one advantage per sequence, old log-probs near the current ones):

- ours: ``megacispo.training.engine.Engine`` (Megatron DDP, distributed optimizer AdamW with gradient
  clipping 1.0) running the forward step of ``Trainer._update_once``: the final hidden states into
  ``Engine.token_logprobs`` (the fused, tiled fp32 LM head on the response positions only, with
  the entropy metric), ``compute_policy_loss("cispo")``, Megatron's MoE load-balancing loss,
  backward through Megatron's schedule, then ``Engine.step()`` (torch's fused AdamW on CPU);
- HF: ``model(input_ids, output_router_logits=True)``, log_softmax over the logits, the same CISPO
  token loss (detached clipped IS weight times advantage times log-prob, divided by the number of
  response tokens) plus ``router_aux_loss_coef`` times HF's load-balancing loss, backward,
  ``clip_grad_norm_(1.0)`` and ``torch.optim.AdamW`` with the same hyper-parameters.

HF runs its defaults on this CPU: sdpa attention in the softmax layers, grouped_mm experts (one
grouped matmul per projection for all experts), and its own lightning attention in the others: a
Python loop over blocks of block_size (intra-block masked QK^T V plus the inter-block state) for
prompts and training, one recurrent state update per token when decoding with a cache.

Generation, greedy, at batch 1 (latency) and batch 8 (a group of samples of one RL prompt; distinct
random prompts of one length, so neither side pads): ``megacispo.rollout.generate.generate`` (prefill, then
one ``decode_step`` per token: the lean single-process step, sampling bookkeeping included), run
eagerly and compiled (``rollout.compile_decode``: torch.compile of the step, compiled in a warm-up
generation of a few tokens whose time is printed), vs
``model.generate(do_sample=False, min_new_tokens=max_new_tokens=N)``. Prefill is also timed alone.
With ``--vllm`` (M2 only, in .venv-vllm) vLLM generates too, in this process from the same weights
(megacispo.rollout.vllm_engine, greedy, ``min_tokens = max_tokens = N``, a 1 GiB K/V cache), and a
training step's weight sync to it is timed (send_weights from our model, its verification included).

The script prints the CPU and what each side's fp32 products run on: ours through the CPU layer
(parallel/cpu: oneDNN where it takes fp32, i.e. CPUs with AVX-512, and a few-rows kernel for decode
steps), HF's on torch's own kernels (MKL) as its users run it: the CPU layer's products are switched
off around every HF call. MKL runs no AVX-512 code on AMD CPUs, so the ratios depend on the CPU:
compare runs on the same kind.

Times are the median over the timed steps, the two sides taking turns step by step (generation:
the fastest of --gen-repeats whole calls per side, the sides taking turns), as wall clock
and as this process's CPU time (the sum over its threads: less sensitive to other jobs on a shared
machine, but it counts a thread that spins at a barrier as busy).

    .venv/bin/python benchmarks/rl_vs_hf.py [--train-steps 5] [--gen-tokens 1000] [--gen-batch 1 8]
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import platform
import re
import statistics
import time
from pathlib import Path
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from megacispo.models.config import FAMILIES, M1, M2, M2_FIELDS, HybridModelConfig, model_config
from megacispo.parallel import cpu

TRAIN_TARGET = 1.5
GENERATION_TARGET = 3.0
LR = 1e-5
CISPO_EPS_HIGH = 4.0


@dataclass
class Timing:
    """Median seconds of the timed runs."""

    wall_s: float
    cpu_s: float


def measure(run: Callable[[], object], warmup: int, repeats: int) -> Timing:
    return measure_sides({"run": run}, warmup, repeats)["run"]


def measure_sides(runs: dict[str, Callable[[], object]], warmup: int, repeats: int) -> dict[str, Timing]:
    """Median times of each run, the sides taking turns (one repeat of each, then the next), so
    that a change in the machine's load or the process's memory state affects them alike."""
    for run in runs.values():
        for _ in range(warmup):
            run()
    walls, cpus = {name: [] for name in runs}, {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            wall, cpu = time.perf_counter(), time.process_time()
            run()
            walls[name].append(time.perf_counter() - wall)
            cpus[name].append(time.process_time() - cpu)
    return {name: Timing(statistics.median(walls[name]), statistics.median(cpus[name])) for name in runs}


# ------------------------------------------------------------------------------------------------
# The two models, same weights


def build_models(config: HybridModelConfig):
    """(engine, hf_model): our Engine and transformers' MiniMaxForCausalLM (MiniMaxM2ForCausalLM) with the
    same weights."""
    from transformers import MiniMaxConfig, MiniMaxForCausalLM, MiniMaxM2Config, MiniMaxM2ForCausalLM

    from megacispo.config import Config
    from megacispo.models import hf_names
    from megacispo.parallel.layout import ParallelConfig, init_distributed
    from megacispo.testing import hf_models
    from megacispo.training.config import OptimizerConfig
    from megacispo.training.engine import Engine

    init_distributed(ParallelConfig(), seed=0)
    if config.family == M2:
        hf_model = MiniMaxM2ForCausalLM(MiniMaxM2Config(**hf_names.config_to_hf(config), bos_token_id=None,
                                                        eos_token_id=None))
    else:
        hf_model = MiniMaxForCausalLM(MiniMaxConfig(**hf_names.config_to_hf(config)))
    engine = Engine(Config(model=config, optimizer=OptimizerConfig(lr=LR)), total_steps=1000, peak_lr=LR)
    hf_tensors = {name: tensor.detach() for name, tensor in hf_model.state_dict().items()}
    ours = hf_models.full_to_single_process(hf_models.hf_to_full(hf_tensors, config))
    # In-place copies into the DDP buffers the optimizer's shards view.
    missing, unexpected = engine.module.load_state_dict(ours, strict=False)
    missing = [key for key in missing if not key.endswith("_extra_state")]
    assert not missing and not unexpected, (missing, unexpected)
    return engine, hf_model


@contextlib.contextmanager
def torch_products():
    """HF as its users run it: torch's own CPU products, not those of megacispo's CPU layer."""
    cpu.disable_products()
    try:
        yield
    finally:
        cpu.enable_kernels()


def parameter_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def describe_cpu() -> str:
    """The CPU and the kernels each side's fp32 products run on: the figures depend on both (MKL,
    torch's BLAS, runs no AVX-512 code on AMD CPUs; parallel/cpu/csrc/cpu_gemm.cpp)."""
    model = platform.processor() or "unknown CPU"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as cpuinfo:
        model = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), model)
    ours = "oneDNN" if cpu.enable_kernels() else "torch's BLAS"
    return (f"CPU: {model}, torch's SIMD level {torch.backends.cpu.get_cpu_capability()}; "
            f"dense products: ours on {ours}, HF on torch's BLAS")


def implementations(hf_model) -> str:
    config = hf_model.config
    return f"attention {config._attn_implementation}, experts {config._experts_implementation}"


# ------------------------------------------------------------------------------------------------
# Training


@dataclass
class RLBatch:
    tokens: torch.Tensor
    """[b, S]"""
    loss_mask: torch.Tensor
    """[b, S - 1] 1.0 on response tokens (after a prompt of S / 4)."""
    advantages: torch.Tensor
    """[b]"""
    old_logprobs: torch.Tensor
    """[b, S - 1] near log(1 / V), the log-prob of any token under a fresh model."""


def rl_batch(batch_size: int, seq_len: int, vocab_size: int) -> RLBatch:
    generator = torch.Generator().manual_seed(1)
    loss_mask = torch.zeros(batch_size, seq_len - 1)
    loss_mask[:, seq_len // 4 - 1 :] = 1.0
    return RLBatch(
        tokens=torch.randint(0, vocab_size, (batch_size, seq_len), generator=generator),
        loss_mask=loss_mask,
        advantages=torch.randn(batch_size, generator=generator),
        old_logprobs=-math.log(vocab_size) + 0.1 * torch.randn(batch_size, seq_len - 1, generator=generator),
    )


def our_update(engine, batch: RLBatch) -> Callable[[], None]:
    """Trainer._update_once on one micro-batch: Megatron schedule, fused-head CISPO, step."""
    from megacispo.rl.losses import compute_global_counts, compute_policy_loss
    from megacispo.rl.trainer import TrainBatch

    micro = TrainBatch(tokens=batch.tokens, loss_mask=batch.loss_mask, advantages=batch.advantages,
                       rollout_logprobs=batch.old_logprobs, old_logprobs=batch.old_logprobs)
    counts = compute_global_counts([micro.loss_mask], [micro.old_logprobs], group=engine.groups.dp)
    scale = engine.loss_scale_for_schedule(1)

    def forward_step(micro: TrainBatch, model):
        hidden = model(micro.tokens, return_hidden_states=True)

        def loss_func(output):
            logprobs, entropy = engine.token_logprobs(output, micro.tokens[:, 1:], micro.loss_mask,
                                                        compute_entropy=True)
            loss, metrics = compute_policy_loss("cispo", logprobs, micro.old_logprobs, micro.advantages,
                                                micro.loss_mask, counts, eps_high=CISPO_EPS_HIGH)
            metrics["loss/entropy"] = (entropy * micro.loss_mask).sum() / counts.num_tokens.clamp(min=1)
            return loss * scale, metrics

        return hidden, loss_func

    def update() -> None:
        engine.run_micro_batches([micro], forward_step, forward_only=False)
        result = engine.step()
        assert result.applied and math.isfinite(result.grad_norm)

    engine.train(True)
    return update


def hf_update(hf_model, batch: RLBatch) -> Callable[[], None]:
    """A plain PyTorch loop: HF forward, CISPO from log_softmax, backward, clipping, AdamW."""
    optimizer = torch.optim.AdamW(hf_model.parameters(), lr=LR, betas=(0.9, 0.95), eps=1e-15, weight_decay=0.0)
    aux_coeff = hf_model.config.router_aux_loss_coef
    targets = batch.tokens[:, 1:]

    def update() -> None:
        with torch_products():
            hf_step()

    def hf_step() -> None:
        optimizer.zero_grad(set_to_none=True)
        output = hf_model(input_ids=batch.tokens, output_router_logits=True, use_cache=False)
        logprobs = torch.log_softmax(output.logits[:, :-1].float(), dim=-1).gather(-1, targets[..., None]).squeeze(-1)
        ratio = torch.exp(logprobs.detach() - batch.old_logprobs).clamp(max=1 + CISPO_EPS_HIGH)
        token_loss = -ratio * batch.advantages[:, None] * logprobs
        loss = (token_loss * batch.loss_mask).sum() / batch.loss_mask.sum() + aux_coeff * output.aux_loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hf_model.parameters(), 1.0)
        optimizer.step()

    hf_model.train()
    return update


# ------------------------------------------------------------------------------------------------
# Generation


def our_generate(model, prompts: torch.Tensor, new_tokens: int, compile_decode: bool = False) -> torch.Tensor:
    """prompts [b, P] -> the greedy new tokens [b, new_tokens]."""
    from megacispo.rollout.config import RolloutConfig
    from megacispo.rollout.generate import generate, sample_keys

    config = RolloutConfig(max_new_tokens=new_tokens, temperature=0.0, compile_decode=compile_decode)
    # No stop ids: every sample runs all new_tokens steps, as min_new_tokens forces in HF.
    samples = generate(model, prompts.tolist(), config, stop_ids=[], pad_id=0,
                       keys=sample_keys((0,), range(len(prompts)), 1, device="cpu"))
    return samples.tokens[:, prompts.shape[1] :]


def hf_generate(hf_model, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    with torch_products():
        output = hf_model.generate(
            prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
            min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
        )
    return output[:, prompts.shape[1] :]


def start_vllm_side(hf_model, max_model_len: int):
    """vLLM (megacispo.rollout.vllm_engine, in this process) on the HF model's weights, saved for it to load,
    for sequences of up to ``max_model_len`` tokens."""
    import tempfile

    from megacispo.rollout.vllm_engine import start_vllm
    from megacispo.testing import hf_models

    with tempfile.TemporaryDirectory(prefix="rl_vs_hf_vllm_") as directory:
        hf_models.save_with_released_fields(hf_model, Path(directory))
        return start_vllm(directory, dtype=torch.float32, max_model_len=max_model_len, kv_cache_gib=1.0)


def vllm_generate(llm, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """prompts [b, P] -> vLLM's greedy new tokens [b, new_tokens]."""
    from vllm import SamplingParams

    from megacispo.rollout.vllm_engine import generate

    # No stop ids: every sample runs all new_tokens steps, as min_new_tokens forces in HF.
    greedy = SamplingParams(temperature=0.0, max_tokens=new_tokens, min_tokens=new_tokens, logprobs=0,
                            detokenize=False)
    return torch.tensor([tokens for tokens, _ in generate(llm, prompts.tolist(), greedy)])


def run_vllm_sync(engine, hf_model, llm, args) -> None:
    """A training step's weight sync to vLLM, timed: send_weights from our model (its buckets, vLLM's reload
    and, on a CPU, the experts' repack; then its verification on a probe of 4 sequences of --prompt-tokens
    tokens, vLLM's log-probs of them against HF's, the same weights), and the verification alone."""
    from megacispo.rollout.vllm_engine import send_weights, verify_weights

    probe = torch.randint(1, hf_model.config.vocab_size, (4, args.prompt_tokens),
                          generator=torch.Generator().manual_seed(4))
    with torch.no_grad(), torch_products():
        logprobs = torch.log_softmax(hf_model(probe).logits.double(), dim=-1)[:, :-1]
    expected = list(logprobs.gather(-1, probe[:, 1:, None])[..., 0])
    sync, verify, worst = [], [], 0.0
    for version in range(3):
        start = time.perf_counter()
        worst = send_weights(engine.module, engine.config.model, llm, version, probe=probe.tolist(),
                             expected=expected, tolerance=1e-3)
        sync.append(time.perf_counter() - start)
        start = time.perf_counter()
        verify_weights(llm, probe.tolist(), expected, tolerance=1e-3)
        verify.append(time.perf_counter() - start)
    print(f"\nweight sync to vLLM ({parameter_count(engine.module):,} parameters, fp32, the median of 3): "
          f"send_weights {1e3 * statistics.median(sync):.0f} ms, of which verifying it (4 x {args.prompt_tokens} "
          f"tokens) {1e3 * statistics.median(verify):.0f} ms; the probe's largest |log-prob difference| {worst:.1e}")


def our_prefill(model, prompts: torch.Tensor) -> None:
    model.eval()
    model.prefill(prompts)


def hf_prefill(hf_model, prompts: torch.Tensor) -> None:
    hf_model.eval()
    with torch.no_grad(), torch_products():
        hf_model(input_ids=prompts, use_cache=True, logits_to_keep=1)


def decode_weight_reads(model, batch_size: int) -> tuple[Timing, Timing]:
    """What one decode step's weight reads cost alone: rows times every 2-D weight the step reads,
    one product per weight as the decode path makes them: the output layer and
    each layer's projections and router on all ``batch_size`` rows, and as many of its experts as a
    batch of this size routes to on average, rounded down (E (1 - (1 - k/E)^b)), each on its share
    of the b * k rows; and the same number of bytes read as one stream (a sum over one buffer), the
    machine's floor for them."""
    config = model.config
    experts, topk = config.num_moe_experts, config.moe_router_topk
    used = int(experts * (1 - (1 - topk / experts) ** batch_size))
    expert_rows = max(1, round(batch_size * topk / used))
    products = []  # (rows [m, in], weight [out, in])
    for name, parameter in model.named_parameters():
        if parameter.dim() != 2 or "word_embeddings" in name:
            continue
        expert = re.search(r"\.local_experts\.(\d+)\.", name)
        if expert is None or int(expert[1]) < used:
            rows = batch_size if expert is None else expert_rows
            products.append((torch.randn(rows, parameter.shape[1]), parameter.detach()))
    stream = torch.randn(sum(weight.numel() for _, weight in products))

    def matmuls() -> None:
        with torch.no_grad():
            for rows, weight in products:
                F.linear(rows, weight)

    return measure(matmuls, 3, 50), measure(stream.sum, 3, 50)


def first_difference(a: torch.Tensor, b: torch.Tensor) -> int:
    """Index of the first differing token, or the length when equal."""
    differs = (a != b).nonzero()
    return int(differs[0]) if len(differs) else len(a)


# ------------------------------------------------------------------------------------------------
# Report


def verdict(ratio: float, target: float) -> str:
    return "met" if ratio >= target else "not met"


def print_table(title: str, header: list[str], rows: list[list[str]]) -> None:
    print(f"\n{title}\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---:" if i else "---" for i in range(len(header))) + "|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


def rate_rows(work: float, timings: dict[str, Timing], target_rows: tuple[str, ...], target: float) -> list[list[str]]:
    """One row per side: work / time by both clocks, the ratio to HF, and the verdict of ``target_rows``."""
    hf = timings["HF"]
    rows = []
    for name, timing in timings.items():
        wall_ratio, cpu_ratio = hf.wall_s / timing.wall_s, hf.cpu_s / timing.cpu_s
        result = f"{target}x: {verdict(wall_ratio, target)} (wall), {verdict(cpu_ratio, target)} (CPU)"
        rows.append([
            name, f"{work / timing.wall_s:,.1f}", f"{work / timing.cpu_s:,.1f}", f"{wall_ratio:.2f}",
            f"{cpu_ratio:.2f}", result if name in target_rows else "",
        ])
    return rows


RATE_HEADER = ["side", "tokens/s (wall)", "tokens/s (CPU time)", "vs HF (wall)", "vs HF (CPU)", "target"]


def run_training(engine, hf_model, args) -> None:
    batch = rl_batch(args.batch_size, args.seq_len, hf_model.config.vocab_size)
    sides = {
        "ours": our_update(engine, batch),
        "HF": hf_update(hf_model, batch),
    }
    timings = measure_sides(sides, args.warmup, args.train_steps)
    print_table(
        f"Training: one RL update (forward + CISPO + backward + AdamW), batch {args.batch_size} x "
        f"{args.seq_len} tokens, median of {args.train_steps} steps after {args.warmup} warm-up",
        RATE_HEADER, rate_rows(float(batch.tokens.numel()), timings, ("ours",), TRAIN_TARGET),
    )
    print("\nstep time: " + "; ".join(f"{name} {t.wall_s:.2f} s wall / {t.cpu_s:.2f} s CPU" for name, t in timings.items()))


def run_generation(engine, hf_model, args) -> None:
    model = engine.module
    vocab = hf_model.config.vocab_size
    # Warm-up: a short generation on each side (first-call allocations, lazy initializations).
    warm = torch.randint(1, vocab, (1, 64), generator=torch.Generator().manual_seed(3))
    our_generate(model, warm, 4)
    hf_generate(hf_model, warm, 4)
    sides = {
        "ours": lambda prompts: our_generate(model, prompts, args.gen_tokens),
        "ours, compiled": lambda prompts: our_generate(model, prompts, args.gen_tokens, compile_decode=True),
        "HF": lambda prompts: hf_generate(hf_model, prompts, args.gen_tokens),
    }
    if args.vllm:
        # The warm-up prompt too, which may be longer than --prompt-tokens.
        llm = start_vllm_side(hf_model, max(args.prompt_tokens, warm.shape[1]) + args.gen_tokens)
        sides["vLLM"] = lambda prompts: vllm_generate(llm, prompts, args.gen_tokens)
        vllm_generate(llm, warm, 4)
        run_vllm_sync(engine, hf_model, llm, args)
    for batch_size in args.gen_batch:
        # Distinct random prompts of one length: no padding on either side.
        prompts = torch.randint(1, vocab, (batch_size, args.prompt_tokens), generator=torch.Generator().manual_seed(2))
        # The compiled step's graphs for this batch size: its first steps compile (and recompile
        # once, when the sequence length turns dynamic).
        compile_start = time.perf_counter()
        our_generate(model, prompts, 8, compile_decode=True)
        compile_s = time.perf_counter() - compile_start
        prefill = measure_sides(
            {"ours": lambda: our_prefill(model, prompts), "HF": lambda: hf_prefill(hf_model, prompts)}, 1, 3
        )
        prefill["ours, compiled"] = prefill["ours"]
        timings, generated = {}, {}
        # The sides take turns, args.gen_repeats rounds; each keeps its fastest call (wall clock).
        for _ in range(args.gen_repeats):
            for name, run in sides.items():
                wall, cpu = time.perf_counter(), time.process_time()
                generated[name] = run(prompts)
                timing = Timing(time.perf_counter() - wall, time.process_time() - cpu)
                if name not in timings or timing.wall_s < timings[name].wall_s:
                    timings[name] = timing
                assert generated[name].shape == (batch_size, args.gen_tokens), (name, generated[name].shape)
        print_table(
            f"Generation: batch {batch_size}, greedy, {args.prompt_tokens}-token prompts + {args.gen_tokens} new "
            f"tokens each (new tokens / time of the whole call, prefill included; the fastest of "
            f"{args.gen_repeats} calls per side, the sides taking turns)",
            RATE_HEADER,
            rate_rows(float(batch_size * args.gen_tokens), timings, ("ours", "ours, compiled"), GENERATION_TARGET),
        )
        rows = []
        for name, total in ((name, total) for name, total in timings.items() if name in prefill):
            per_step = 1e3 * (total.wall_s - prefill[name].wall_s) / max(args.gen_tokens - 1, 1)
            rows.append([name, f"{1e3 * prefill[name].wall_s:.0f}", f"{1e3 * prefill[name].cpu_s:.0f}", f"{per_step:.1f}"])
        print_table(f"Where generation time goes, batch {batch_size} (wall clock; prefill: median of 3)",
                    ["side", "prefill ms", "prefill CPU ms", "ms per decode step (total - prefill)"], rows)
        print(f"\nbatch {batch_size}: compiling the decode step took {compile_s:.1f} s (an 8-token warm-up generation)")
        matmuls, stream = decode_weight_reads(model, batch_size)
        # The decode-step time at which the whole call (our prefill included) would be the target's rate.
        target_step = (timings["HF"].wall_s / GENERATION_TARGET - prefill["ours"].wall_s) / max(args.gen_tokens - 1, 1)
        print(f"\nbatch {batch_size}: a step's weight matmuls alone take {1e3 * matmuls.wall_s:.1f} ms (wall), reading "
              f"the same bytes as one stream {1e3 * stream.wall_s:.1f} ms; {GENERATION_TARGET}x HF needs a whole decode "
              f"step of {1e3 * target_step:.1f} ms, with our prefill")
        for name in (name for name in sides if name != "HF"):
            same = [first_difference(ours, theirs) for ours, theirs in zip(generated[name], generated["HF"])]
            print(f"\n{name}: greedy tokens identical to HF's for the first {min(same)} of {args.gen_tokens} in every "
                  f"row (same weights; fp32 round-off may flip a near-tie of the random model)")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per RL update")
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per sequence in the RL update")
    parser.add_argument("--train-steps", type=int, default=5, help="timed RL updates per side")
    parser.add_argument("--warmup", type=int, default=2, help="untimed RL updates per side first")
    parser.add_argument("--prompt-tokens", type=int, default=1000, help="prompt length for generation")
    parser.add_argument("--gen-tokens", type=int, default=1000, help="new tokens per generation")
    parser.add_argument("--gen-batch", type=int, nargs="+", default=[1, 8],
                        help="sequences generated at once (1: latency; 8: a group of samples of one RL prompt)")
    parser.add_argument("--gen-repeats", type=int, default=2, help="timed generation calls per side and batch size")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch intra-op threads")
    parser.add_argument("--skip", choices=("train", "generate"), help="leave out one part")
    parser.add_argument("--family", choices=FAMILIES, default=M1, help="the small shape as this MiniMax family")
    parser.add_argument("--vllm", action="store_true",
                        help="generate with vLLM too (--family minimax-m2; in .venv-vllm: tools/setup_env.sh --vllm)")
    args = parser.parse_args()
    if args.vllm and args.family != M2:
        parser.error(f"--vllm needs --family {M2}: vLLM serves MiniMax-M2, not M1")
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    small = model_config("small")
    if args.family == M2:
        config = small.replace(**M2_FIELDS)
    else:
        # HF rotates whole heads; so does our model with rotary_dim = head_dim (MODEL.md).
        config = small.replace(rotary_dim=small.head_dim)
    engine, hf_model = build_models(config)
    import transformers

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {args.threads} threads, "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"parameters: ours {parameter_count(engine.module):,}, HF {parameter_count(hf_model):,} "
          f"(HF {implementations(hf_model)})")
    print(describe_cpu())
    if args.skip != "generate":
        run_generation(engine, hf_model, args)
    if args.skip != "train":
        run_training(engine, hf_model, args)
    print(f"\nload average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
