"""An RL run of a config checked at start-up, behind the entry point megacispo.train: the placement
of rollouts, the process groups, the engine, the trainer, the loop, the export."""

from __future__ import annotations

import torch.distributed as dist

from megacispo.checkpoint.distributed import CheckpointError, checkpoint_dir, remove_temporaries
from megacispo.checkpoint.hf import export_hf
from megacispo.config import Config
from megacispo.data.prompts import PromptRecord
from megacispo.data.rewards import RewardFailureError
from megacispo.data.tokenizer import Tokenizer
from megacispo.files import DirectoryInUse, DirectoryLock, lock_directory
from megacispo.lifeline import start_group_reaper
from megacispo.metrics.logger import MetricsLogger, is_logging_rank
from megacispo.parallel.layout import destroy_distributed, init_distributed
from megacispo.rl.metric_hooks import MetricHook
from megacispo.rl.start import RunStart, checkpoint_root
from megacispo.rl.trainer import NOTHING_TRAINED, Trainer
from megacispo.rollout.placement import Side, start_placement
from megacispo.rollout.config import VLLM
from megacispo.rollout.remote import RemoteRollouts, run_rollout_process
from megacispo.rollout.vllm_engine import WeightSyncError
from megacispo.startup import bad_input_exits, is_rank_zero
from megacispo.training.engine import Engine


def run_rl(config: Config, start: RunStart, tokenizer: Tokenizer, train_records: list[PromptRecord],
           test_records: list[PromptRecord], prompt_metrics: dict[str, float], metric_hooks: list[MetricHook]) -> None:
    """Train on this process (or, under placement.rollout_ranks, generate), from ``start``."""
    # Megatron-Core's checkpoint writer starts a Manager process that would outlive a killed rank.
    start_group_reaper()
    side = start_placement(config.placement, config.parallel) if config.placement.rollout_ranks else None
    if side is not None and side.is_rollout:
        run_rollout_process(config, tokenizer, side.bridge)
        return
    init_distributed(config.parallel, config.train.seed, config.precision.fp32_matmul)
    with bad_input_exits(DirectoryInUse):  # raised on every rank alike
        run_dir_lock = _lock_run_dir(config)
    try:
        _train(config, start, side, tokenizer, train_records, test_records, prompt_metrics, metric_hooks)
    finally:
        # Removes the lock file, and train.run_dir with it if the run wrote nothing there (a bad --load).
        if run_dir_lock is not None:
            run_dir_lock.release()


def _train(config: Config, start: RunStart, side: Side | None, tokenizer: Tokenizer, train_records: list[PromptRecord],
           test_records: list[PromptRecord], prompt_metrics: dict[str, float], metric_hooks: list[MetricHook]) -> None:
    """The training side's run, with train.run_dir's lock held: the engine, the trainer, the loop, the export."""
    engine = Engine(config, total_steps=config.train.steps * config.rl.updates_per_rollout, peak_lr=config.optimizer.lr,
                    decay_steps=config.optimizer.decay_steps)
    logger = MetricsLogger.from_config(config, enabled=is_logging_rank())
    remote = None if side is None else RemoteRollouts(config, side, train_records, tokenizer.pad_id, engine.device)
    trainer = Trainer(config, engine, tokenizer, train_records, test_records, logger, prompt_metrics, remote,
                      metric_hooks)
    with bad_input_exits((CheckpointError, WeightSyncError)):  # raised on every rank alike
        trainer.start(start)
        if config.rollout.engine == VLLM:
            trainer.start_vllm()
    if remote is not None:
        remote.start(engine.module, trainer.step, trainer.sampler.state_dict())
    # Raised on every rank at the same step (a failed save: torch DCP gathers the ranks' failures).
    with bad_input_exits((RewardFailureError, CheckpointError, WeightSyncError)):
        accuracy = trainer.fit()
    if remote is not None:
        remote.close()
    if logger.enabled and trainer.stopped_by_signal and trainer.step == 0:
        print(f"SIGTERM: stopped before step 1 completed; {NOTHING_TRAINED}")
    elif logger.enabled and trainer.stopped_by_signal:
        print(f"SIGTERM: stopped after step {trainer.step} and saved its checkpoint; continue with --resume")
    elif logger.enabled:
        print(f"held-out accuracy: {accuracy['before']:.3f} before RL, {accuracy['after']:.3f} after")
    logger.close()
    destroy_distributed()
    if config.train.export_hf:
        _export(config, trainer)


def _lock_run_dir(config: Config) -> DirectoryLock | None:
    """train.run_dir's lock, held by training rank 0 (the one that writes the checkpoints' commits and
    deletes temporaries) for the run: a second run on the directory stops here, naming the first.
    Once held, the temporaries of saves interrupted before (which may fill the disk) are removed.
    DirectoryInUse on every rank when another live run holds it."""
    lock, failure = None, [None]
    if dist.get_rank() == 0:
        try:
            lock = lock_directory(config.train.run_dir, "train.run_dir")
        except DirectoryInUse as error:
            failure = [str(error)]
    dist.broadcast_object_list(failure, src=0)
    if failure[0] is not None:
        raise DirectoryInUse(failure[0])
    if lock is None:
        return None
    if lock.previous_holder:
        print(f"train.run_dir: taking over {lock.path} from {lock.previous_holder}, which has ended", flush=True)
    root = checkpoint_root(config)
    if root.is_dir():
        for path in remove_temporaries(root):
            print(f"train.run_dir: removed {path}, left by a save that did not finish", flush=True)
    return lock


def _export(config: Config, trainer: Trainer) -> None:
    """train.export_hf from the run's final checkpoint, in one process (rank 0) once the others are
    done: the export reads the checkpoint without a process group, so no collective can time out
    however long it takes."""
    if not is_rank_zero():
        return
    if trainer.stopped_by_signal:
        print(f"train.export_hf: not written (stopped by SIGTERM); --resume writes {config.train.export_hf} when the "
              f"run finishes")
        return
    with bad_input_exits():
        path = export_hf(checkpoint_dir(checkpoint_root(config), trainer.step), config.train.export_hf,
                         trainer.tokenizer)
    print(f"Hugging Face export: {path}")
