"""RL entry point: ``torchrun --nproc-per-node N -m megacispo.train --config X.yaml [--set k=v ...]``."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from megacispo.checkpoint import CheckpointError, checkpoint_dir
from megacispo.cli import bad_input_exits, build_parser, is_rank_zero, load_rl_prompts, load_tokenizer, plan, start_up
from megacispo.config import Config, check_rl_batches
from megacispo.hf_checkpoint import check_export_target, export_hf
from megacispo.metrics import MetricsLogger, is_logging_rank
from megacispo.parallel.layout import destroy_distributed, init_distributed
from megacispo.rewards import RewardFailureError

if TYPE_CHECKING:
    from megacispo.trainer import Trainer


def main(argv: list[str] | None = None) -> int:
    parser = build_parser(__doc__, load_field="train.load")
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint that loads")
    args = parser.parse_args(argv)
    with bad_input_exits():
        config, world_size = start_up(args, check_rl_batches)
        if config.train.export_hf:
            check_export_target("train.export_hf", config.train.export_hf)
        if args.dry_run:
            print(plan(config, world_size))
            return 0
        tokenizer = load_tokenizer(config)
        train_records, test_records, prompt_metrics = load_rl_prompts(config, tokenizer)
        # After the dry run, which must import no Megatron-Core (tests/test_examples.py): these do.
        from megacispo.async_rollout import RemoteRollouts, run_rollout_process
        from megacispo.engine import Engine
        from megacispo.placement import start_placement
        from megacispo.trainer import Trainer, plan_start

        start = plan_start(config, args.resume)  # the checkpoints, before anything is built

    side = start_placement(config) if config.placement.rollout_ranks else None
    if side is not None and side.is_rollout:
        run_rollout_process(config, tokenizer, side.bridge)
        return 0
    init_distributed(config.parallel, config.train.seed)
    engine = Engine(config, total_steps=config.train.steps * config.rl.updates_per_rollout, peak_lr=config.optimizer.lr,
                    decay_steps=config.optimizer.decay_steps)
    logger = MetricsLogger.from_config(config, enabled=is_logging_rank())
    remote = None if side is None else RemoteRollouts(config, side, train_records, tokenizer.pad_id, engine.device)
    trainer = Trainer(config, engine, tokenizer, train_records, test_records, logger, prompt_metrics, remote)
    with bad_input_exits(CheckpointError):  # raised on every rank alike
        trainer.start(start)
    if remote is not None:
        remote.start(engine.module, trainer.step, trainer.sampler.state_dict())
    with bad_input_exits(RewardFailureError):  # raised on every rank at the same step
        accuracy = trainer.fit()
    if remote is not None:
        remote.close()
    if logger.enabled and trainer.stopped_by_signal:
        print(f"SIGTERM: stopped after step {trainer.step} and saved its checkpoint; continue with --resume")
    elif logger.enabled:
        print(f"held-out accuracy: {accuracy['before']:.3f} before RL, {accuracy['after']:.3f} after")
    logger.close()
    destroy_distributed()
    if config.train.export_hf:
        _export(config, trainer)
    return 0


def _export(config: Config, trainer: Trainer) -> None:
    """train.export_hf from the run's final checkpoint, in one process (rank 0) once the others are
    done: the export reads the checkpoint without a process group, so no collective can time out
    however long it takes."""
    from megacispo.trainer import checkpoint_root  # imported by main once past the dry run

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


if __name__ == "__main__":
    sys.exit(main())
