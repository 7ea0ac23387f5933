"""Write the data of a multi-turn task: multiplication with a Python tool, or a number-guessing game.

    python tools/make_tool_task.py --out DIR --task multiply|guess --num-train N --num-test M --seed S
                                   [--digits 2] [--sft-tool-frac 0.5] [--max-number 32]

Writes, each file atomically:
    DIR/train.jsonl   RL prompts with answers, one per line
    DIR/test.jsonl    held-out prompts, disjoint from train
    DIR/sft.jsonl     one multi-turn demonstration per train prompt, its turns after the prompt in "turns"
    DIR/corpus.txt    text to train the tokenizer on: every prompt, answer and turn, each on its own line

--task multiply (env.name: python): prompts "37*58=" of two --digits-digit operands, answer "2146".
A fraction --sft-tool-frac of the demonstrations call the tool and answer with its output,

    {"prompt": "37*58=", "answer": "2146", "turns": [{"role": "assistant", "content": "<python>37*58</python>"},
     {"role": "tool", "content": "2146"}, {"role": "assistant", "content": "2146"}]}

(the tool message is what the python environment replies with its default reply_format); the rest
answer at once, {"turns": [{"role": "assistant", "content": "2146"}]}, which a tiny model cannot learn
to compute. The tokenizer must keep the tags whole, as the environment's stop token needs:
    python tools/train_tokenizer.py --input DIR/corpus.txt --vocab-size 512 --out DIR/tok \\
        --symbols "<python>" "</python>"

--task guess (env.name: guess_number): prompts "guess 1-H:" for H in [2, --max-number], the answer
the secret in [1, H]; the demonstrations play a binary search, the assistant's guesses ("16")
alternating with the user's replies ("higher" / "lower") up to the right guess. A prompt recurs with
different secrets, so train and test are disjoint as (prompt, answer) pairs.

The same seed gives the same files.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from dataclasses import dataclass
from pathlib import Path

from arithmetic_tasks import write_task_data

from megacispo.data.prompts import PromptRecord
from megacispo.envs.builtin import GuessNumber, PythonTool

TASKS = ("multiply", "guess")
MAX_DIGITS = 9
DEFAULT_SFT_TOOL_FRAC = 0.5


@dataclass(frozen=True)
class ToolTaskData:
    """The files of one task: RL prompts, demonstrations (one per train prompt) and held-out prompts."""

    train: list[PromptRecord]
    """RL prompts with their answers."""
    sft: list[PromptRecord]
    """The train prompts with their demonstration's turns in extra["turns"]."""
    test: list[PromptRecord]
    """Held-out prompts: no (prompt, answer) pair of train."""

    def corpus_lines(self) -> list[str]:
        """Each train prompt and answer, then each demonstration turn, on lines of their own: the model
        sees them tokenized apart (prompt, then each turn)."""
        return [text for record in self.train for text in (record.prompt, record.answer)] + [
            turn["content"] for record in self.sft for turn in record.extra["turns"]
        ]


def operand_range(digits: int) -> range:
    """The operands of ``digits`` digits (one digit: 0 to 9)."""
    return range(0 if digits == 1 else 10 ** (digits - 1), 10**digits)


def multiply_problem(index: int, digits: int) -> PromptRecord:
    operands = operand_range(digits)
    first, second = divmod(index, len(operands))
    a, b = operands[first], operands[second]
    return PromptRecord(prompt=f"{a}*{b}=", answer=str(a * b))


def guess_problem(index: int) -> PromptRecord:
    """Problem ``index`` of the guessing game: the secrets of range 1-2, then of 1-3, and so on."""
    # Ranges 1-2 .. 1-(H-1) hold first_index(H) = H(H-1)/2 - 1 problems; find the H whose block holds index.
    high = (1 + math.isqrt(8 * (index + 1) + 1)) // 2
    while high * (high - 1) // 2 - 1 > index:
        high -= 1
    while (high + 1) * high // 2 - 1 <= index:
        high += 1
    return PromptRecord(prompt=f"guess 1-{high}:", answer=str(index - (high * (high - 1) // 2 - 1) + 1))


def guess_space(max_number: int) -> int:
    """Problems with ranges 1-H, H in [2, max_number]: the sum of the H."""
    return max_number * (max_number + 1) // 2 - 1


def guess_range(prompt: str) -> tuple[int, int]:
    """(low, high) of a guessing prompt "guess 1-32:"."""
    low, high = prompt.removeprefix("guess ").removesuffix(":").split("-")
    return int(low), int(high)


def multiply_demo(record: PromptRecord, use_tool: bool, tool: PythonTool) -> list[dict[str, str]]:
    answer = {"role": "assistant", "content": record.answer}
    if not use_tool:
        return [answer]
    # The product of two ints is printed as its repr: its decimal digits, the answer's text.
    return [{"role": "assistant", "content": tool.tool_call(record.prompt.removesuffix("="))},
            tool.reply(record.answer), answer]


def binary_search_demo(record: PromptRecord, game: GuessNumber) -> list[dict[str, str]]:
    low, high = guess_range(record.prompt)
    secret = int(record.answer)
    turns = []
    while True:
        guess = (low + high) // 2
        turns.append({"role": "assistant", "content": str(guess)})
        if guess == secret:
            return turns
        if guess < secret:
            low = guess + 1
            turns.append({"role": "user", "content": game.higher})
        else:
            high = guess - 1
            turns.append({"role": "user", "content": game.lower})


def generate_tool_task(task: str, num_train: int, num_test: int, seed: int, digits: int = 2,
                       sft_tool_frac: float | None = None, max_number: int = 32) -> ToolTaskData:
    """Draw num_train + num_test distinct problems and a demonstration for each train one.

    Deterministic in its arguments. Exactly round(sft_tool_frac * num_train) multiply demonstrations,
    drawn at random, call the tool."""
    if task not in TASKS:
        raise ValueError(f"task={task!r} is not a task; choose one of {', '.join(TASKS)}")
    if num_train < 1 or num_test < 1:
        raise ValueError(f"num_train={num_train} and num_test={num_test} must both be >= 1")
    if task == "guess" and sft_tool_frac is not None:
        raise ValueError("--sft-tool-frac applies to --task multiply; the guessing game has no tool: leave it out")
    sft_tool_frac = DEFAULT_SFT_TOOL_FRAC if sft_tool_frac is None else sft_tool_frac
    if not 0.0 <= sft_tool_frac <= 1.0:
        raise ValueError(f"sft_tool_frac={sft_tool_frac} must be a fraction in [0, 1]")
    if task == "multiply":
        if not 1 <= digits <= MAX_DIGITS:
            raise ValueError(f"digits={digits} must be in [1, {MAX_DIGITS}]")
        space, settings, knob = len(operand_range(digits)) ** 2, f"digits={digits}", "--digits"
    else:
        if max_number < 2:
            raise ValueError(f"max_number={max_number} must be >= 2: a range needs two numbers to guess from")
        space, settings, knob = guess_space(max_number), f"max_number={max_number}", "--max-number"
    if num_train + num_test > space:
        raise ValueError(f"num_train + num_test = {num_train + num_test} exceeds the {space} distinct problems of "
                         f"{task} with {settings}; ask for fewer or raise {knob}")
    # A string seed is hashed with SHA-512: a stable stream across Python versions.
    rng = random.Random(f"make_tool_task:{task}:{settings}:{seed}")
    indices = rng.sample(range(space), num_train + num_test)
    if task == "multiply":
        problems = [multiply_problem(index, digits) for index in indices]
    else:
        problems = [guess_problem(index) for index in indices]
    train, test = problems[:num_train], problems[num_train:]
    if task == "multiply":
        tool = PythonTool()
        # Its own stream, so the tool fraction leaves the problem draw unchanged.
        with_tool = set(random.Random(f"make_tool_task.tool:{seed}").sample(range(num_train),
                                                                            round(sft_tool_frac * num_train)))
        demos = [multiply_demo(record, index in with_tool, tool) for index, record in enumerate(train)]
    else:
        game = GuessNumber()
        demos = [binary_search_demo(record, game) for record in train]
    sft = [PromptRecord(record.prompt, record.answer, extra={"turns": turns}) for record, turns in zip(train, demos)]
    return ToolTaskData(train=train, sft=sft, test=test)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory to write the files into (created)")
    parser.add_argument("--task", required=True, choices=TASKS, help="multiply (python tool) or guess (guess_number)")
    parser.add_argument("--num-train", type=int, required=True, help="RL training prompts (each with a demonstration)")
    parser.add_argument("--num-test", type=int, required=True, help="held-out prompts, disjoint from train")
    parser.add_argument("--seed", type=int, required=True, help="the same seed writes the same files")
    parser.add_argument("--digits", type=int, default=2, help=f"multiply: digits of each operand, 1..{MAX_DIGITS}")
    parser.add_argument("--sft-tool-frac", type=float, default=None,
                        help=f"multiply: fraction of the demonstrations that call the tool ({DEFAULT_SFT_TOOL_FRAC})")
    parser.add_argument("--max-number", type=int, default=32, help="guess: the widest range is 1 to this")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        data = generate_tool_task(args.task, args.num_train, args.num_test, args.seed, digits=args.digits,
                                  sft_tool_frac=args.sft_tool_frac, max_number=args.max_number)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for path in write_task_data(Path(args.out), data):
        print(f"wrote {path}")
    if args.task == "multiply":
        detail = f"{sum(len(record.extra['turns']) > 1 for record in data.sft)} of the demonstrations call the tool"
    else:
        most = max(len(record.extra["turns"]) // 2 + 1 for record in data.sft)
        detail = f"a demonstration takes at most {most} guesses"
    print(f"{args.task}: {len(data.train)} train, {len(data.test)} test prompts; {detail}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
