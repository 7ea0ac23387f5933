"""The GPU check: on one CUDA GPU, in a few minutes, the numbers the CPU test suite cannot give.

1. lightning attention: the Triton kernel (models/lightning_triton.py, what models.lightning
   dispatches to on CUDA) against the block-wise torch implementation of models/lightning.py
   (the CPU path, run on the GPU): forward and backward error of Triton fp32 / bf16 inputs against
   the torch implementation in fp64, packed documents included, and forward + backward time of each
   in fp32 (what the mixer feeds it); fla's chunk_simple_gla with the same per-head decay as a peer
   when fla is installed (its error against the same fp64 reference, and its time).
2. a training step of the ``small`` model through the Engine (Megatron DDP, optimizer), world size 1:
   bf16 weights with local layers, bf16 with Transformer Engine layers, and FP8 (Transformer Engine,
   --fp8-recipe): tokens/s, MFU (training FLOPs from the model config over the GPU's dense bf16
   peak), peak memory, and the loss difference between FP8 and bf16 with the same TE layers after
   the same steps on the same data from the same weights. The TE rows need transformer-engine.
3. the vocab-parallel loss (parallel/vocab_parallel.py) against a full fp64 log-softmax: the
   log-probs and their gradient from a vocabulary shard of M1's size (V/TP = 200,064 / 8), the
   fused chunked LM head against logits @ log_softmax, with time and peak memory.

Prints one markdown table; exits 1 if a check failed (its row says why), 2 without a CUDA GPU.

    bash benchmarks/gpu_check.sh            (or: python benchmarks/gpu_check.py --help)
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import inspect
import math
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Callable

import torch

# Dense bf16 tensor-core peak, TFLOP/s, of the GPUs this project targets (SXM parts).
BF16_PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "B200": 2250.0}


@dataclass
class Row:
    """One line of the table."""

    check: str
    case: str
    error: str = "-"
    time: str = "-"
    throughput: str = "-"
    memory: str = "-"
    note: str = ""


@dataclass
class Report:
    rows: list[Row] = field(default_factory=list)
    failed: bool = False

    def add(self, row: Row) -> None:
        self.rows.append(row)
        print(f"  done: {row.check} / {row.case}", file=sys.stderr, flush=True)

    @contextlib.contextmanager
    def check(self, check: str, case: str):
        """Run a check; an exception becomes a failed row instead of ending the script."""
        try:
            yield
        except Exception as error:  # noqa: BLE001 - reported in the table, the exit status says it failed
            self.failed = True
            traceback.print_exc(file=sys.stderr)
            self.add(Row(check, case, note=f"FAILED: {type(error).__name__}: {str(error)[:120]}"))

    def table(self) -> str:
        header = ("check", "case", "max error", "ms", "throughput", "peak memory", "note")
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for row in self.rows:
            cells = (row.check, row.case, row.error, row.time, row.throughput, row.memory, row.note)
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    lightning = parser.add_argument_group("lightning attention")
    lightning.add_argument("--heads", type=int, default=8, help="heads (MiniMax-M1's 64 over TP 8)")
    lightning.add_argument("--head-dim", type=int, default=128)
    lightning.add_argument("--error-tokens", type=int, default=4133,
                           help="tokens per sequence of the error check (not a multiple of the block)")
    lightning.add_argument("--speed-tokens", type=int, default=32768, help="tokens of the timed sequence")
    train = parser.add_argument_group("training step (small model)")
    train.add_argument("--micro-batch", type=int, default=8)
    train.add_argument("--seq-len", type=int, default=1024)
    train.add_argument("--steps", type=int, default=20, help="optimizer steps per precision (after 3 warm-up steps)")
    train.add_argument("--fp8-recipe", default="tensorwise", choices=("delayed", "tensorwise", "blockwise", "mxfp8"))
    train.add_argument("--peak-tflops", type=float, default=None,
                       help="dense bf16 peak of the GPU for MFU (default: known from the GPU's name)")
    loss = parser.add_argument_group("vocab-parallel loss")
    loss.add_argument("--loss-tokens", type=int, default=8192)
    loss.add_argument("--vocab-shard", type=int, default=25008, help="V/TP: MiniMax-M1's 200,064 over TP 8")
    loss.add_argument("--hidden", type=int, default=6144)
    parser.add_argument("--skip", action="append", default=[], choices=("lightning", "train", "loss"),
                        help="leave out a section (repeatable)")
    return parser.parse_args(argv)


def require_cuda() -> None:
    if not torch.cuda.is_available():
        print(
            "gpu_check: no CUDA GPU is visible to torch (torch.cuda.is_available() is False; torch "
            f"{torch.__version__}, CUDA build: {torch.version.cuda or 'no'}). Run it on a GPU machine with a "
            "CUDA build of torch; the CPU checks are the test suite (tests/run.sh).",
            file=sys.stderr,
        )
        raise SystemExit(2)


def cuda_ms(step: Callable[[], None], repeats: int, warmup: int = 2) -> float:
    """Median wall time of ``step`` in ms, measured with CUDA events after ``warmup`` runs."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|."""
    expected = expected.double()
    return float((actual.double() - expected).abs().max() / expected.abs().max().clamp_min(1e-30))


# ---------------------------------------------------------------------------------------------
# 1. Lightning attention
# ---------------------------------------------------------------------------------------------


def torch_blockwise(q, k, v, decay, cu_seqlens=None, block_size: int = 256):
    """The block-wise torch implementation of models/lightning.py on any device (lightning_attention
    itself sends CUDA tensors to Triton). Returns out [b, n, h, d]."""
    from megacispo.models import lightning

    batch, seq_len = q.shape[:2]
    doc_lengths = lightning._document_lengths(cu_seqlens, batch, seq_len)
    layout = lightning._BlockLayout.build(
        tuple(doc_lengths), block_size, max(1, lightning.CHUNK_TOKENS // block_size), q.device
    )
    decays = lightning._BlockDecays.build(decay, layout, q.dtype, with_initial_state=False)
    out, _ = lightning._LightningAttentionFunction.apply(q, k, v, None, decays, layout)
    return out


def triton_kernel(q, k, v, decay, cu_seqlens=None):
    from megacispo.models.lightning_triton import lightning_attention_triton

    return lightning_attention_triton(q, k, v, decay, cu_seqlens=cu_seqlens)[0]


def fla_peer() -> Callable | None:
    """fla's chunk_simple_gla as lightning attention (scale 1, log-decay -s_h on every token), or None."""
    if importlib.util.find_spec("fla") is None:
        return None
    from fla.ops.simple_gla import chunk_simple_gla

    head_first = {"head_first": False} if "head_first" in inspect.signature(chunk_simple_gla).parameters else {}

    def run(q, k, v, decay, cu_seqlens=None):
        log_decay = (-decay).to(q.dtype)[None, None, :].expand(q.shape[0], q.shape[1], -1).contiguous()  # [b, n, h]
        kwargs = {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens.long()}
        out, _ = chunk_simple_gla(q=q, k=k, v=v, g=log_decay, scale=1.0, output_final_state=False,
                                  **head_first, **kwargs)
        return out

    return run


def lightning_inputs(batch: int, seq_len: int, heads: int, head_dim: int, seed: int = 0):
    """q, k, v (fp64) scaled like silu(projection) outputs, an output gradient, and M1's decay rates
    of layer 0 (fp32, as the mixer passes them)."""
    from megacispo.models.lightning import lightning_decay_rates

    generator = torch.Generator(device="cuda").manual_seed(seed)
    shape = (batch, seq_len, heads, head_dim)
    q, k, v = (0.1 * torch.randn(shape, generator=generator, device="cuda", dtype=torch.float64) for _ in range(3))
    grad_out = torch.randn(shape, generator=generator, device="cuda", dtype=torch.float64)
    decay = lightning_decay_rates(heads, layer_idx=0, num_layers=80).to("cuda", torch.float32)
    return q, k, v, grad_out, decay


def forward_backward(fn, q, k, v, grad_out, decay, dtype, cu_seqlens=None):
    """out and dq, dk, dv of fn on inputs cast to dtype."""
    leaves = [x.detach().to(dtype).requires_grad_(True) for x in (q, k, v)]
    out = fn(*leaves, decay, cu_seqlens)
    out.backward(grad_out.to(dtype))
    return [out.detach()] + [leaf.grad for leaf in leaves]


def lightning_checks(args: argparse.Namespace, report: Report) -> None:
    heads, head_dim = args.heads, args.head_dim
    peer = fla_peer()
    candidates = {"triton": triton_kernel, **({"fla chunk_simple_gla": peer} if peer else {})}
    tokens = args.error_tokens
    cases = {
        f"2 x {tokens} tokens": (2, tokens, None),
        # A long document, one of a single token, and the rest.
        f"packed 3 documents, {tokens} tokens": (
            1, tokens, torch.tensor([0, tokens // 4, tokens // 4 + 1, tokens], device="cuda", dtype=torch.int32)
        ),
    }
    for case, (batch, seq_len, cu_seqlens) in cases.items():
        with report.check("lightning error", case):
            q, k, v, grad_out, decay = lightning_inputs(batch, seq_len, heads, head_dim)
            for dtype in (torch.float32, torch.bfloat16):
                # The reference sees the inputs rounded to the candidate's dtype: the error is the kernel's.
                rounded = [x.to(dtype).double() for x in (q, k, v, grad_out)]
                reference = forward_backward(torch_blockwise, *rounded, decay, torch.float64, cu_seqlens)
                for name, fn in candidates.items():
                    result = forward_backward(fn, *rounded, decay, dtype, cu_seqlens)
                    errors = [relative_error(a, e) for a, e in zip(result, reference)]
                    report.add(Row("lightning error", f"{name} {str(dtype).removeprefix('torch.')}, {case}",
                                   error=f"out {errors[0]:.1e}, grads {max(errors[1:]):.1e}",
                                   note="vs torch block-wise fp64 on the same rounded inputs, "
                                        "relative to the largest reference value"))

    seq_len = args.speed_tokens
    q, k, v, grad_out, decay = lightning_inputs(1, seq_len, heads, head_dim)
    timed = {"torch block-wise": torch_blockwise, **candidates}
    for name, fn in timed.items():
        with report.check("lightning speed", f"{name} fp32"):
            leaves = [x.float().requires_grad_(True) for x in (q, k, v)]
            grad = grad_out.float()

            def forward():
                with torch.no_grad():
                    fn(*leaves, decay)

            def forward_backward_step():
                for leaf in leaves:
                    leaf.grad = None
                fn(*leaves, decay).backward(grad)

            forward_ms = cuda_ms(forward, repeats=5)
            step_ms = cuda_ms(forward_backward_step, repeats=5)
            report.add(Row("lightning speed", f"{name} fp32, 1 x {seq_len} x {heads} heads x {head_dim}",
                           time=f"fwd {forward_ms:.2f}, fwd+bwd {step_ms:.2f}",
                           throughput=f"{seq_len / step_ms / 1e3:.2f} Mtok/s fwd+bwd"))


# ---------------------------------------------------------------------------------------------
# 2. Training step of the small model
# ---------------------------------------------------------------------------------------------


def training_flops_per_token(model, seq_len: int) -> float:
    """Model FLOPs of one training token (forward + backward = 3 x forward; recompute not counted).

    Matmuls: the mixers' projections, the router, the top-k experts' SwiGLU, the LM head (the
    embedding is a lookup). Softmax attention: causal QK^T and PV, 2 x 2 x width FLOPs per key, s/2
    keys per query on average. Lightning attention: the recurrence's state update and read-out,
    2 x 2 x d x width per token (the block-wise form does more, as flash attention does for softmax).
    """
    from megacispo.models.config import LIGHTNING

    hidden, head_dim = model.hidden_size, model.head_dim
    width = model.num_attention_heads * head_dim
    kv_width = model.num_query_groups * head_dim
    num_lightning = model.layer_kinds.count(LIGHTNING)
    num_softmax = model.num_layers - num_lightning
    forward = (
        num_lightning * (2 * 5 * hidden * width + 4 * head_dim * width)  # qkv (3), gate, out_proj
        + num_softmax * (2 * (2 * hidden * width + 2 * hidden * kv_width) + 2 * seq_len * width)
        + model.num_layers * 2 * hidden * model.num_experts
        + model.num_layers * model.moe_router_topk * 2 * 3 * hidden * model.moe_ffn_hidden_size
        + 2 * hidden * model.vocab_size
    )
    return 3.0 * forward


def peak_tflops(args: argparse.Namespace) -> float | None:
    if args.peak_tflops:
        return args.peak_tflops
    name = torch.cuda.get_device_name()
    return next((peak for gpu, peak in BF16_PEAK_TFLOPS.items() if gpu in name), None)


@dataclass
class TrainResult:
    losses: list[float]
    step_ms: float
    peak_gib: float
    weights: dict[str, torch.Tensor]


def train_small(args: argparse.Namespace, overrides: list[str], start_weights: dict | None,
                batches: list[torch.Tensor]) -> TrainResult:
    """Warm-up and timed optimizer steps of the small model through the Engine, one batch per step
    (cycling ``batches``); ``start_weights`` (same layer layout) replace the initial weights."""
    from megatron.core import tensor_parallel

    from megacispo.config import load_config
    from megacispo.engine import Engine

    config = load_config(None, ["model.size=small", *overrides])
    torch.manual_seed(config.train.seed)
    tensor_parallel.model_parallel_cuda_manual_seed(config.train.seed)
    num_steps = args.steps + 3
    engine = Engine(config, total_steps=num_steps, peak_lr=3e-4)
    weights = {name: p.detach().clone() for name, p in engine.module.named_parameters()}
    if start_weights is not None:
        with torch.no_grad():
            for name, param in engine.module.named_parameters():
                param.copy_(start_weights[name])
        engine.optimizer.reload_model_params()  # the fp32 master copies follow the loaded weights
    engine.train()

    def forward_step(batch, model):
        per_token = model(batch.tokens[:, :-1], labels=batch.tokens[:, 1:])  # [b, s]
        return per_token, lambda output: (output.float().mean(), {"loss": output.detach().float().mean()})

    losses, times = [], []
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    for step in range(num_steps):
        start = time.perf_counter()
        outputs = engine.run_micro_batches([SimpleNamespace(tokens=batches[step % len(batches)])], forward_step,
                                           forward_only=False)
        engine.step()
        torch.cuda.synchronize()
        if step >= 3:
            times.append((time.perf_counter() - start) * 1e3)
        losses.append(float(outputs[0]["loss"]))
    peak = torch.cuda.max_memory_allocated() / 2**30
    del engine
    torch.cuda.empty_cache()
    return TrainResult(losses, statistics.median(times), peak, weights)


def train_checks(args: argparse.Namespace, report: Report) -> None:
    from megacispo.models.config import model_config
    from megacispo.models.te_specs import require_transformer_engine
    from megacispo.parallel.layout import ParallelConfig, init_distributed

    init_distributed(ParallelConfig(), seed=1234)
    model = model_config("small")
    generator = torch.Generator(device="cuda").manual_seed(0)
    # Four batches cycled: the model memorises them, so the losses fall and the FP8 - bf16 gap is
    # measured on a moving target, not on the flat log(V) of untrained weights.
    batches = [torch.randint(0, model.vocab_size, (args.micro_batch, args.seq_len + 1), device="cuda",
                             generator=generator) for _ in range(4)]
    tokens_per_step = args.micro_batch * args.seq_len
    flops = training_flops_per_token(model, args.seq_len)
    peak = peak_tflops(args)

    def add(case: str, result: TrainResult, note: str) -> None:
        tokens_per_s = tokens_per_step / (result.step_ms / 1e3)
        mfu = f", MFU {flops * tokens_per_s / (peak * 1e12):.1%}" if peak else ", MFU: pass --peak-tflops"
        report.add(Row("train step small", case, time=f"{result.step_ms:.1f}",
                       throughput=f"{tokens_per_s:,.0f} tok/s{mfu}", memory=f"{result.peak_gib:.2f} GiB",
                       note=f"loss {result.losses[0]:.3f} -> {result.losses[-1]:.3f}; {note}"))

    bf16 = ["precision.params_dtype=bfloat16"]
    with report.check("train step small", "bf16, local layers"):
        add("bf16, local layers", train_small(args, bf16, None, batches), "the default path")
    te_bf16 = [*bf16, "precision.use_transformer_engine=true"]
    fp8 = [*bf16, f"precision.fp8={args.fp8_recipe}"]
    try:
        require_transformer_engine(args.fp8_recipe)
    except ValueError as error:
        for case in ("bf16, TE layers", f"fp8 {args.fp8_recipe}, TE layers"):
            report.add(Row("train step small", case, note=f"skipped: {error}"))
        return
    with report.check("train step small", f"bf16 / fp8 {args.fp8_recipe}, TE layers"):
        reference = train_small(args, te_bf16, None, batches)
        add("bf16, TE layers", reference, f"{flops / 1e6:.0f} MFLOP per token")
        quantized = train_small(args, fp8, reference.weights, batches)
        gaps = [abs(a - b) for a, b in zip(quantized.losses, reference.losses)]
        add(f"fp8 {args.fp8_recipe}, TE layers", quantized,
            f"|loss - bf16 TE| last {gaps[-1]:.4f}, max {max(gaps):.4f} over {len(gaps)} steps")


# ---------------------------------------------------------------------------------------------
# 3. Vocab-parallel loss
# ---------------------------------------------------------------------------------------------


def measured(step: Callable[[], None]) -> tuple[float, float]:
    """(median ms, peak GiB allocated above what was allocated before) of ``step``."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step_ms = cuda_ms(step, repeats=5)
    return step_ms, (torch.cuda.max_memory_allocated() - base) / 2**30


def loss_checks(args: argparse.Namespace, report: Report) -> None:
    from megacispo.parallel.vocab_parallel import lm_head_logprobs, vocab_parallel_logprobs

    num_tokens, vocab, hidden_size = args.loss_tokens, args.vocab_shard, args.hidden
    generator = torch.Generator(device="cuda").manual_seed(0)
    targets = torch.randint(0, vocab, (num_tokens,), device="cuda", generator=generator)
    grad_logprobs = torch.randn(num_tokens, device="cuda", generator=generator)

    with report.check("vocab-parallel loss", "log-probs from logits"):
        logits = (3 * torch.randn(num_tokens, vocab, device="cuda", generator=generator)).requires_grad_(True)
        wide = logits.detach().double().requires_grad_(True)
        expected = torch.log_softmax(wide, -1).gather(-1, targets[:, None])[:, 0]
        expected.backward(grad_logprobs.double())
        logprobs = vocab_parallel_logprobs(logits, targets, check_targets=False)
        logprobs.backward(grad_logprobs)
        errors = (relative_error(logprobs.detach(), expected.detach()), relative_error(logits.grad, wide.grad))
        del wide, expected

        def ours():
            logits.grad = None
            vocab_parallel_logprobs(logits, targets, check_targets=False).backward(grad_logprobs)

        def torch_fp32():
            logits.grad = None
            torch.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0].backward(grad_logprobs)

        ours_ms, ours_gib = measured(ours)
        torch_ms, torch_gib = measured(torch_fp32)
        report.add(Row("vocab-parallel loss", f"vocab_parallel_logprobs, {num_tokens} x {vocab} fp32 logits",
                       error=f"logp {errors[0]:.1e}, grad {errors[1]:.1e}", time=f"{ours_ms:.2f}",
                       memory=f"{ours_gib:.2f} GiB",
                       note=f"vs fp64 log_softmax; torch fp32 log_softmax: {torch_ms:.2f} ms, {torch_gib:.2f} GiB"))
        logits = None  # frees the GPU memory; the timed closures above are done with it

    with report.check("vocab-parallel loss", "fused LM head"):
        hidden = (torch.randn(num_tokens, hidden_size, device="cuda", generator=generator)).requires_grad_(True)
        weight = (torch.randn(vocab, hidden_size, device="cuda", generator=generator) / math.sqrt(hidden_size)
                  ).requires_grad_(True)
        wide_hidden, wide_weight = (x.detach().double().requires_grad_(True) for x in (hidden, weight))
        expected = torch.log_softmax(wide_hidden @ wide_weight.T, -1).gather(-1, targets[:, None])[:, 0]
        expected.backward(grad_logprobs.double())
        logprobs, _ = lm_head_logprobs(hidden, weight, targets, check_targets=False)
        logprobs.backward(grad_logprobs)
        errors = (relative_error(logprobs.detach(), expected.detach()), relative_error(hidden.grad, wide_hidden.grad),
                  relative_error(weight.grad, wide_weight.grad))
        del wide_hidden, wide_weight, expected

        def fused():
            hidden.grad = weight.grad = None
            lm_head_logprobs(hidden, weight, targets, check_targets=False)[0].backward(grad_logprobs)

        def unfused():
            hidden.grad = weight.grad = None
            vocab_parallel_logprobs(hidden @ weight.T, targets, check_targets=False).backward(grad_logprobs)

        fused_ms, fused_gib = measured(fused)
        unfused_ms, unfused_gib = measured(unfused)
        report.add(Row("vocab-parallel loss", f"lm_head_logprobs (fused), {num_tokens} tokens, H {hidden_size}",
                       error=f"logp {errors[0]:.1e}, grads {max(errors[1:]):.1e}", time=f"{fused_ms:.2f}",
                       memory=f"{fused_gib:.2f} GiB",
                       note=f"vs fp64; unfused logits + vocab_parallel_logprobs: {unfused_ms:.2f} ms, "
                            f"{unfused_gib:.2f} GiB"))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    require_cuda()
    report = Report()
    started = time.perf_counter()
    sections = {"lightning": lightning_checks, "train": train_checks, "loss": loss_checks}
    for name, run in sections.items():
        if name not in args.skip:
            print(f"{name} ...", file=sys.stderr, flush=True)
            with report.check(name, "section"):
                run(args, report)
    print(f"# GPU check on {torch.cuda.get_device_name()} (torch {torch.__version__}, CUDA {torch.version.cuda}), "
          f"{time.perf_counter() - started:.0f} s\n")
    print(report.table())
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
