"""Where an RL run starts: its checkpoints (--resume) or train.load, checked before anything is built."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from megacispo.checkpoint.distributed import CheckpointError, check_model, find_checkpoints, read_meta
from megacispo.checkpoint.formats import META_FILE
from megacispo.checkpoint.hf import check_start_weights
from megacispo.config import Config
from megacispo.data.prompts import PromptRecord, PromptSampler


@dataclass
class RunStart:
    """Where a run starts, checked by ``check_start`` before anything is built."""

    resuming: bool
    """--resume was asked for."""
    checkpoints: dict[Path, str | None]
    """With --resume, the run's checkpoints, oldest first, with why each does not verify (None when it
    does): the newest that loads is resumed. Empty: the run starts afresh, from train.load if set."""


def checkpoint_root(config: Config) -> Path:
    return Path(config.train.run_dir) / "checkpoints"


def check_start(config: Config, resume: bool, train_records: list[PromptRecord]) -> RunStart:
    """Check the checkpoints a run will read before anything is built: with ``resume`` the run's own
    (one at least must verify if there are any, and those must hold config.model and a sampler
    position over ``train_records``), else train.load's. CheckpointError naming the file and the fix."""
    root = checkpoint_root(config)
    checkpoints = find_checkpoints(root) if resume else {}
    verified = [path for path, problem in checkpoints.items() if problem is None]
    if checkpoints and not verified:
        problems = "; ".join(f"{path.name}: {problem}" for path, problem in checkpoints.items())
        raise CheckpointError(f"--resume: no checkpoint under {root} verifies ({problems}): move them away to start "
                              f"afresh.")
    try:
        for path in verified:
            check_model(path, config.model)
    except CheckpointError as error:
        raise CheckpointError(f"--resume: {error}") from None
    if verified:
        _check_sampler(verified[-1], PromptSampler(train_records, seed=config.train.seed))
    if not verified and config.train.load:
        check_start_weights("train.load", config.train.load, config.model)
    return RunStart(resume, checkpoints)


def _check_sampler(path: Path, sampler: PromptSampler) -> None:
    """The checkpoint's sampler position is one over this run's prompts and seed."""
    try:
        sampler.check_state(read_meta(path)["extra_state"]["sampler"])
    except (KeyError, TypeError):
        raise CheckpointError(f"--resume: {path / META_FILE} records no sampler position (extra_state.sampler): "
                              f"resume only checkpoints of megacispo.train runs") from None
    except ValueError as error:
        raise CheckpointError(f"--resume: {path / META_FILE}: {error} (data.train_prompts, train.seed); or start "
                              f"afresh in another train.run_dir") from None
