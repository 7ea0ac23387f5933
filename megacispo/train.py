"""RL entry point: ``torchrun --nproc-per-node N -m megacispo.train --config X.yaml [--set k=v ...]``."""

from __future__ import annotations

import sys

from megacispo.checkpoint.hf import check_export_target
from megacispo.files import check_writable_directory
from megacispo.rl.metric_hooks import build_metric_hooks
from megacispo.rl.start import check_start
from megacispo.startup import (
    bad_input_exits,
    build_parser,
    check_environment_tokens,
    check_rl_batches,
    load_rl_prompts,
    load_tokenizer,
    plan,
    start_up,
)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser(__doc__, load_field="train.load")
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint that loads")
    args = parser.parse_args(argv)
    with bad_input_exits():
        config, world_size = start_up(args, check_rl_batches)
        check_writable_directory("train.run_dir", config.train.run_dir)
        if config.train.export_hf:
            check_export_target("train.export_hf", config.train.export_hf)
            check_writable_directory("train.export_hf", config.train.export_hf)
        if args.dry_run:
            print(plan(config, world_size))
            return 0
        tokenizer = load_tokenizer(config)
        check_environment_tokens(config, tokenizer)
        metric_hooks = build_metric_hooks(config.logging.metric_hooks, tokenizer)
        train_records, test_records, prompt_metrics = load_rl_prompts(config, tokenizer)
        start = check_start(config, args.resume, train_records)  # the checkpoints, before anything is built
    # After the dry run, which imports no Megatron-Core (tests/multiprocess/test_examples.py): the run does.
    from megacispo.rl.run import run_rl

    run_rl(config, start, tokenizer, train_records, test_records, prompt_metrics, metric_hooks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
