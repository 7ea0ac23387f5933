"""RL entry point: ``torchrun --nproc-per-node N -m megacispo.train --config X.yaml [--set k=v ...]``."""

from __future__ import annotations

import sys
from pathlib import Path

from megacispo.cli import bad_input_exits, build_parser, load_tokenizer, plan, start_up
from megacispo.data import load_prompts


def main(argv: list[str] | None = None) -> int:
    parser = build_parser(__doc__, load_field="train.load")
    parser.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    args = parser.parse_args(argv)
    with bad_input_exits():
        config, world_size = start_up(args)
        if args.dry_run:
            print(plan(config, world_size))
            return 0
        train_records = load_prompts(config.data.train_prompts)
        test_records = load_prompts(config.data.test_prompts) if config.data.test_prompts else []
        tokenizer = load_tokenizer(config)

    from megacispo.engine import Engine
    from megacispo.metrics import MetricsLogger, is_logging_rank
    from megacispo.parallel.layout import destroy_distributed, init_distributed
    from megacispo.trainer import Trainer

    init_distributed(config.parallel, config.train.seed)
    engine = Engine(config, total_steps=config.train.steps * config.rl.updates_per_rollout, peak_lr=config.optimizer.lr,
                    decay_steps=config.optimizer.decay_steps)
    logger = MetricsLogger(config.train.run_dir, enabled=is_logging_rank())
    trainer = Trainer(config, engine, tokenizer, train_records, test_records, logger)
    if not (args.resume and trainer.resume()):
        if args.resume and logger.enabled:
            print(f"--resume: no checkpoint under {Path(config.train.run_dir) / 'checkpoints'}; starting fresh")
        trainer.load_initial_weights()
    accuracy = trainer.fit()
    if logger.enabled and trainer.stopped_by_signal:
        print(f"SIGTERM: stopped after step {trainer.step} and saved its checkpoint; continue with --resume")
    elif logger.enabled:
        print(f"held-out accuracy: {accuracy['before']:.3f} before RL, {accuracy['after']:.3f} after")
    logger.close()
    destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
