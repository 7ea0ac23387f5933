"""Write the quick start's arithmetic task data.

    python tools/make_task_data.py --out DIR --task addition --num-train N --num-test M --seed S [--digits D]

Writes, each file atomically:
    DIR/train.jsonl   RL prompts with answers, {"prompt": "12+7=", "answer": "19"} per line
    DIR/sft.jsonl     supervised warm-start pairs (the first --num-sft train problems; with
                      --sft-restate P, a fraction P of the answers restate the question: "12+7=19";
                      with --sft-worked P (addition only), a fraction P of the others work the sum
                      out after the marker "~", column by column with carries, then the sum:
                      "~2+7=9,1+0=1;19"; the numeric reward grades both kinds by the sum; with
                      --sft-worked-demos Q, a fraction Q of the rest are demonstrations of the worked
                      branch whose prompt ends with the marker: "12+7=~" -> "2+7=9,1+0=1;19")
    DIR/test.jsonl    held-out prompts, disjoint from train
    DIR/corpus.txt    text to train the tokenizer on (tools/train_tokenizer.py --input DIR/corpus.txt);
                      it holds the worked answers too, so the marker is a token
The same seed gives the same files.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from arithmetic_tasks import (
    MAX_DIGITS,
    MAX_OPERANDS,
    TASK_OPERATORS,
    ArithmeticTask,
    generate_task_data,
    write_task_data,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory to write the files into (created)")
    parser.add_argument("--task", default="addition", choices=sorted(TASK_OPERATORS), help="operators used")
    parser.add_argument("--num-train", type=int, required=True, help="RL training prompts")
    parser.add_argument("--num-test", type=int, required=True, help="held-out prompts, disjoint from train")
    parser.add_argument("--num-sft", type=int, default=None, help="SFT pairs, a prefix of train (default: all)")
    parser.add_argument(
        "--sft-restate", type=float, default=0.0,
        help="fraction of SFT answers that restate the question first (RL and test answers stay bare numbers)",
    )
    parser.add_argument(
        "--sft-worked", type=float, default=0.0,
        help="fraction of SFT answers that work the sum out after a marker token (addition; issue #26's fork task)",
    )
    parser.add_argument(
        "--sft-worked-demos", type=float, default=0.0,
        help="fraction of the other SFT pairs whose prompt ends with the marker and whose answer works the sum out",
    )
    parser.add_argument("--seed", type=int, required=True, help="the same seed writes the same files")
    parser.add_argument("--digits", type=int, default=2, help=f"operands are in [0, 10**digits), 1..{MAX_DIGITS}")
    parser.add_argument("--operands", type=int, default=2, help=f"operands per problem, 2..{MAX_OPERANDS}")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        task = ArithmeticTask(args.task, digits=args.digits, num_operands=args.operands)
        data = generate_task_data(
            task, args.num_train, args.num_test, args.seed, num_sft=args.num_sft, sft_restate=args.sft_restate,
            sft_worked=args.sft_worked,
            sft_worked_demos=args.sft_worked_demos,
        )
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for path in write_task_data(Path(args.out), data):
        print(f"wrote {path}")
    print(
        f"{task.name}, digits={task.digits}, operands={task.num_operands}: {len(data.train)} train, "
        f"{len(data.sft)} sft, {len(data.test)} test problems (of {task.num_problems} possible)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
