"""The GPU check: on one CUDA GPU, in a few minutes, the numbers the CPU test suite cannot give.

One table, a row per check: what it measured (value), the bound it must keep, its status (pass,
FAIL, skip) and a note (what the row measured besides, and why it failed). Every row of this
project's code has a bound; a row fails on an exception or a value over its bound (the note says
which value is over which bound), and fails the exit status, not the rest of the check. Each row is
printed to stderr as it finishes (and appended to --rows-file), and the table to stdout at the end.

1. lightning attention: the Triton kernel (models/lightning_triton.py, what models.lightning
   dispatches to on CUDA) against the block-wise torch implementation of models/lightning.py
   (the CPU path, run on the GPU): forward and backward error of Triton fp32 / bf16 inputs against
   the torch implementation in fp64, packed documents included, relative error at most 1e-4 (fp32)
   and 3e-2 (bf16) for the output and each input's gradient; forward + backward time in fp32 (what
   the mixer feeds it), no slower than the torch block-wise path it replaces; fla's
   chunk_simple_gla with the same per-head decay as a peer when fla is installed (its error against
   the same fp64 reference and its time, for comparison: a peer's rows are not bounded, and an fla
   that raises is a note in its row); then the registers per thread and the spills of every Triton
   kernel the rows above compiled: no spill, at most 255 registers (what the ahead-of-time compile
   of tests/unit/test_triton_aot.py holds them to on the CPU).
2. a training step of the ``small`` model through the Engine (Megatron DDP, optimizer), world size 1:
   bf16 weights with local layers, bf16 with Transformer Engine layers, and FP8 (Transformer Engine,
   --fp8-recipe): tokens/s, MFU (training FLOPs from the model config over the GPU's dense bf16
   peak), peak memory, and the loss difference between FP8 and bf16 with the same TE layers after
   the same steps on the same data from the same weights. Each row's loss must fall over its
   steps, its MFU reach TRAIN_MFU_FLOOR, and FP8's loss must stay within 0.05 of bf16's at every step. The TE rows need
   transformer-engine.
3. the vocab-parallel loss (parallel/vocab_parallel.py) against a full fp64 log-softmax: the
   log-probs and their gradient from a vocabulary shard of M1's size (V/TP = 200,064 / 8), the
   fused chunked LM head against logits @ log_softmax, with time and peak memory; relative error
   at most 1e-5.
4. decode: the decode step's expert kernels (models/experts_triton.py) against their ops' composites
   at one MoE layer of M1's decode on an EP rank, fp32 and bf16: relative error at most 1e-6 (fp32)
   and 1e-2 (bf16), each pair's position exact, the kernels' time beside the composites', and their
   registers and spills, bounded as section 1's; the ``small`` model with local layers, and with
   Transformer Engine layers built for FP8 GEMMs (--fp8-recipe; needs transformer-engine), in bf16
   rollouts: the lean decode step against Megatron's modules, the log-probs of 16 teacher-forced
   steps' tokens within 0.05;
   ``generate`` with rollout.compile_decode on and off, fp32 rollouts from the same keys (local layers):
   the same tokens; ``generate`` with rollout.compile_decode off and on, 16 slots: tokens/s as a
   fraction of the card's roofline (the weights' bytes over its HBM bandwidth; at least
   DECODE_ROOFLINE_FLOOR), time per decode step, CUDA kernels per decode step (torch.profiler) and host
   syncs per decode step (torch.cuda.set_sync_debug_mode("warn")), each the difference of two generate
   calls of 16 and 64 tokens over their 48 decode steps (prefill excluded): at most 30 kernels a layer and 100 besides
   (the embedding, the LM head, the draw), at most one host sync every rollout.host_check_every
   steps (4 on a GPU), and the compiled step no slower than the eager one.

5. the driver, as a user runs it: torchrun (NCCL, world size 1) launches the real entry points on
   the ``tiny`` model, in fp32 and in bf16 (--set precision.params_dtype=bfloat16), on the quick
   start's task data and tokenizer (tools/make_task_data.py, tools/train_tokenizer.py) with a small
   config in a temporary run directory: SFT steps (megacispo.sft), CISPO RL steps with rollouts
   through Trainer and generate (megacispo.train, packed rows: train.pack_sequences), its first step
   again in right-padded rows (train.pack_sequences = false) and at context parallelism 2 on 2
   processes, each of which must sample the same rollouts and give the same policy loss, entropy,
   train/rollout log-prob gap and gradient norm; one step with bf16 rollouts through the compiled
   decode step (rollout.dtype = bfloat16, rollout.compile_decode = true; train/rollout log-prob
   gap at most 0.05); the RL steps with FP8 GEMMs (precision.fp8 = --fp8-recipe, the bf16 half
   only, needs transformer-engine): finite rollouts, and where they sample what the bf16 rl stage
   sampled, its policy loss and entropy within 0.05 of rl's; where two GPUs are visible, the
   multi-GPU block: rl's first step at TP = 2 + EP = 2 (4 processes and expert TP 2 on 4 GPUs, 2
   and expert TP 1 on 2 or 3), and the RL steps with placement.rollout_ranks = 1 (a training
   process and a rollout process that gets the weights by a sync after every update; its gap no
   larger than rl's); RL steps of a random tiny M2 with rollout.engine = vllm, where vLLM is installed
   (the lent image has none: the row says so): vLLM in the training process, started from the config
   alone and given the weights by a sync at the start and after each step, every sync checked by the
   run against the trainer's log-probs of a probe and timed, vLLM's sampled log-probs within bf16's gap
   of the trainer's; the checkpoint RL saved, --resume from it for one more step, and
   megacispo.score on the result. One row per stage (check "driver"), its bound what the stage
   requires of its run; a failed stage fails its row and the stages that need it, not the check.

Prints one markdown table; exits 1 if a row failed (its note says why), 2 without a CUDA GPU.

    bash benchmarks/gpu_check.sh            (or: python benchmarks/gpu_check.py --help)

Time budget: gpu_check.sh stops the check at TIME_LIMIT_S (540 s: a lent GPU gives 10 minutes per
call) and passes --budget-s 20 s below it; past the budget no section and no driver stage starts
(its row fails, saying so) and a running stage is stopped, so the table prints before the limit.
Aimed at: sections 1-4 about 3 minutes; the driver the rest, 19 torchrun launches at 2+ GPUs (13 on
one) of about 15 s each where CUDA starts fast (on the CPU twin they take 7-18 s, the compiled bf16
rollout 35 s). Not yet measured on a GPU: where the budget runs out, --driver-dtype bfloat16 halves
the driver and --skip-stage leaves single stages out. On a lent GPU, whose loan is 15 minutes, the
check runs in two calls of 400 s each (``PARTS``: --part 1 the kernels, decode and the bf16 driver,
--part 2 the training step, the loss and the fp32 driver; gpu_check.sh --device).

The CPU twin: the driver stages alone, on the CPU with gloo, fp32 and bf16 (CI runs its fp32
half, tests/multiprocess/test_gpu_check.py; --driver-dtype float32 chooses it); the stages that
need several processes run as gloo processes there, FP8 is skipped (no Transformer Engine):

    bash benchmarks/gpu_check.sh --cpu
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.metadata
import importlib.util
import inspect
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Iterable

import torch
import yaml

from megacispo.metrics.logger import read_scalars

# Dense bf16 tensor-core peak, TFLOP/s, and HBM bandwidth, TB/s, of the GPUs this project targets (SXM
# parts): the card's roofline, a training step's by its FLOPs and a decode step's by the bytes it reads.
BF16_PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "B200": 2250.0}
HBM_TBPS = {"H100": 3.35, "H200": 4.8, "H800": 3.35, "B200": 8.0}
# The least fraction of the roofline a row must reach, set before a GPU ran this code: the small model's
# steps are bound by kernel launches, not by the card (a training step of 0.6 TFLOP, a decode step reading
# 59 MB: 0.6 ms and 18 us on an H100), so a healthy run reaches a few percent. The floors sit below that,
# where a step fell off its path (a host sync per layer, a recompile per step, a math-kernel fallback).
TRAIN_MFU_FLOOR = 0.005
DECODE_ROOFLINE_FLOOR = {"eager": 0.001, "compiled": 0.005}
REPO = Path(__file__).resolve().parent.parent
DRIVER_DTYPES = ("float32", "bfloat16")


# The bounds a row must keep (relative errors: max |actual - expected| / max |expected|).
LIGHTNING_BOUND = {torch.float32: 1e-4, torch.bfloat16: 3e-2}
LM_HEAD_BOUND = 1e-5
FP8_LOSS_BOUND = 0.05


@dataclass
class Row:
    """One line of the table: what was measured (``value``) against its ``bound``; ``failure`` (empty:
    passed) says which value is over which bound. ``note`` holds what the row measures besides (times,
    memory, a peer's numbers)."""

    check: str
    case: str
    value: str = "-"
    bound: str = "-"
    note: str = ""
    failure: str = ""
    skipped: bool = False

    @property
    def status(self) -> str:
        return "FAIL" if self.failure else "skip" if self.skipped else "pass"

    def cells(self) -> tuple[str, ...]:
        """The table's cells; the note says why the row failed, unless its value does."""
        why = f"FAILED: {self.failure}" if self.failure and self.failure != self.value else ""
        note = "; ".join(part for part in (why, self.note) if part)
        return tuple(cell.replace("|", "\\|") for cell in (self.check, self.case, self.value, self.bound, self.status,
                                                          note))


def over_bound(values: dict[str, float], bound: float) -> str:
    """The values above ``bound`` or not finite, as "name value > bound"; empty when every one keeps it."""
    return "; ".join(f"{name} {value:.2e} > {bound:g}" for name, value in values.items() if not value <= bound)


def error_row(check: str, case: str, errors: dict[str, float], bound: float, note: str = "") -> Row:
    """A row of measured relative errors that fails where one is over ``bound``."""
    return Row(check, case, value=", ".join(f"{name} {value:.1e}" for name, value in errors.items()),
               bound=f"<= {bound:g}", note=note, failure=over_bound(errors, bound))


class StageFailed(Exception):
    """A driver stage ran but went wrong; the message is its row's result."""


class StageSkipped(Exception):
    """A driver stage this machine cannot run (the message says why); it fails nothing."""


TABLE_HEADER = ("check", "case", "value", "bound", "status", "note")


@dataclass
class Report:
    """The check's rows, in one table; each row is printed (to stderr) as it finishes, so a check stopped
    from outside still leaves the rows it finished."""

    budget: Budget = field(default_factory=lambda: Budget(0))
    rows_file: Path | None = None
    """Where each row is also appended as it finishes (--rows-file), after the table's header."""
    rows: list[Row] = field(default_factory=list)
    failed: bool = False

    def __post_init__(self) -> None:
        if self.rows_file is not None:
            self.rows_file.parent.mkdir(parents=True, exist_ok=True)
            self.rows_file.write_text(markdown_table(TABLE_HEADER, []) + "\n")

    def add(self, row: Row) -> None:
        self.rows.append(row)
        self.failed |= bool(row.failure)
        line = markdown_line(row.cells())
        print(line, file=sys.stderr, flush=True)
        if self.rows_file is not None:
            with self.rows_file.open("a") as rows:
                rows.write(line + "\n")

    @contextlib.contextmanager
    def check(self, check: str, case: str):
        """Run a check; an exception becomes a failed row instead of ending the script."""
        try:
            yield
        except Exception as error:  # noqa: BLE001 - reported in the table, the exit status says it failed
            traceback.print_exc(file=sys.stderr)
            self.add(Row(check, case, failure=f"{type(error).__name__}: {str(error)[:120]}"))

    def run_stage(self, stage: str, dtype: str, bound: str, action: Callable[[], str]) -> bool:
        """Run one driver stage (``action`` returns its key result), as a row of check "driver"; a
        failure becomes a failed row. Whether it passed and ran."""
        started, skipped, failure = time.perf_counter(), False, ""
        try:
            result = action()
        except StageSkipped as reason:
            result, skipped = f"skipped: {reason}", True
        except StageFailed as error:
            result = failure = str(error)
        except Exception as error:  # noqa: BLE001 - a bug of the check itself; the row and the exit status say so
            traceback.print_exc(file=sys.stderr)
            result = failure = f"{type(error).__name__}: {str(error)[:200]}"
        self.add(stage_row(stage, dtype, bound, result, failure=failure, skipped=skipped,
                           seconds=time.perf_counter() - started))
        return not failure and not skipped

    def table(self) -> str:
        return markdown_table(TABLE_HEADER, [row.cells() for row in self.rows])


def stage_row(stage: str, dtype: str, bound: str, result: str, failure: str = "", skipped: bool = False,
              seconds: float = 0.0) -> Row:
    """A driver stage's row: its result (why it failed, if it did)."""
    return Row("driver", f"{stage} ({dtype})", value=result, bound=bound, note=f"{seconds:.1f} s", failure=failure,
               skipped=skipped)


def markdown_line(cells: tuple[str, ...]) -> str:
    return "| " + " | ".join(cells) + " |"


def markdown_table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    return "\n".join([markdown_line(header), "|" + "---|" * len(header), *map(markdown_line, rows)])


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
    train.add_argument("--fp8-recipe", default="tensorwise", choices=("delayed", "tensorwise", "blockwise", "mxfp8"),
                       help="precision.fp8 of the FP8 training rows and of the driver's fp8 stage")
    train.add_argument("--peak-tflops", type=float, default=None,
                       help="dense bf16 peak of the GPU for MFU (default: known from the GPU's name)")
    train.add_argument("--hbm-tbps", type=float, default=None,
                       help="HBM bandwidth of the GPU, TB/s, for decode's roofline (default: known from its name)")
    loss = parser.add_argument_group("vocab-parallel loss")
    loss.add_argument("--loss-tokens", type=int, default=8192)
    loss.add_argument("--vocab-shard", type=int, default=25008, help="V/TP: MiniMax-M1's 200,064 over TP 8")
    loss.add_argument("--hidden", type=int, default=6144)
    driver = parser.add_argument_group("the driver (tiny model, torchrun with 1 process; 2 or 4: multi-GPU block)")
    driver.add_argument("--driver-dtype", action="append", choices=DRIVER_DTYPES, default=None,
                        help="weight dtype of a driver run (repeatable; default: both)")
    driver.add_argument("--run-dir", default=None,
                        help="where the driver runs write (kept); default: a temporary directory, removed if every "
                             "stage passed")
    driver.add_argument("--stage-timeout", type=float, default=300.0, help="seconds one driver process may run")
    driver.add_argument("--skip-stage", action="append", default=[], choices=LEAF_STAGES,
                        help="leave out a driver stage no other stage needs (repeatable; its row says skipped)")
    parser.add_argument("--cpu", action="store_true",
                        help="the CPU twin: only the driver stages, on the CPU with gloo (no CUDA needed)")
    parser.add_argument("--skip", action="append", default=[],
                        choices=("lightning", "train", "loss", "decode", "driver"),
                        help="leave out a section (repeatable)")
    parser.add_argument("--part", type=int, choices=sorted(PARTS), default=None,
                        help="one call's share of the check on a lent GPU: its sections and driver dtypes (PARTS)")
    parser.add_argument("--rows-file", type=Path, default=None,
                        help="also append each row to this markdown file as it finishes (the table's header first), "
                             "so that a check stopped from outside leaves its rows (on a lent GPU: under $OUT)")
    parser.add_argument("--budget-s", type=float, default=0.0,
                        help="seconds the whole check may run: past them no section or driver stage starts and a "
                             "running stage is stopped, its row failed (0: no limit; gpu_check.sh: TIME_LIMIT_S - 20)")
    args = parser.parse_args(argv)
    if args.part is not None:
        if args.skip or args.driver_dtype or args.cpu:
            parser.error(f"--part {args.part} chooses the sections and the driver's dtypes: leave out --skip, "
                         "--driver-dtype and --cpu, or run without --part")
        part = PARTS[args.part]
        args.skip = [name for name in SECTIONS if name not in part.sections]
        args.driver_dtype = list(part.driver_dtypes)
    args.driver_dtype = args.driver_dtype or list(DRIVER_DTYPES)
    return args


def require_cuda() -> None:
    if not torch.cuda.is_available():
        print(
            "gpu_check: no CUDA GPU is visible to torch (torch.cuda.is_available() is False; torch "
            f"{torch.__version__}, CUDA build: {torch.version.cuda or 'no'}). Run it on a GPU machine with a "
            "CUDA build of torch; its driver stages run on the CPU with: bash benchmarks/gpu_check.sh --cpu",
            file=sys.stderr,
        )
        raise SystemExit(2)


@functools.cache
def world_of_one() -> None:
    """This process as a world of one (NCCL, Megatron-Core's parallel state), once for every section."""
    from megacispo.parallel.layout import ParallelConfig, init_distributed

    init_distributed(ParallelConfig(), seed=1234)


def median_ms(step: Callable[[], None], repeats: int, warmup: int = 2) -> float:
    """Median wall time of ``step`` in ms after ``warmup`` runs: by CUDA events on a GPU, by the host's
    clock without one (the CPU tests of the check's rows)."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeats):
        if not torch.cuda.is_available():
            started = time.perf_counter()
            step()
            times.append((time.perf_counter() - started) * 1e3)
            continue
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
    from megacispo.models.lightning_checks import document_lengths

    batch, seq_len = q.shape[:2]
    doc_lengths = document_lengths(cu_seqlens, batch, seq_len)
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


def lightning_inputs(batch: int, seq_len: int, heads: int, head_dim: int, device: str = "cuda", seed: int = 0):
    """q, k, v (fp64) scaled like silu(projection) outputs, an output gradient, and M1's decay rates
    of layer 0 (fp32, as the mixer passes them)."""
    from megacispo.models.lightning import lightning_decay_rates

    generator = torch.Generator().manual_seed(seed)
    shape = (batch, seq_len, heads, head_dim)
    q, k, v, grad_out = (torch.randn(shape, generator=generator, dtype=torch.float64).to(device) for _ in range(4))
    decay = lightning_decay_rates(heads, layer_idx=0, num_layers=80).to(device, torch.float32)
    return 0.1 * q, 0.1 * k, 0.1 * v, grad_out, decay


def forward_backward(fn, q, k, v, grad_out, decay, dtype, cu_seqlens=None):
    """out and dq, dk, dv of fn on inputs cast to dtype."""
    leaves = [x.detach().to(dtype).requires_grad_(True) for x in (q, k, v)]
    out = fn(*leaves, decay, cu_seqlens)
    out.backward(grad_out.to(dtype))
    return [out.detach()] + [leaf.grad for leaf in leaves]


def lightning_checks(args: argparse.Namespace, report: Report) -> None:
    heads, head_dim = args.heads, args.head_dim
    peer = fla_peer()
    peers = {"fla chunk_simple_gla": peer} if peer else {}
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
            inputs = lightning_inputs(batch, seq_len, heads, head_dim)
            for dtype in (torch.float32, torch.bfloat16):
                label = f"{str(dtype).removeprefix('torch.')}, {case}"
                reference = lightning_reference(inputs, dtype, cu_seqlens)
                report.add(lightning_error_row(triton_kernel, f"triton {label}", inputs, dtype, reference, cu_seqlens))
                for name, fn in peers.items():
                    report.add(peer_row("lightning error", f"{name} {label}", lambda: lightning_error_row(
                        fn, "", inputs, dtype, reference, cu_seqlens)))

    seq_len = args.speed_tokens
    inputs = lightning_inputs(1, seq_len, heads, head_dim)
    case = f"fp32, 1 x {seq_len} x {heads} heads x {head_dim}"
    with report.check("lightning speed", f"triton {case}"):
        report.add(lightning_speed_row(triton_kernel, torch_blockwise, f"triton {case}", inputs))
    for name, fn in peers.items():
        report.add(peer_row("lightning speed", f"{name} {case}",
                            lambda: lightning_speed_row(fn, torch_blockwise, "", inputs)))
    from megacispo.models import lightning_triton

    with report.check("triton kernels", "registers"):
        for row in triton_kernel_rows(lightning_triton._state_scan_kernel, lightning_triton._block_output_kernel):
            report.add(row)


def rounded_inputs(inputs, dtype: torch.dtype) -> list[torch.Tensor]:
    """q, k, v and the output gradient of ``inputs`` rounded to ``dtype`` (held in fp64), then the decay."""
    *tensors, decay = inputs
    return [x.to(dtype).double() for x in tensors] + [decay]


def lightning_reference(inputs, dtype: torch.dtype, cu_seqlens=None) -> list[torch.Tensor]:
    """out, dq, dk, dv of the torch block-wise implementation in fp64 on the inputs rounded to ``dtype``
    (so that an error against it is the candidate's, not the rounding of its inputs)."""
    return forward_backward(torch_blockwise, *rounded_inputs(inputs, dtype), torch.float64, cu_seqlens)


def lightning_error_row(fn, case: str, inputs, dtype: torch.dtype, reference: list[torch.Tensor],
                        cu_seqlens=None) -> Row:
    """``fn``'s output and input gradients in ``dtype`` against ``reference`` (lightning_reference):
    relative errors within LIGHTNING_BOUND."""
    result = forward_backward(fn, *rounded_inputs(inputs, dtype), dtype, cu_seqlens)
    errors = dict(zip(("out", "dq", "dk", "dv"), map(relative_error, result, reference)))
    return error_row("lightning error", case, errors, LIGHTNING_BOUND[dtype],
                     note="vs torch block-wise fp64 on the same rounded inputs, relative to the largest reference "
                          "value")


def peer_row(check: str, case: str, measure: Callable[[], Row]) -> Row:
    """``measure``'s row for a peer implementation (fla), for comparison: never failed by a bound, and
    what it raises is the row's note."""
    try:
        row = measure()
    except Exception as error:  # noqa: BLE001 - a peer's failure is reported, it is not ours
        return Row(check, case, bound=PEER, note=f"the peer raised {type(error).__name__}: {str(error)[:120]}")
    return replace(row, check=check, case=case, bound=PEER, failure="")


PEER = "none: a peer"


def lightning_speed_row(fn, reference_fn, case: str, inputs) -> Row:
    """Forward + backward time of ``fn`` in fp32 beside ``reference_fn``'s (the torch block-wise path,
    which fn replaces on a GPU): fn must not be slower."""
    q, k, v, grad_out, decay = inputs
    leaves = [x.float().requires_grad_(True) for x in (q, k, v)]
    grad = grad_out.float()

    def step_of(implementation) -> Callable[[], None]:
        def step():
            for leaf in leaves:
                leaf.grad = None
            implementation(*leaves, decay).backward(grad)

        return step

    def forward():
        with torch.no_grad():
            fn(*leaves, decay)

    step_ms, reference_ms = median_ms(step_of(fn), repeats=5), median_ms(step_of(reference_fn), repeats=5)
    forward_ms = median_ms(forward, repeats=5)
    failure = "" if step_ms <= reference_ms else f"fwd+bwd {step_ms:.2f} ms > torch block-wise {reference_ms:.2f} ms"
    return Row("lightning speed", case, value=f"fwd+bwd {step_ms:.2f} ms (torch block-wise {reference_ms:.2f} ms)",
               bound="<= torch block-wise", failure=failure,
               note=f"fwd {forward_ms:.2f} ms; {q.shape[1] / step_ms / 1e3:.2f} Mtok/s fwd+bwd")


def triton_kernel_rows(*kernels) -> list[Row]:
    """Registers per thread and spills of every compiled variant of ``kernels`` (Triton's
    compiled-kernel metadata, read from the kernels' caches after the rows before ran them): no spill,
    at most 255 registers (the same bounds tests/unit/test_triton_aot.py holds the ahead-of-time
    compiles to)."""
    rows = []
    for kernel in kernels:
        for device, (compiled_kernels, *_) in kernel.device_caches.items():
            for compiled in compiled_kernels.values():
                compiled._init_handles()  # loads the binary, which is what reports n_regs and n_spills
                names = compiled.src.fn.arg_names
                constants = {names[index[0]]: value for index, value in compiled.src.constants.items()
                             if len(index) == 1 and names[index[0]].isupper()}
                variant = " ".join(f"{name}={value}" for name, value in sorted(constants.items()))
                failures = [f"{compiled.n_spills} spilled > 0"] if compiled.n_spills else []
                failures += [f"{compiled.n_regs} registers > 255"] if compiled.n_regs > 255 else []
                rows.append(Row("triton kernels", f"{compiled.name} {variant}",
                                value=f"{compiled.n_regs} registers, {compiled.n_spills} spilled",
                                bound="0 spilled, <= 255 registers", failure="; ".join(failures),
                                note=f"{compiled.metadata.num_warps} warps, {compiled.metadata.shared} B shared "
                                     f"memory, GPU {device}"))
    return rows


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


def card_figure(figures: dict[str, float], given: float | None) -> float | None:
    """The card's figure from ``figures`` (BF16_PEAK_TFLOPS, HBM_TBPS) by its name, unless ``given``;
    None for a card the table does not know."""
    if given:
        return given
    name = torch.cuda.get_device_name()
    return next((figure for gpu, figure in figures.items() if gpu in name), None)


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

    from megacispo.startup import run_config
    from megacispo.training.engine import Engine

    config = run_config(None, ["model.size=small", *overrides])
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

    world_of_one()
    model = model_config("small")
    generator = torch.Generator(device="cuda").manual_seed(0)
    # Four batches cycled: the model memorises them, so the losses fall and the FP8 - bf16 gap is
    # measured on a moving target, not on the flat log(V) of untrained weights.
    batches = [torch.randint(0, model.vocab_size, (args.micro_batch, args.seq_len + 1), device="cuda",
                             generator=generator) for _ in range(4)]
    tokens_per_step = args.micro_batch * args.seq_len
    flops = training_flops_per_token(model, args.seq_len)
    peak = card_figure(BF16_PEAK_TFLOPS, args.peak_tflops)

    def add(case: str, result: TrainResult, note: str, bf16_losses: list[float] | None = None) -> None:
        tokens_per_s = tokens_per_step / (result.step_ms / 1e3)
        mfu = flops * tokens_per_s / (peak * 1e12) if peak else None
        report.add(train_row(case, result, f"{tokens_per_s:,.0f} tok/s", note, bf16_losses, mfu))

    bf16 = ["precision.params_dtype=bfloat16"]
    with report.check("train step small", "bf16, local layers"):
        add("bf16, local layers", train_small(args, bf16, None, batches), "the default path")
    te_bf16 = [*bf16, "precision.use_transformer_engine=true"]
    fp8 = [*bf16, f"precision.fp8={args.fp8_recipe}"]
    try:
        require_transformer_engine(args.fp8_recipe)
    except ValueError as error:
        for case in ("bf16, TE layers", f"fp8 {args.fp8_recipe}, TE layers"):
            report.add(Row("train step small", case, note=f"skipped: {error}", skipped=True))
        return
    with report.check("train step small", f"bf16 / fp8 {args.fp8_recipe}, TE layers"):
        reference = train_small(args, te_bf16, None, batches)
        add("bf16, TE layers", reference, f"{flops / 1e6:.0f} MFLOP per token")
        quantized = train_small(args, fp8, reference.weights, batches)
        add(f"fp8 {args.fp8_recipe}, TE layers", quantized, "vs bf16 TE: same weights, data and steps",
            reference.losses)


def train_row(case: str, result: TrainResult, throughput: str, note: str,
              bf16_losses: list[float] | None = None, mfu: float | None = None) -> Row:
    """A training row: it fails if the loss did not fall over the steps, if its ``mfu`` (the fraction of
    the card's bf16 peak its tokens/s reach; None: the card's peak is unknown) is under TRAIN_MFU_FLOOR,
    or, given the bf16 run's losses (an FP8 row), if a step's loss is more than FP8_LOSS_BOUND from bf16's."""
    first, last = result.losses[0], result.losses[-1]
    error, bound = f"loss {first:.3f} -> {last:.3f}", "loss falls"
    failures = [] if last < first else [f"the loss did not fall: {first:.4f} -> {last:.4f}"]
    bound += f"; MFU >= {TRAIN_MFU_FLOOR:.1%}"
    if mfu is None:
        error += "; MFU unknown (pass --peak-tflops)"
    else:
        error += f"; MFU {mfu:.2%}"
        if not mfu >= TRAIN_MFU_FLOOR:
            failures.append(f"MFU {mfu:.2%} < {TRAIN_MFU_FLOOR:.1%}")
    if bf16_losses is not None:
        gaps = [abs(a - b) for a, b in zip(result.losses, bf16_losses)]
        worst = max(gaps) if all(map(math.isfinite, gaps)) else math.nan
        error += f"; |fp8 - bf16| last {gaps[-1]:.4f}, max {worst:.4f} over {len(gaps)} steps"
        bound += f"; |fp8 - bf16| <= {FP8_LOSS_BOUND:g}"
        if over := over_bound({"max |fp8 - bf16 loss|": worst}, FP8_LOSS_BOUND):
            failures.append(over)
    measured = f"{result.step_ms:.1f} ms per step, {throughput}, peak {result.peak_gib:.2f} GiB"
    return Row("train step small", case, value=error, bound=bound, note="; ".join(filter(None, (measured, note))),
               failure="; ".join(failures))


# ---------------------------------------------------------------------------------------------
# 3. Vocab-parallel loss
# ---------------------------------------------------------------------------------------------


def measured(step: Callable[[], None]) -> tuple[float, float]:
    """(median ms, peak GiB allocated above what was allocated before) of ``step``."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step_ms = median_ms(step, repeats=5)
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
        report.add(error_row("vocab-parallel loss", f"vocab_parallel_logprobs, {num_tokens} x {vocab} fp32 logits",
                             dict(zip(("logp", "grad"), errors)), LM_HEAD_BOUND,
                             note=f"{ours_ms:.2f} ms, {ours_gib:.2f} GiB; vs fp64 log_softmax; torch fp32 "
                                  f"log_softmax: {torch_ms:.2f} ms, {torch_gib:.2f} GiB"))
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
        report.add(error_row("vocab-parallel loss", f"lm_head_logprobs (fused), {num_tokens} tokens, H {hidden_size}",
                             dict(zip(("logp", "grad hidden", "grad weight"), errors)), LM_HEAD_BOUND,
                             note=f"{fused_ms:.2f} ms, {fused_gib:.2f} GiB; vs fp64; unfused logits + "
                                  f"vocab_parallel_logprobs: {unfused_ms:.2f} ms, {unfused_gib:.2f} GiB"))


# ---------------------------------------------------------------------------------------------
# 4. Decode
# ---------------------------------------------------------------------------------------------

DECODE_SLOTS = 16
DECODE_PROMPT_TOKENS = 64
# Two generate calls of these many new tokens: their difference is decode steps alone, prefill and
# set-up cancel out (every sample runs to its limit: no stop ids).
DECODE_SHORT, DECODE_LONG = 16, 64
# Kernels of one eager decode step: the lean step's at most 30 a layer in bf16 (benchmarks/decode_ops.py
# counts them on the CPU), and the embedding, the LM head and the sampler's draw besides.
DECODE_KERNELS_PER_LAYER = 30
DECODE_KERNELS_OUTSIDE_LAYERS = 100
# The lean decode step and Megatron's modules round differently in bf16 (norms, residuals, the routing
# weights): their log-probs of the same tokens differ by a few bf16 roundings.
DECODE_PATHS_BOUND = 0.05


# The decode step's expert kernels against their ops' composites: copies and an index (exact), silu and
# a weighted sum that may round otherwise in the last bit.
EXPERT_KERNELS_BOUND = {torch.float32: 1e-6, torch.bfloat16: 1e-2}
# One MoE layer of M1's decode on an EP rank: 64 slots on each of EP 32 ranks gathered, top-2 of 32
# experts (one on this rank), hidden 6144, the expert FFN 9216 over expert TP 8.
M1_EXPERT_STEP = {"tokens": 64 * 32, "topk": 2, "num_experts": 32, "local": 1, "hidden": 6144, "ffn": 9216 // 8}


def decode_checks(args: argparse.Namespace, report: Report) -> None:
    from megacispo.models import experts_triton
    from megacispo.models.config import PrecisionConfig, model_config, transformer_config
    from megacispo.models.model import HybridModel
    from megacispo.models.te_specs import require_transformer_engine
    from megacispo.parallel.layout import ParallelConfig

    world_of_one()
    for dtype in (torch.float32, torch.bfloat16):
        case = f"M1's MoE layer on an EP rank, {str(dtype).removeprefix('torch.')}"
        with report.check("decode expert kernels", case):
            report.add(expert_kernels_row(experts_triton, dtype, "cuda", case, timed=True, **M1_EXPERT_STEP))
    with report.check("triton kernels", "registers"):
        for row in triton_kernel_rows(experts_triton._permute_pairs_kernel, experts_triton._swiglu_kernel,
                                      experts_triton._combine_pairs_kernel):
            report.add(row)
    config = model_config("small")
    hbm_tbps = card_figure(HBM_TBPS, args.hbm_tbps)
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, config.vocab_size, (DECODE_SLOTS, DECODE_PROMPT_TOKENS), generator=generator).tolist()
    try:
        require_transformer_engine(args.fp8_recipe)
        te_error = None
    except ValueError as error:
        te_error = error
    # The local layers, and M1's kind of model: Transformer Engine layers built for FP8 GEMMs, whose
    # rollouts run outside FP8 through the same lean step.
    layers = {"local layers": PrecisionConfig(), f"TE layers (fp8 {args.fp8_recipe} model)":
              PrecisionConfig(params_dtype="bfloat16", fp8=args.fp8_recipe)}
    for name, precision in layers.items():
        if precision.fp8 and te_error is not None:
            report.add(Row("decode", f"small, {name}", note=f"skipped: {te_error}", skipped=True))
            continue
        torch.manual_seed(0)
        model = HybridModel(config, transformer_config(config, ParallelConfig(), precision=precision)).cuda()
        with report.check("decode paths", f"small, {name}, bf16"):
            report.add(decode_paths_row(model, prompts, f"small, {name}, bf16"))
        if not precision.fp8:  # one model's fp32 compile is enough to hold the compiled step to the eager one
            with report.check("decode tokens", f"small, {name}, fp32"):
                report.add(compiled_tokens_row(model, prompts, f"small, {name}, fp32"))
        eager = None
        for compiled in (False, True):
            case = f"small, {name}, {DECODE_SLOTS} slots, bf16, compile_decode {'on' if compiled else 'off'}"
            with report.check("decode", case):
                measured = decode_steps(model, prompts, compiled, decode_floor_ms(model, hbm_tbps))
                report.add(decode_row(case, measured, config.num_layers, eager))
                eager = eager or measured
        del model
        torch.cuda.empty_cache()


def expert_kernels_row(kernels, dtype: torch.dtype, device: str, case: str, *, tokens: int, topk: int,
                       num_experts: int, local: int, hidden: int, ffn: int, timed: bool = False) -> Row:
    """The Triton kernels of ``megacispo::permute_pairs``, ``swiglu`` and ``combine_pairs`` (``kernels``:
    models/experts_triton.py, or a copy of it) against the ops' composites on random pairs, the experts
    from ``local`` on another rank's, the rows no product wrote NaN: relative errors within
    EXPERT_KERNELS_BOUND, and each pair's position exact. ``timed``: the kernels' time and the
    composites' side by side (CUDA)."""
    from megacispo.models.experts import combine_pairs, permute_pairs, swiglu

    generator = torch.Generator().manual_seed(0)
    token_rows = torch.randn(tokens, hidden, generator=generator).to(device=device, dtype=dtype)
    choices = torch.rand(tokens, num_experts, generator=generator).argsort(dim=1)[:, :topk]
    sorted_experts, order = torch.sort(choices.clamp(max=local).flatten().to(device), stable=True)
    ends = torch.searchsorted(sorted_experts, torch.arange(local, device=device), right=True, out_int32=True)
    computed = sorted_experts < local
    projected = torch.randn(tokens * topk, 2 * ffn, generator=generator).to(device=device, dtype=dtype)
    expert_outputs = torch.randn(tokens * topk, hidden, generator=generator).to(device=device, dtype=dtype)
    expert_outputs[~computed] = float("nan")
    probs = torch.rand(tokens, topk, generator=generator).to(device)
    rows, positions = kernels.permute_pairs_triton(token_rows, sorted_experts, order, local)
    expected_rows, expected_positions = permute_pairs(token_rows, sorted_experts, order, local)
    # (kernel, composite) of each op, on the same inputs.
    calls = {
        "permute": (lambda: kernels.permute_pairs_triton(token_rows, sorted_experts, order, local),
                    lambda: permute_pairs(token_rows, sorted_experts, order, local)),
        "swiglu": (lambda: kernels.swiglu_triton(projected, ends), lambda: swiglu(projected, ends)),
        "combine": (lambda: kernels.combine_pairs_triton(token_rows, probs, expert_outputs, expected_positions, 1.0,
                                                         1.0),
                    lambda: combine_pairs(token_rows, probs, expert_outputs, expected_positions, 1.0, 1.0)),
    }
    rows_done = int(ends[-1])
    errors = {
        "permute": relative_error(rows[computed], expected_rows[computed]),
        "positions": float((positions != expected_positions).sum()),
        "swiglu": relative_error(*(call()[:rows_done] for call in calls["swiglu"])),
        "combine": relative_error(*(call() for call in calls["combine"])),
    }
    row = error_row("decode expert kernels", case, errors, EXPERT_KERNELS_BOUND[dtype],
                    note=f"{tokens} tokens, top-{topk}, {local} of {num_experts} experts local, hidden {hidden}, "
                         f"FFN {ffn}")
    if timed:
        row.note += "; ms: " + ", ".join(f"{name} {median_ms(kernel, repeats=20):.3f} (torch "
                                         f"{median_ms(composite, repeats=20):.3f})"
                             for name, (kernel, composite) in calls.items())
    return row


def decode_paths_row(model, prompts: list[list[int]], case: str, steps: int = DECODE_SHORT) -> Row:
    """The lean decode step against Megatron's modules (``lean_decode = False``) in a bf16 rollout:
    after one prefill, ``steps`` teacher-forced decode steps on each path (the lean path's greedy
    tokens fed to both), the largest difference of the log-probs of those tokens, at most
    DECODE_PATHS_BOUND."""
    device = model.lm_head_weight.device
    input_ids = torch.tensor(prompts, device=device)
    mask = torch.ones_like(input_ids, dtype=torch.bool)
    gap = 0.0
    with torch.no_grad(), model.generation_dtype(torch.bfloat16):
        logits, lean_cache = model.prefill(input_ids, mask)
        _, megatron_cache = model.prefill(input_ids, mask)
        tokens = logits.argmax(-1)
        try:
            for _ in range(steps):
                model.lean_decode = True
                lean, lean_cache = model.decode_step(tokens, lean_cache)
                model.lean_decode = False
                megatron, megatron_cache = model.decode_step(tokens, megatron_cache)
                tokens = lean.argmax(-1)
                lean_logprobs, megatron_logprobs = (torch.log_softmax(step.float(), -1).gather(-1, tokens[:, None])
                                                    for step in (lean, megatron))
                gap = max(gap, (lean_logprobs - megatron_logprobs).abs().max().item())
        finally:
            model.lean_decode = True
    return Row("decode paths", case, value=f"max |lean - megatron log-prob| {gap:.1e}",
               bound=f"<= {DECODE_PATHS_BOUND:g}", failure=over_bound({"log-prob gap": gap}, DECODE_PATHS_BOUND),
               note=f"{steps} teacher-forced decode steps of {len(prompts)} rows after a "
                    f"{len(prompts[0])}-token prefill")


def compiled_tokens_row(model, prompts: list[list[int]], case: str) -> Row:
    """``generate`` with rollout.compile_decode on against off, fp32 rollouts of DECODE_SHORT tokens from
    the same keys: every token the same (in fp32 a compiled step's roundings move no sample across a
    draw's boundary; in bf16 they may, so bf16 is held to the log-probs of decode paths' row instead)."""
    from megacispo.rollout.config import RolloutConfig
    from megacispo.rollout.generate import generate, sample_keys

    def tokens(compiled: bool) -> torch.Tensor:
        rollout = RolloutConfig(max_new_tokens=DECODE_SHORT, temperature=1.0, dtype="float32",
                                compile_decode=compiled)
        keys = sample_keys((0,), range(len(prompts)), 1, device="cuda")
        return generate(model, prompts, rollout, stop_ids=[], pad_id=0, keys=keys).tokens

    eager, compiled = tokens(False), tokens(True)
    differ = int((eager != compiled).sum())
    return Row("decode tokens", case, value=f"{differ} of {eager.numel()} tokens differ", bound="compiled = eager",
               failure=f"{differ} tokens differ" if differ else "",
               note=f"{len(prompts)} rows, {DECODE_SHORT} new tokens each, compile_decode on vs off")


@dataclass
class DecodeSteps:
    """What ``generate``'s decode steps cost, per step: the difference of two calls of DECODE_SHORT and
    DECODE_LONG new tokens over their DECODE_LONG - DECODE_SHORT steps (prefill and set-up cancel out)."""

    slots: int
    step_ms: float
    kernels: float  # CUDA kernels (torch.profiler)
    host_syncs: float  # torch.cuda.set_sync_debug_mode("warn")'s warnings
    floor_ms: float | None = None
    """The card's roofline for the step: the bytes of the weights it reads over the HBM bandwidth (None:
    the card's bandwidth is unknown)."""


def decode_floor_ms(model, hbm_tbps: float | None) -> float | None:
    """A bf16 decode step's floor on the card: every weight read once, in the dtype generation_dtype gives
    it (the LM head and routers in fp32), over the HBM bandwidth; the embedding table only where the LM
    head is tied to it (else a step reads a row of it per slot). At DECODE_SLOTS x top-k choices of the
    small model's 8 experts, every expert is read."""
    if hbm_tbps is None:
        return None
    with model.generation_dtype(torch.bfloat16):
        read = sum(param.numel() * param.element_size() for name, param in model.named_parameters()
                   if "word_embeddings" not in name or param is model.lm_head_weight)
    return read / (hbm_tbps * 1e12) * 1e3


def decode_steps(model, prompts: list[list[int]], compiled: bool, floor_ms: float | None = None) -> DecodeSteps:
    from megacispo.rollout.config import RolloutConfig
    from megacispo.rollout.generate import generate, sample_keys

    def call(new_tokens: int) -> Callable[[], None]:
        rollout = RolloutConfig(max_new_tokens=new_tokens, temperature=1.0, dtype="bfloat16", compile_decode=compiled)
        keys = sample_keys((0,), range(len(prompts)), 1, device="cuda")
        return lambda: generate(model, prompts, rollout, stop_ids=[], pad_id=0, keys=keys)

    short, long = call(DECODE_SHORT), call(DECODE_LONG)
    long()  # warm-up: compiles the decode step (and its dynamic-length recompile) when compiled
    seconds = {}
    for name, step in (("short", short), ("long", long)):
        torch.cuda.synchronize()
        started = time.perf_counter()
        step()
        torch.cuda.synchronize()
        seconds[name] = time.perf_counter() - started
    steps = DECODE_LONG - DECODE_SHORT
    return DecodeSteps(len(prompts), (seconds["long"] - seconds["short"]) / steps * 1e3,
                       (cuda_kernels(long) - cuda_kernels(short)) / steps,
                       (host_syncs(long) - host_syncs(short)) / steps, floor_ms)


def decode_row(case: str, measured: DecodeSteps, layers: int, eager: DecodeSteps | None = None) -> Row:
    """Decode tokens/s, CUDA kernels and host syncs per decode step, each bounded: tokens/s at least
    DECODE_ROOFLINE_FLOOR of the card's roofline (the step's ``floor_ms`` over its time), kernels within
    DECODE_KERNELS_PER_LAYER a layer plus DECODE_KERNELS_OUTSIDE_LAYERS, the host syncs of one look
    every rollout.host_check_every steps, and (``eager``: the same model's eager steps, given for the
    compiled step) the compiled step no slower than the eager one."""
    from megacispo.rollout.config import RolloutConfig

    kernel_bound = DECODE_KERNELS_PER_LAYER * layers + DECODE_KERNELS_OUTSIDE_LAYERS
    sync_bound = 1 / RolloutConfig().steps_between_looks(on_gpu=True)
    failures = [f"{measured.kernels:.1f} kernels > {kernel_bound}"] if not measured.kernels <= kernel_bound else []
    if not measured.host_syncs <= sync_bound:
        failures.append(f"{measured.host_syncs:.2f} host syncs > {sync_bound:g}")
    bound = f"kernels <= {kernel_bound}, host syncs <= {sync_bound:g} per step"
    floor = DECODE_ROOFLINE_FLOOR["compiled" if eager is not None else "eager"]
    bound = f"tok/s >= {floor:.1%} of roofline, {bound}"
    roofline = "roofline unknown (pass --hbm-tbps)"
    if measured.floor_ms is not None:
        fraction = measured.floor_ms / measured.step_ms
        roofline = f"{fraction:.2%} of roofline"
        if not fraction >= floor:
            failures.append(f"{fraction:.2%} of roofline < {floor:.1%}")
    if eager is not None:
        bound += ", ms <= eager's"
        if not measured.step_ms <= eager.step_ms:
            failures.append(f"{measured.step_ms:.2f} ms per step > eager's {eager.step_ms:.2f}")
    return Row("decode", case, bound=bound, failure="; ".join(failures),
               value=f"{measured.slots / measured.step_ms * 1e3:,.0f} tok/s ({roofline}); {measured.step_ms:.2f} ms, "
                     f"{measured.kernels:.1f} kernels, {measured.host_syncs:.2f} host syncs per step",
               note=f"over {DECODE_LONG - DECODE_SHORT} steps, prompts of {DECODE_PROMPT_TOKENS} tokens"
                    + ("" if measured.floor_ms is None else f"; roofline {measured.floor_ms * 1e3:.1f} us per step"))


def cuda_kernels(step: Callable[[], None]) -> int:
    """The CUDA kernels ``step`` ran, as torch.profiler records them (copies and fills not counted)."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profile:
        step()
        torch.cuda.synchronize()
    return sum(event.device_type == torch.autograd.DeviceType.CUDA and not event.name.startswith(("Memcpy", "Memset"))
               for event in profile.events())


def host_syncs(step: Callable[[], None]) -> int:
    """The host syncs ``step`` made: the warnings torch.cuda.set_sync_debug_mode("warn") gives for each."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(warning.message) for warning in caught)


# ---------------------------------------------------------------------------------------------
# 5. The driver
# ---------------------------------------------------------------------------------------------

SFT_STEPS = 8
RL_STEPS = 2
RL_UPDATES = 2
SCORED_SEQUENCES = 4
# tests/support/reward_fixtures.py, loaded by the trainer as module:function.
SPREAD_REWARD = "megacispo.testing.reward_fixtures:code_point_parity"
# torchrun's variables, which init_distributed also sets in this process (section 2): a child that
# inherited them would join this process's world instead of the one its torchrun makes.
DISTRIBUTED_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                   "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
CONSOLE_STEP = re.compile(r"step (\d+) \| (.*)")
ERROR_LINE = re.compile(r"^(?:\[rank\d+\]: )?((?:[\w.]*(?:Error|Exception)|error)\b.*)$", re.MULTILINE)


@dataclass
class DriverInputs:
    """What every driver run shares: the task data, the tokenizer, the config and the sequences to score."""

    root: Path
    config: Path
    score_tokens: Path


@dataclass
class Budget:
    """The seconds the whole check may run (--budget-s; 0: no limit), counted from its start: past it
    nothing more starts, so the tables print before gpu_check.sh's timeout ends the process."""

    seconds: float
    started: float = field(default_factory=time.perf_counter)

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.started) if self.seconds else math.inf

    def spent(self) -> str:
        """Why a part did not run, once the budget is spent."""
        return (f"not run: the check's time budget of {self.seconds:.0f} s is spent (--budget-s; gpu_check.sh: "
                f"TIME_LIMIT_S - 20); leave sections out with --skip or raise TIME_LIMIT_S")


@dataclass
class DriverRun:
    """The driver stages of one weight dtype, in a run directory of their own under the inputs' root."""

    inputs: DriverInputs
    dtype: str
    env: dict[str, str]
    timeout_s: float
    gpus: int
    """CUDA GPUs the driver's processes may use (0: the CPU twin, whose gloo processes need none)."""
    fp8_recipe: str = "tensorwise"
    budget: Budget = field(default_factory=lambda: Budget(0))

    @property
    def run_dir(self) -> Path:
        return self.inputs.root / self.dtype

    @property
    def checkpoints(self) -> Path:
        return self.run_dir / "checkpoints"

    def config_args(self, *overrides: str, run_dir: Path | None = None) -> list[str]:
        """The config and the settings of this dtype's runs; ``run_dir`` (default: the dtype's own) is
        where a run writes, the SFT checkpoint it starts from stays the dtype's."""
        settings = [f"train.run_dir={run_dir or self.run_dir}", f"sft.out={self.run_dir / 'sft'}",
                    f"train.load={self.run_dir / 'sft' / 'checkpoints'}", f"precision.params_dtype={self.dtype}",
                    *overrides]
        return ["--config", str(self.inputs.config), *(arg for setting in settings for arg in ("--set", setting))]

    def launch(self, stage: str, module: str, *args: str, processes: int = 1) -> str:
        """``torchrun --standalone --nproc-per-node processes -m module args``; its output. It runs
        for at most timeout_s, and not past the budget."""
        left = self.budget.left()
        if left <= 0:
            raise StageFailed(self.budget.spent())
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes),
                   "-m", module, *args]
        return run_logged(command, self.run_dir / "logs" / f"{stage}.log", self.env, min(self.timeout_s, left),
                          cwd=self.inputs.root)


def child_env(device: str) -> dict[str, str]:
    env = {name: value for name, value in os.environ.items() if name not in DISTRIBUTED_ENV}
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # no CUDA: the driver starts gloo and keeps every tensor on the CPU
    return env


def run_logged(command: list[str], log: Path, env: dict[str, str], timeout_s: float, cwd: Path) -> str:
    """Run ``command`` in ``cwd`` with its output in ``log``; its output, or StageFailed with the error
    it ended on. The driver's processes run in the check's run directory, not in the repository: there
    the checkout's megacispo/ folder would shadow the installed package (on a lent GPU, the wheel)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        process = subprocess.Popen(command, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            code = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            stop(process)
            code = None
    output = log.read_text()
    if code == 0:
        return output
    print(f"--- {log} (last 40 lines)\n" + "\n".join(output.splitlines()[-40:]), file=sys.stderr, flush=True)
    if code is None:
        raise StageFailed(f"timed out after {timeout_s:.0f} s (log: {log})")
    raise StageFailed(f"exit {code}: {error_line(output)}")


def stop(process: subprocess.Popen) -> None:
    # SIGTERM lets torchrun stop its workers, which run in sessions of their own (a group kill misses them).
    process.terminate()
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def error_line(output: str) -> str:
    """The error a failed process ended on: its last exception line other than torchrun's summary."""
    errors = [line for line in ERROR_LINE.findall(output) if "ChildFailedError" not in line]
    lines = [line for line in output.splitlines() if line.strip()]
    return (errors[-1] if errors else lines[-1] if lines else "no output")[:300]


def console_values(output: str, label: str) -> dict[int, float]:
    """{step: value} of one field of the console lines ("step 3 | loss 0.1234 | reward 0.250 | ...")."""
    values = {}
    # splitlines: a progress bar ends its line with a carriage return, then the step's line follows.
    for line in output.splitlines():
        match = CONSOLE_STEP.fullmatch(line)
        if match is None:
            continue
        for item in match.group(2).split(" | "):
            name, _, value = item.rpartition(" ")
            if name == label:
                values[int(match.group(1))] = float(value)
    return values


def require(condition: bool, message: str) -> None:
    if not condition:
        raise StageFailed(message)


def require_finite(values: dict[int, float], label: str, steps: list[int]) -> None:
    require(sorted(values) == steps, f"{label} logged at steps {sorted(values)}, expected {steps}")
    bad = {step: value for step, value in values.items() if not math.isfinite(value)}
    require(not bad, f"{label} not finite: {bad}")


def prepare_driver_inputs(root: Path) -> tuple[DriverInputs, str]:
    """The quick start's task data and tokenizer, made by its tools; a config that runs each stage in
    seconds; the sequences to score. Returns the inputs and a summary for the table."""
    data, tokenizer_dir = root / "data", root / "tokenizer"
    env = child_env("cpu")
    tools = [
        [sys.executable, str(REPO / "tools" / "make_task_data.py"), "--out", str(data), "--task", "addition",
         "--digits", "2", "--num-train", "64", "--num-test", "8", "--seed", "0"],
        [sys.executable, str(REPO / "tools" / "train_tokenizer.py"), "--input", str(data / "corpus.txt"),
         "--vocab-size", "512", "--out", str(tokenizer_dir)],
    ]
    for command in tools:
        run_logged(command, root / "logs" / f"{Path(command[1]).stem}.log", env, timeout_s=120, cwd=root)
    tokenizer = tokenizer_dir / "tokenizer.model"
    config = root / "driver.yaml"
    config.write_text(yaml.safe_dump(driver_config(data, tokenizer), sort_keys=False))
    score_tokens, vocab_size = write_score_tokens(data / "test.jsonl", tokenizer, root / "score_tokens.jsonl")
    return DriverInputs(root, config, score_tokens), f"64 train / 8 test prompts, tokenizer of {vocab_size} pieces"


def driver_config(data: Path, tokenizer: Path) -> dict:
    """The quick start's recipe at world size 1, shrunk to the fewest steps, prompts and tokens that
    still run every part of each stage."""
    return {
        "model": {"size": "tiny"},
        "data": {"train_prompts": str(data / "train.jsonl"), "test_prompts": str(data / "test.jsonl"),
                 "sft_pairs": str(data / "sft.jsonl"), "tokenizer": str(tokenizer)},
        "rollout": {"prompts_per_step": 4, "group_size": 4, "max_new_tokens": 4, "max_sampling_rounds": 2},
        # An untrained model earns exact_match's reward almost never: all advantages would be 0, and so
        # would the policy loss. A test fixture's reward spreads every group's rewards from step 1 on,
        # so the policy gradient that padded and cp compare is not 0.
        "rl": {"loss": {"name": "cispo", "params": {"eps_low": 1.0, "eps_high": 4.0}},
               "updates_per_rollout": RL_UPDATES, "reward": SPREAD_REWARD},
        "optimizer": {"lr": 1.0e-4, "clip_grad": 1.0},
        "train": {"steps": RL_STEPS, "micro_batch_size": 8},
        "sft": {"steps": SFT_STEPS, "batch_size": 16, "lr": 3.0e-3},
    }


def write_score_tokens(test_prompts: Path, tokenizer_path: Path, out: Path) -> tuple[Path, int]:
    """megacispo.score's input: held-out prompts with their answers, tokenized as SFT tokenizes them."""
    from megacispo.data.prompts import build_sft_example, load_prompts
    from megacispo.data.tokenizer import Tokenizer

    tokenizer = Tokenizer.load(tokenizer_path)
    records = load_prompts(test_prompts)[:SCORED_SEQUENCES]
    lines = [json.dumps({"tokens": build_sft_example(tokenizer, record).token_ids}) for record in records]
    out.write_text("".join(line + "\n" for line in lines))
    return out, tokenizer.vocab_size


def sft_stage(run: DriverRun) -> str:
    run.launch("sft", "megacispo.sft", *run.config_args())
    # SFT prints a console line every few steps under its progress bar; TensorBoard has every step.
    losses = {step: value for step, value in read_scalars(run.run_dir / "sft").get("sft/loss", [])}
    require_finite(losses, "sft_loss", list(range(1, SFT_STEPS + 1)))
    first, last = losses[1], losses[SFT_STEPS]
    require(last < first, f"the SFT loss did not fall: {first:.4f} -> {last:.4f}")
    return f"loss {first:.3f} -> {last:.3f} in {SFT_STEPS} steps"


def rl_stage(run: DriverRun) -> str:
    output = run.launch("rl", "megacispo.train", *run.config_args())
    steps = list(range(1, RL_STEPS + 1))
    losses, rewards = console_values(output, "loss"), console_values(output, "reward")
    require_finite(losses, "policy loss", steps)
    require_finite(rewards, "reward mean", steps)
    accuracy = re.search(r"held-out accuracy: (\S+) before RL, (\S+) after", output)
    require(accuracy is not None, "no held-out accuracy line at the end")
    return (f"per step: policy loss {per_step(losses, '.4f')}, reward mean {per_step(rewards, '.3f')} "
            f"({SPREAD_REWARD}); held-out acc {accuracy.group(1)} -> {accuracy.group(2)}")


def per_step(values: dict[int, float], spec: str) -> str:
    return " / ".join(f"{values[step]:{spec}}" for step in sorted(values))


# What the padded and cp stages' one RL step must give at the rl stage's first step, from the same SFT
# checkpoint and seed: the same samples, then what the training passes compute, within a tolerance
# (relative, absolute) per weight dtype (differently shaped rows add differently rounded sums).
SAME_SAMPLES = ("rollout/reward_mean", "loss/num_tokens")
FORWARD_METRICS = {"loss/policy_loss": "policy loss", "loss/entropy": "entropy",
                   "mismatch/abs_logp_diff_mean": "|old - rollout logp|", "perf/grad_norm": "grad norm"}
TOLERANCE = {"float32": (1e-3, 1e-5), "bfloat16": (5e-2, 2e-3)}
CP_SIZE = 2


def first_step(run_dir: Path) -> dict[str, float]:
    """The step-1 scalars of a run's TensorBoard events."""
    return {key: value for key, values in read_scalars(run_dir).items() for step, value in values if step == 1}


def one_step_as_rl(run: DriverRun, *overrides: str, run_dir: Path) -> list[str]:
    """The settings of one RL step in ``run_dir`` as the rl stage's first (``steps_as_rl``)."""
    return steps_as_rl(run, 1, *overrides, run_dir=run_dir)


def steps_as_rl(run: DriverRun, steps: int, *overrides: str, run_dir: Path) -> list[str]:
    """The settings of ``steps`` RL steps in ``run_dir`` on the rl stage's learning-rate schedule (its
    cosine decays over all of rl's updates), so that they follow rl's; without the held-out
    evaluation, which only rl checks."""
    return run.config_args(f"train.steps={steps}", f"optimizer.decay_steps={RL_STEPS * RL_UPDATES}",
                           "eval.greedy=false", *overrides, run_dir=run_dir)


def by_step(run_dir: Path, key: str) -> dict[int, float]:
    """{step: value} of one scalar of a run's TensorBoard events."""
    return dict(read_scalars(run_dir).get(key, []))


def step_one_as_rl(run: DriverRun, run_dir: Path, stage: str) -> str:
    """The step 1 of ``stage``'s run in ``run_dir`` against the rl stage's step 1; what both give."""
    reference, other = first_step(run.run_dir), first_step(run_dir)
    missing = [key for key in (*SAME_SAMPLES, *FORWARD_METRICS) if key not in reference or key not in other]
    require(not missing, f"no step-1 value of {missing} in {run_dir} or {run.run_dir}")
    for key in SAME_SAMPLES:
        require(math.isclose(other[key], reference[key], rel_tol=1e-6),
                f"{stage} sampled other rollouts than rl at step 1 ({key} {other[key]:.6g}, rl {reference[key]:.6g}): "
                f"nothing to compare")
    relative, absolute = TOLERANCE[run.dtype]
    values = {name: (other[key], reference[key]) for key, name in FORWARD_METRICS.items()}
    far = [f"{name} {value:.6g}, rl {expected:.6g}" for name, (value, expected) in values.items()
           if not math.isclose(value, expected, rel_tol=relative, abs_tol=absolute)]
    require(not far, f"step 1 differs from rl's beyond {relative:g} relative / {absolute:g} absolute: {'; '.join(far)}")
    return ", ".join(f"{name} {value:.4g} (rl {expected:.4g})" for name, (value, expected) in values.items())


def padded_stage(run: DriverRun) -> str:
    """One RL step in right-padded rows (train.pack_sequences = false) gives the packed rl stage's step 1."""
    run_dir = run.run_dir / "padded"
    run.launch("padded", "megacispo.train", *one_step_as_rl(run, "train.pack_sequences=false", run_dir=run_dir))
    return f"padded rows, step 1 as packed rl: {step_one_as_rl(run, run_dir, 'padded')}"


def cp_stage(run: DriverRun) -> str:
    """One RL step at CP = 2 on 2 processes (each holds half of every packed row) gives rl's step 1."""
    if 0 < run.gpus < CP_SIZE:
        raise StageSkipped(f"{run.gpus} CUDA GPU visible, CP = {CP_SIZE} needs {CP_SIZE} (GPU=0,1)")
    run_dir = run.run_dir / f"cp{CP_SIZE}"
    run.launch("cp", "megacispo.train", *one_step_as_rl(run, f"parallel.context_parallel_size={CP_SIZE}",
                                                        run_dir=run_dir), processes=CP_SIZE)
    return f"CP {CP_SIZE}, step 1 as rl: {step_one_as_rl(run, run_dir, 'cp')}"


# rollout.dtype = bfloat16 against fp32 or bf16 training: the mean |old - rollout log-prob| per token
# is bf16's rounding of the logits (4e-3 seen on the CPU twin); wrong weights or a broken compiled
# step give log-probs of another model.
BF16_ROLLOUT_GAP = 0.05
# FP8 GEMMs in training against the rollout's: e4m3 keeps 3 mantissa bits, the gap is larger than bf16's.
FP8_ROLLOUT_GAP = 0.1
LOGP_GAP = "mismatch/abs_logp_diff_mean"
# Bounds of the stages whose rollouts differ from rl's, checked at every step they run.
STEP_KEYS = {"loss/policy_loss": "policy loss", "rollout/reward_mean": "reward mean", LOGP_GAP: "|old - rollout logp|"}


def steps_within(values: dict[str, dict[int, float]], steps: list[int], gap_bound: float) -> str:
    """StageFailed unless every step has finite STEP_KEYS and a log-prob gap within ``gap_bound``;
    the values per step otherwise."""
    for key, name in STEP_KEYS.items():
        require_finite(values[key], name, steps)
    over = {step: gap for step, gap in values[LOGP_GAP].items() if not gap <= gap_bound}
    require(not over, f"|old - rollout logp| over {gap_bound:g} at step(s) {sorted(over)}: "
                      f"{', '.join(f'{over[step]:.3g}' for step in sorted(over))}")
    return ", ".join(f"{name} {per_step(values[key], '.4g')}" for key, name in STEP_KEYS.items())


def bf16_rollout_stage(run: DriverRun) -> str:
    """One RL step whose rollouts generate in bf16 through the compiled decode step (the GPU default
    for a run without TP, PP or EP): finite, with a log-prob gap of bf16's size."""
    run_dir = run.run_dir / "bf16_rollout"
    run.launch("bf16-rollout", "megacispo.train", *one_step_as_rl(
        run, "rollout.dtype=bfloat16", "rollout.compile_decode=true", run_dir=run_dir))
    values = {key: by_step(run_dir, key) for key in STEP_KEYS}
    result = steps_within(values, [1], BF16_ROLLOUT_GAP)
    rollout_s = by_step(run_dir, "perf/time_rollout_s").get(1, math.nan)
    return f"rollout.dtype bfloat16, compiled decode: {result} (gap <= {BF16_ROLLOUT_GAP:g}); rollout {rollout_s:.1f} s"


def fp8_stage(run: DriverRun) -> str:
    """rl's steps with FP8 GEMMs: finite rollouts and losses, a bounded log-prob gap at each step
    (step 2's rollouts use the weights of step 1's update); where step 1 samples what rl sampled,
    its policy loss and entropy within FP8_LOSS_BOUND of rl's."""
    from megacispo.models.te_specs import require_transformer_engine

    if run.dtype != "bfloat16":
        raise StageSkipped("FP8 trains bf16 weights: it runs in the bfloat16 half")
    try:
        require_transformer_engine(run.fp8_recipe)
    except ValueError as error:
        raise StageSkipped(str(error)) from None
    run_dir = run.run_dir / "fp8"
    run.launch("fp8", "megacispo.train", *steps_as_rl(run, RL_STEPS, f"precision.fp8={run.fp8_recipe}",
                                                        run_dir=run_dir))
    return fp8_result({key: by_step(run_dir, key) for key in (*STEP_KEYS, "loss/entropy", "loss/num_tokens")},
                      first_step(run.run_dir), run.fp8_recipe)


def fp8_result(values: dict[str, dict[int, float]], bf16_step_one: dict[str, float], recipe: str) -> str:
    """The fp8 stage's verdict on its scalars ``values`` and the bf16 rl stage's step 1."""
    result = f"fp8 {recipe}: {steps_within(values, list(range(1, RL_STEPS + 1)), FP8_ROLLOUT_GAP)}"
    for key in ("loss/entropy", "loss/num_tokens"):
        require_finite(values[key], key, list(range(1, RL_STEPS + 1)))
    fp8_step_one = {key: steps[1] for key, steps in values.items()}
    if not all(math.isclose(fp8_step_one[key], bf16_step_one[key], rel_tol=1e-6) for key in SAME_SAMPLES):
        return (f"{result}; step 1 sampled other rollouts than bf16 rl (reward mean "
                f"{fp8_step_one['rollout/reward_mean']:.4g}, rl {bf16_step_one['rollout/reward_mean']:.4g}): "
                f"losses not compared")
    gaps = {name: abs(fp8_step_one[key] - bf16_step_one[key])
            for key, name in (("loss/policy_loss", "policy loss"), ("loss/entropy", "entropy"))}
    over = over_bound({f"|{name} - rl's|": gap for name, gap in gaps.items()}, FP8_LOSS_BOUND)
    require(not over, f"step 1, the same samples as bf16 rl: {over}")
    return f"{result}; step 1 as bf16 rl: " + ", ".join(f"|{name} - rl's| {gap:.2g}" for name, gap in gaps.items())


def tp_ep_stage(run: DriverRun) -> str:
    """One RL step at TP = 2 + EP = 2 gives rl's step 1: 4 processes with the experts split by TP 2
    too where 4 GPUs are visible, else 2 processes with expert TP 1 (the CPU twin: 2)."""
    if 0 < run.gpus < 2:
        raise StageSkipped(f"{run.gpus} CUDA GPU visible, TP = 2 + EP = 2 needs 2 (GPU=0,1)")
    processes = 4 if run.gpus >= 4 else 2
    expert_tp = processes // 2
    run_dir = run.run_dir / "tp2_ep2"
    run.launch("tp2-ep2", "megacispo.train", *one_step_as_rl(
        run, "parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true",
        "parallel.expert_model_parallel_size=2", f"parallel.expert_tensor_parallel_size={expert_tp}",
        run_dir=run_dir), processes=processes)
    return (f"{processes} processes, TP 2, EP 2, expert TP {expert_tp}, step 1 as rl: "
            f"{step_one_as_rl(run, run_dir, 'tp2-ep2')}")


def rollout_ranks_stage(run: DriverRun) -> str:
    """rl's steps with placement.rollout_ranks = 1: 1 training process, 1 that generates on weights
    it gets by a sync before every step's rollout. Their samples are not rl's (a rollout process
    draws its own prompt rounds), so what is compared is the train/rollout log-prob gap."""
    if 0 < run.gpus < 2:
        raise StageSkipped(f"{run.gpus} CUDA GPU visible, a training and a rollout process need 2 (GPU=0,1)")
    run_dir = run.run_dir / "rollout_ranks"
    run.launch("rollout-ranks", "megacispo.train", *steps_as_rl(run, RL_STEPS, "placement.rollout_ranks=1",
                                                                  run_dir=run_dir), processes=2)
    keys = (*STEP_KEYS, "perf/weight_sync_s")
    return rollout_ranks_result({key: by_step(run_dir, key) for key in keys}, by_step(run.run_dir, LOGP_GAP),
                                TOLERANCE[run.dtype][1])


def rollout_ranks_result(values: dict[str, dict[int, float]], rl_gaps: dict[int, float], absolute: float) -> str:
    """The rollout-ranks stage's verdict: a weight sync at every step, and a log-prob gap no larger
    than twice rl's at the same step plus ``absolute``: the synced weights are the trainer's (a
    rollout on other weights, stale ones included, gives log-probs of another model)."""
    steps = list(range(1, RL_STEPS + 1))
    require_finite(values["perf/weight_sync_s"], "weight sync seconds", steps)
    unsynced = [step for step, seconds in values["perf/weight_sync_s"].items() if not seconds > 0]
    require(not unsynced, f"no weight sync at step(s) {unsynced}")
    result = steps_within(values, steps, math.inf)
    bounds = {step: 2 * rl_gaps[step] + absolute for step in steps}
    over = [f"step {step}: {values[LOGP_GAP][step]:.3g} > {bounds[step]:.3g}" for step in steps
            if not values[LOGP_GAP][step] <= bounds[step]]
    require(not over, f"|old - rollout logp| over 2 x rl's + {absolute:g}: {'; '.join(over)}")
    return (f"1 training + 1 rollout process: {result}; weight sync {per_step(values['perf/weight_sync_s'], '.2f')} s; "
            f"gap <= 2 x rl's {per_step(rl_gaps, '.3g')} + {absolute:g}")


# The tiny M2 of the vllm stage: 32-wide heads (vLLM's CPU attention, the twin's, has no kernel for 16).
VLLM_M2 = ("model.size=tiny-m2", "model.head_dim=32", "model.rotary_dim=16")


def vllm_stage(run: DriverRun) -> str:
    """RL steps of a random tiny M2 (no SFT: it is M1's) with rollout.engine = vllm, vLLM in the training
    process: started from the config alone, given the weights by a sync at the start and after every step,
    each sync checked by the run (it stops when the probe's log-probs differ beyond the tolerance) and
    timed; vLLM's sampled log-probs within bf16's gap of the training engine's old log-probs."""
    from megacispo.rollout.vllm_install import vllm_version

    try:
        version = vllm_version()
    except ValueError as error:
        raise StageSkipped(str(error)) from None
    run_dir = run.run_dir / "vllm"
    run.launch("vllm", "megacispo.train", *steps_as_rl(run, RL_STEPS, *VLLM_M2, "rollout.engine=vllm", 'train.load=""',
                                                       run_dir=run_dir))
    steps = list(range(1, RL_STEPS + 1))
    keys = (*STEP_KEYS, "perf/weight_sync_s", "rollout/vllm_probe_max_abs_diff")
    values = {key: by_step(run_dir, key) for key in keys}
    result = steps_within({key: values[key] for key in STEP_KEYS}, steps, BF16_ROLLOUT_GAP)
    require_finite(values["perf/weight_sync_s"], "weight sync seconds", steps)
    require_finite(values["rollout/vllm_probe_max_abs_diff"], "probe log-prob difference", steps)
    rollout_s = per_step(by_step(run_dir, "perf/time_rollout_s"), ".2f")
    return (f"vLLM {version}, tiny M2: {result} (gap <= {BF16_ROLLOUT_GAP:g}); weight sync "
            f"{per_step(values['perf/weight_sync_s'], '.2f')} s, probe |diff| "
            f"{per_step(values['rollout/vllm_probe_max_abs_diff'], '.2g')}; rollout {rollout_s} s")


def save_stage(run: DriverRun) -> str:
    """The checkpoint the RL run saved at its end: complete, of its last step, its optimizer and dtype."""
    from megacispo.checkpoint.distributed import complete_checkpoints, read_meta

    checkpoints = complete_checkpoints(run.checkpoints)
    require(bool(checkpoints), f"no complete checkpoint under {run.checkpoints}")
    meta = read_meta(checkpoints[-1])
    require(meta["step"] == RL_STEPS, f"the newest checkpoint is of step {meta['step']}, expected {RL_STEPS}")
    require(meta["has_optimizer"], "the checkpoint has no optimizer state")
    saved_dtype = meta["config"]["precision"]["params_dtype"]
    require(saved_dtype == run.dtype, f"the checkpoint's config says {saved_dtype} weights, the run {run.dtype}")
    size = sum(file.stat().st_size for file in checkpoints[-1].rglob("*") if file.is_file())
    return f"{checkpoints[-1].name}: model + optimizer + RNG, {size / 2**20:.1f} MiB (written by rl)"


def resume_stage(run: DriverRun) -> str:
    from megacispo.checkpoint.distributed import latest_checkpoint, read_meta

    output = run.launch("resume", "megacispo.train", *run.config_args(f"train.steps={RL_STEPS + 1}"), "--resume")
    # A run that started over would log steps 1..3; a resumed one logs only the step after the checkpoint.
    losses = console_values(output, "loss")
    require_finite(losses, "policy loss", [RL_STEPS + 1])
    newest = latest_checkpoint(run.checkpoints)
    require(newest is not None and read_meta(newest)["step"] == RL_STEPS + 1,
            f"no checkpoint of step {RL_STEPS + 1} under {run.checkpoints}")
    return f"step {RL_STEPS} -> {RL_STEPS + 1}: policy loss {losses[RL_STEPS + 1]:.4f}, saved {newest.name}"


def score_stage(run: DriverRun) -> str:
    """megacispo.score on the run's newest checkpoint: one finite log-prob <= 0 per next token."""
    out = run.run_dir / "scores.jsonl"
    run.launch("score", "megacispo.score", "--load", str(run.checkpoints), "--tokens",
               str(run.inputs.score_tokens), "--out", str(out))
    require(out.is_file(), f"megacispo.score wrote no {out}")
    scored = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    require(len(scored) == SCORED_SEQUENCES, f"{len(scored)} scored sequences, expected {SCORED_SEQUENCES}")
    logprobs = []
    for record in scored:
        require(len(record["logprobs"]) == len(record["tokens"]) - 1,
                f"{len(record['logprobs'])} log-probs for {len(record['tokens'])} tokens")
        logprobs += record["logprobs"]
    outside = [value for value in logprobs if not (math.isfinite(value) and value <= 0)]
    require(not outside, f"{len(outside)} log-probs outside (-inf, 0], e.g. {outside[:3]}")
    return f"log-prob sum {sum(logprobs):.2f} over {len(logprobs)} tokens of {len(scored)} sequences"


@dataclass(frozen=True)
class Stage:
    """A driver stage: what it runs, the stage whose output it needs, and what it holds its run to."""

    name: str
    action: Callable[[DriverRun], str]
    needs: str | None
    bound: str


SAME_AS_RL = "rl's samples; policy loss, entropy, gap and grad norm as rl's step 1 (fp32 1e-3, bf16 5e-2)"
DRIVER_STAGES: tuple[Stage, ...] = (
    Stage("sft", sft_stage, None, "finite losses; the loss falls"),
    Stage("rl", rl_stage, "sft", "finite policy loss and reward each step; held-out accuracy reported"),
    Stage("padded", padded_stage, "rl", SAME_AS_RL),
    Stage("cp", cp_stage, "rl", SAME_AS_RL),
    Stage("bf16-rollout", bf16_rollout_stage, "rl", f"finite; |old - rollout logp| <= {BF16_ROLLOUT_GAP:g}"),
    Stage("fp8", fp8_stage, "rl", f"finite; gap <= {FP8_ROLLOUT_GAP:g}; on rl's samples |loss - rl's| <= "
                                  f"{FP8_LOSS_BOUND:g}"),
    Stage("tp2-ep2", tp_ep_stage, "rl", SAME_AS_RL),
    Stage("rollout-ranks", rollout_ranks_stage, "rl", "a weight sync each step; gap <= 2 x rl's + tolerance"),
    Stage("vllm", vllm_stage, None, f"a checked weight sync each step; gap <= {BF16_ROLLOUT_GAP:g}"),
    Stage("save", save_stage, "rl", "a complete checkpoint of the last step, optimizer included, in the run's dtype"),
    Stage("resume", resume_stage, "save", "resumes after the checkpoint's step and saves the next"),
    Stage("score", score_stage, "save", "a finite log-prob <= 0 per next token"),
)
LEAF_STAGES = tuple(stage.name for stage in DRIVER_STAGES if stage.name not in {other.needs for other in DRIVER_STAGES})


def driver_checks(args: argparse.Namespace, report: Report) -> None:
    device = "cpu" if args.cpu else "cuda"
    root = Path(args.run_dir or tempfile.mkdtemp(prefix="gpu_check_driver_")).resolve()
    root.mkdir(parents=True, exist_ok=True)
    prepared: list[DriverInputs] = []

    def prepare() -> str:
        inputs, summary = prepare_driver_inputs(root)
        prepared.append(inputs)
        return summary

    if report.run_stage("data + tokenizer", "-", "the quick start's tools make them", prepare):
        gpus = torch.cuda.device_count() if device == "cuda" else 0
        for dtype in args.driver_dtype:
            run = DriverRun(prepared[0], dtype, child_env(device), args.stage_timeout, gpus, args.fp8_recipe,
                            report.budget)
            run_driver_stages(run, report, args.skip_stage)
    if args.run_dir:
        print(f"driver runs kept in {root}", file=sys.stderr)
    elif any(row.failure for row in report.rows if row.check == "driver"):
        print(f"driver runs kept for inspection in {root}", file=sys.stderr)
    else:
        shutil.rmtree(root, ignore_errors=True)


def run_driver_stages(run: DriverRun, report: Report, skipped: Iterable[str] = ()) -> None:
    passed: set[str] = set()
    for stage in DRIVER_STAGES:
        if stage.name in skipped:
            report.add(stage_row(stage.name, run.dtype, stage.bound, "skipped: --skip-stage", skipped=True))
        elif stage.needs is not None and stage.needs not in passed:
            report.add(stage_row(stage.name, run.dtype, stage.bound, f"not run: it needs {stage.needs}",
                                 failure=f"not run: it needs {stage.needs}"))
        elif report.run_stage(stage.name, run.dtype, stage.bound, lambda: stage.action(run)):
            passed.add(stage.name)


SECTIONS = {"lightning": lightning_checks, "train": train_checks, "loss": loss_checks, "decode": decode_checks,
            "driver": driver_checks}


def triton_version() -> str:
    return importlib.metadata.version("triton") if importlib.util.find_spec("triton") else "none"


@dataclass(frozen=True)
class Part:
    """One call's share of the check on a lent GPU (--part), which gives 15 minutes to two calls and
    their machine's start: each part is bounded by gpu_check.sh --device's TIME_LIMIT_S (400 s)."""

    sections: tuple[str, ...]
    driver_dtypes: tuple[str, ...]


PARTS = {
    # What tells most first: the kernels, decode (the compiled step included) and the bf16 driver, whose
    # RL steps are a user's first run.
    1: Part(("lightning", "decode", "driver"), ("bfloat16",)),
    2: Part(("train", "loss", "driver"), ("float32",)),
}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.cpu:
        require_cuda()
    report = Report(Budget(args.budget_s), args.rows_file)
    started = time.perf_counter()
    chosen = ["driver"] if args.cpu else [name for name in SECTIONS if name not in args.skip]
    for name in chosen:
        if report.budget.left() <= 0:
            report.add(Row(name, "section", failure=report.budget.spent()))
            continue
        print(f"{name} ...", file=sys.stderr, flush=True)
        with report.check(name, "section"):
            SECTIONS[name](args, report)
    if args.cpu:
        title = f"# GPU check's CPU twin: the driver on the CPU (gloo, torch {torch.__version__})"
    else:
        part = "" if args.part is None else f", part {args.part}"
        title = (f"# GPU check on {torch.cuda.get_device_name()} (torch {torch.__version__}, "
                 f"CUDA {torch.version.cuda}, Triton {triton_version()}{part})")
    failed = sum(bool(row.failure) for row in report.rows)
    print(f"{title}, {time.perf_counter() - started:.0f} s: {len(report.rows)} rows, {failed} failed\n")
    print(report.table())
    if any(row.check == "driver" for row in report.rows):
        print(f"\ndriver: torchrun of the tiny model, 1 process (cp: {CP_SIZE}, tp2-ep2: 2 or 4, rollout-ranks: 2)")
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
