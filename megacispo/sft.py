"""Supervised warm start ("cold start" before RL) on prompt/answer pairs:
``torchrun --nproc-per-node N -m megacispo.sft --config X.yaml [--set k=v ...] [--load DIR]``.

The run itself: megacispo.training.sft.
"""

from __future__ import annotations

import sys

from megacispo.checkpoint.hf import check_start_weights
from megacispo.files import check_writable_directory
from megacispo.startup import (
    bad_input_exits,
    build_parser,
    check_sft_batches,
    load_sft_data,
    load_tokenizer,
    plan,
    start_up,
)


def main(argv: list[str] | None = None) -> int:
    args = build_parser(__doc__, load_field="sft.load").parse_args(argv)
    with bad_input_exits():
        config, world_size = start_up(args, check_sft_batches)
        out_field = "sft.out" if config.sft.out else "train.run_dir"  # sft.out defaults to <train.run_dir>/sft
        check_writable_directory(out_field, config.sft.out or config.train.run_dir)
        if args.dry_run:
            print(plan(config, world_size))
            return 0
        tokenizer = load_tokenizer(config)
        pairs = load_sft_data(config, tokenizer)
        if config.sft.load:  # checked before anything is built
            check_start_weights("sft.load", config.sft.load, config.model)
    # After the dry run, which imports no Megatron-Core (tests/multiprocess/test_examples.py): the run does.
    from megacispo.training.sft import run_sft

    run_sft(config, tokenizer, pairs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
