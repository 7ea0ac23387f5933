"""Metrics of a run: one pipeline, one logging rank.

Every rank computes its metrics and the caller reduces them to the step's values (for the loss
terms, ``losses.reduce_metrics``); a ``MetricsLogger`` then writes them on the logging rank only:
TensorBoard event files under ``run_dir/tensorboard``, one readable console line per step and,
with logging.wandb, a Weights & Biases run (files under ``run_dir/wandb``) with the same keys and steps.

Keys are namespaced ``group/name`` (TensorBoard draws one section per group): ``rollout/...``,
``loss/...``, ``train/...``, ``perf/...``, ``moe/...``. Each scalar is logged against the step and,
when the caller passes the number of consumed samples, also against it under
``<key>_vs_samples`` (next to the step chart, as Megatron logs "<name> vs samples"); W&B gets
the count as one more metric, ``consumed_samples``, which its charts can take as their x-axis.
"""

from __future__ import annotations

import contextlib
import math
import re
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Iterator, Mapping, Sequence

import torch

from megacispo.config import Config, to_dict
from megacispo.metrics.config import LoggingConfig

TENSORBOARD_DIR = "tensorboard"
VS_SAMPLES_SUFFIX = "_vs_samples"
CONSUMED_SAMPLES_KEY = "consumed_samples"
WANDB_INSTALL = "pip install -e .[wandb]"
# "@" for evaluation's pass@k and mean@k.
_KEY = re.compile(r"[A-Za-z0-9_.@\-]+(/[A-Za-z0-9_.@\-]+)+")
_PHASE = re.compile(r"[a-z0-9_]+")
_PHASE_KEY = re.compile(r"perf/time_([a-z0-9_]+)_s")

# The console line: (key, label, format spec); keys absent from a step are left out.
CONSOLE_FIELDS: tuple[tuple[str, str, str], ...] = (
    ("sft/loss", "sft_loss", ".4f"),
    ("eval/accuracy", "eval_acc", ".3f"),
    ("loss/policy_loss", "loss", ".4f"),
    ("rollout/reward_mean", "reward", ".3f"),
    ("rollout/accuracy", "acc", ".3f"),
    ("loss/clip_frac_high", "clip_hi", ".4f"),
    ("loss/clip_frac_low", "clip_lo", ".4f"),
    ("perf/tokens_per_s", "tok/s", ".0f"),
)


# ---------------------------------------------------------------------------------------------
# Which rank logs
# ---------------------------------------------------------------------------------------------


def is_logging_rank() -> bool:
    """Whether this process logs, from Megatron-Core's parallel state (rank 0 when torch.distributed
    runs without it, True without torch.distributed)."""
    if not torch.distributed.is_initialized():
        return True
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return torch.distributed.get_rank() == 0
    return (
        parallel_state.is_pipeline_last_stage(ignore_virtual=True)
        and parallel_state.get_tensor_model_parallel_rank() == 0
        and parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0
    )


# ---------------------------------------------------------------------------------------------
# Metric helpers
# ---------------------------------------------------------------------------------------------


def pearson_correlation(x: torch.Tensor, y: torch.Tensor) -> float:
    """Pearson correlation of two 1-D tensors of equal length, computed in float64 (CISPO.md: the
    training-engine vs rollout-engine token probabilities; M1 measured 0.987 before its fix).

    A constant input (zero variance), or fewer than 2 values, gives NaN: the correlation is undefined
    there (as in numpy and scipy), and 1.0 would hide a degenerate probability pipeline.
    """
    if x.dim() != 1 or y.dim() != 1 or x.shape != y.shape:
        raise ValueError(
            f"x and y must be 1-D tensors of the same length, got shapes {tuple(x.shape)} and "
            f"{tuple(y.shape)}: pass the valid tokens' probabilities, flattened (e.g. probs[loss_mask])."
        )
    if x.numel() < 2:
        return math.nan
    x_centered = x.detach().double() - x.detach().double().mean()
    y_centered = y.detach().double() - y.detach().double().mean()
    denominator = x_centered.norm() * y_centered.norm()
    if denominator == 0:
        return math.nan
    # Clamped: rounding can put a perfect correlation a hair outside [-1, 1].
    return float(((x_centered * y_centered).sum() / denominator).clamp(-1.0, 1.0))


def moe_load_balance(tokens_per_expert_by_layer: torch.Tensor | Sequence[torch.Tensor]) -> dict[str, float]:
    """Expert load balance from the tokens each expert received, per MoE layer.

    ``tokens_per_expert_by_layer``: [num_layers, num_experts] counts (or one 1-D tensor per layer),
    summed over the step and over the ranks that share the layer (data and expert parallel).
    Returns ``moe/load_max_over_mean_layer{i}`` (1.0: perfectly balanced; num_experts: all tokens
    on one expert), their mean over layers ``moe/load_max_over_mean`` and the worst layer's value
    ``moe/load_max_over_mean_max``. A layer that received no tokens has no defined balance: NaN,
    and it is left out of the mean and max.
    """
    layers = list(tokens_per_expert_by_layer)
    if not layers:
        raise ValueError("tokens_per_expert_by_layer is empty: pass one row of expert token counts per MoE layer.")
    metrics: dict[str, float] = {}
    defined = []
    for index, counts in enumerate(layers):
        # On the host: a handful of counts per layer, read back as Python floats.
        counts = torch.as_tensor(counts, device="cpu").detach().double()
        if counts.dim() != 1 or counts.numel() == 0:
            raise ValueError(
                f"tokens_per_expert_by_layer[{index}] has shape {tuple(counts.shape)}: each layer needs a "
                f"1-D tensor of per-expert token counts."
            )
        if (counts < 0).any():
            raise ValueError(f"tokens_per_expert_by_layer[{index}] has negative counts: {counts.tolist()}")
        mean = counts.mean()
        ratio = float(counts.max() / mean) if mean > 0 else math.nan
        metrics[f"moe/load_max_over_mean_layer{index}"] = ratio
        if not math.isnan(ratio):
            defined.append(ratio)
    metrics["moe/load_max_over_mean"] = sum(defined) / len(defined) if defined else math.nan
    metrics["moe/load_max_over_mean_max"] = max(defined) if defined else math.nan
    return metrics


class Timer:
    """Wall-clock seconds per phase of a step: ``with timer("rollout"): ...``, then
    ``timer.metrics()`` gives ``{"perf/time_rollout_s": ...}`` and starts the next step's count.
    A phase entered several times in a step adds up. ``device``: the run's; a GPU is waited for at
    both ends of each phase."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self._device = torch.device(device)
        self._seconds: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        if not _PHASE.fullmatch(phase):
            raise ValueError(f"phase = {phase!r}: use lower-case letters, digits and underscores (e.g. 'old_logp').")
        self._synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._synchronize()
            self._seconds[phase] += time.perf_counter() - start

    def metrics(self, reset: bool = True) -> dict[str, float]:
        values = {f"perf/time_{phase}_s": seconds for phase, seconds in self._seconds.items()}
        if reset:
            self._seconds.clear()
        return values

    def _synchronize(self) -> None:
        # GPU work is asynchronous: without a sync a phase would be charged for the previous one's kernels.
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)


# ---------------------------------------------------------------------------------------------
# The logger
# ---------------------------------------------------------------------------------------------


def _check_keys(metrics: Mapping[str, object]) -> None:
    for key in metrics:
        if not isinstance(key, str) or not _KEY.fullmatch(key):
            raise ValueError(
                f"metric key {key!r} is not namespaced: use 'group/name' with letters, digits, '_', '.', '-', '@' "
                f"(e.g. 'rollout/reward_mean', 'loss/clip_frac_high', 'eval/pass@4')."
            )


def _as_float(key: str, value: float | int | torch.Tensor) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"metric {key!r} is a tensor of shape {tuple(value.shape)}: log scalars (reduce it first)."
            )
        return float(value.detach().float().item())
    return float(value)


def format_console_line(step: int, metrics: Mapping[str, float]) -> str:
    """One line with the step's key numbers, e.g.
    ``step 12 | loss 0.1234 | reward 0.512 | ... | time rollout 1.20s update 0.45s``."""
    parts = [f"step {step}"]
    parts += [f"{label} {metrics[key]:{spec}}" for key, label, spec in CONSOLE_FIELDS if key in metrics]
    phases = [
        f"{match.group(1)} {value:.2f}s"
        for key, value in metrics.items()
        if (match := _PHASE_KEY.fullmatch(key))
    ]
    if phases:
        parts.append("time " + " ".join(phases))
    return " | ".join(parts)


@dataclass(frozen=True)
class WandbSettings:
    """The Weights & Biases run a MetricsLogger also writes to (logging.wandb)."""

    project: str
    name: str
    config: Mapping[str, Any] = field(default_factory=dict)
    """Shown as the W&B run's config: the run's resolved config."""


def _import_wandb() -> ModuleType:
    try:
        import wandb
    except ImportError:
        raise ValueError(
            f"logging.wandb = true but the wandb package is not installed: {WANDB_INSTALL} "
            "(or set logging.wandb = false)"
        ) from None
    return wandb


def check_logging(logging_config: LoggingConfig) -> None:
    """The start-up check of the logging section (megacispo.startup.check_config runs it): W&B is an optional
    extra, and a run that asks for it must fail before any model is built, not at its first step."""
    if not logging_config.wandb:
        return
    if not logging_config.wandb_project:
        raise ValueError("logging.wandb_project is empty: name the W&B project (e.g. megacispo)")
    _import_wandb()


class MetricsLogger:
    """Writes a run's scalars on the logging rank (``enabled``); elsewhere every call does nothing.

    ``MetricsLogger(run_dir, enabled=is_logging_rank())``, or ``MetricsLogger.from_config(config,
    enabled)``; ``log(step, metrics)`` once per step; ``close()`` at the end (or use it as a context
    manager). The event file is created by the first ``log``: a run that fails before it leaves no
    TensorBoard files. The W&B run (``wandb``) starts here, so that a login or network problem shows
    at start-up rather than after the first rollout.
    """

    def __init__(self, run_dir: str | Path, enabled: bool, console: bool = True,
                 wandb: WandbSettings | None = None) -> None:
        self.enabled = enabled
        self.console = console
        self.log_dir = Path(run_dir) / TENSORBOARD_DIR
        self._writer = None
        self._wandb_run = _start_wandb(Path(run_dir), wandb) if enabled and wandb is not None else None

    @classmethod
    def from_config(cls, config: Config, enabled: bool, run_dir: str | Path | None = None,
                    console: bool = True) -> MetricsLogger:
        """The logger of a run of ``config`` under ``run_dir`` (default: train.run_dir), writing to W&B
        too when logging.wandb: its run is named logging.wandb_run_name or else train.run_dir's name.
        ``console``: print each step's line (SFT prints its own, every few steps, under its progress bar)."""
        logging_config = config.logging
        wandb = None
        if enabled and logging_config.wandb:
            wandb = WandbSettings(
                project=logging_config.wandb_project,
                name=logging_config.wandb_run_name or Path(config.train.run_dir).name,
                config=to_dict(config),
            )
        return cls(run_dir or config.train.run_dir, enabled, console=console, wandb=wandb)

    def log(
        self,
        step: int,
        metrics: Mapping[str, float | int | torch.Tensor],
        consumed_samples: int | None = None,
    ) -> None:
        """Log one step's scalars (floats or one-element tensors) against ``step`` and, if given,
        against ``consumed_samples``. Keys are checked on every rank, so a bad key fails everywhere."""
        _check_keys(metrics)
        if not self.enabled:
            return
        values = {key: _as_float(key, value) for key, value in metrics.items()}
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(self.log_dir))
        for key, value in values.items():
            self._writer.add_scalar(key, value, step)
            if consumed_samples is not None:
                self._writer.add_scalar(key + VS_SAMPLES_SUFFIX, value, consumed_samples)
        # Once per step: TensorBoard sees progress at once and a crash loses nothing.
        self._writer.flush()
        if self._wandb_run is not None:
            samples = {} if consumed_samples is None else {CONSUMED_SAMPLES_KEY: consumed_samples}
            self._wandb_run.log({**values, **samples}, step=step)
        if self.console:
            print(format_console_line(step, values), flush=True)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def _start_wandb(run_dir: Path, settings: WandbSettings) -> Any:
    """A W&B run whose files go under ``run_dir/wandb`` (offline too: WANDB_MODE=offline)."""
    wandb = _import_wandb()
    # wandb.init writes its wandb/ folder inside ``dir`` and wants ``dir`` to exist.
    run_dir.mkdir(parents=True, exist_ok=True)
    return wandb.init(project=settings.project, name=settings.name, config=dict(settings.config), dir=str(run_dir))


def read_scalars(run_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of a run's TensorBoard events, by key: [(step, value), ...] in logged order
    (values as TensorBoard stores them: float32). For tests and tools."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log_dir = Path(run_dir) / TENSORBOARD_DIR
    if not log_dir.is_dir():
        raise ValueError(f"{log_dir} does not exist: pass the run_dir a MetricsLogger wrote to on its logging rank.")
    accumulator = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {
        key: [(event.step, event.value) for event in accumulator.Scalars(key)]
        for key in accumulator.Tags()["scalars"]
    }
