"""Where an RL run starts: its checkpoints (--resume) or train.load, checked before anything is built."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from megacispo.checkpoint.distributed import CheckpointError, check_model, find_checkpoints
from megacispo.checkpoint.hf import check_start_weights
from megacispo.config import Config


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


def check_start(config: Config, resume: bool) -> RunStart:
    """Check the checkpoints a run will read before anything is built: with ``resume`` the run's own
    (one at least must verify if there are any, and those must hold config.model), else train.load's.
    CheckpointError naming the file and the fix."""
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
    if not verified and config.train.load:
        check_start_weights("train.load", config.train.load, config.model)
    return RunStart(resume, checkpoints)
