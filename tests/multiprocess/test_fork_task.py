"""The worked-addition fork task (issue #26): the teacher's worked answers (steps and carries right,
the sum last), their share of the SFT pairs, determinism, unchanged files without them, the numeric
reward grading both branches, and the marker one token of the quick start's tokenizer
(tools/fork_branches.py end to end: tests/slow/test_fork_branches.py).
"""

from __future__ import annotations

import random
import re

import pytest
from arithmetic_tasks import WORKED_MARKER, ArithmeticTask, generate_task_data, worked_answer

from megacispo.data.prompts import PromptRecord
from megacispo.data.rewards import numeric
from megacispo.data.tokenizer import Tokenizer
from megacispo.testing.tool_modules import load_tool

STEP_PATTERN = re.compile(r"(\d(?:\+\d)+)=(\d+)")


def check_worked(answer: str, operands: list[int]) -> None:
    """Re-derive every step of a worked answer from the operands and assert it."""
    assert answer.startswith(WORKED_MARKER)
    steps, total = answer[len(WORKED_MARKER):].split(";")
    assert int(total) == sum(operands)
    carry = 0
    width = max(len(str(operand)) for operand in operands)
    written = steps.split(",")
    assert len(written) == width
    for column, step in enumerate(written):
        match = STEP_PATTERN.fullmatch(step)
        assert match, step
        terms = [int(term) for term in match[1].split("+")]
        assert terms == [operand // 10**column % 10 for operand in operands] + ([carry] if carry else [])
        assert int(match[2]) == sum(terms)
        carry = sum(terms) // 10
    assert int(total) // 10**width == carry, "the last carry leads the sum"


def test_worked_answer_matches_the_example_and_carries_through_every_digit():
    assert worked_answer([1234, 5678]) == "~4+8=12,3+7+1=11,2+6+1=9,1+5=6;6912"
    assert worked_answer([9999, 1]) == "~9+1=10,9+0+1=10,9+0+1=10,9+0+1=10;10000"
    assert worked_answer([7, 0]) == "~7+0=7;7"


def test_worked_answers_are_right_for_random_problems():
    rng = random.Random(0)
    for _ in range(500):
        operands = [rng.randrange(10 ** rng.randint(1, 6)) for _ in range(rng.randint(2, 4))]
        check_worked(worked_answer(operands), operands)


def test_a_fraction_of_sft_answers_is_worked_and_rl_answers_stay_bare():
    task = ArithmeticTask("addition", digits=3)
    plain = generate_task_data(task, 3000, 50, seed=2)
    forked = generate_task_data(task, 3000, 50, seed=2, sft_worked=0.1)
    assert forked.train == plain.train and forked.test == plain.test
    worked = 0
    for sft, true in zip(forked.sft, plain.sft):
        assert sft.prompt == true.prompt
        if sft.answer != true.answer:
            worked += 1
            check_worked(sft.answer, [int(operand) for operand in sft.prompt[:-1].split("+")])
    # A coin flip per pair: within 4 binomial standard deviations of 0.1 * 3000.
    assert abs(worked - 300) < 4 * (3000 * 0.1 * 0.9) ** 0.5
    assert forked == generate_task_data(task, 3000, 50, seed=2, sft_worked=0.1), "deterministic"
    worked_lines = [line for line in forked.corpus_lines() if line.startswith(WORKED_MARKER)]
    assert len(worked_lines) == worked and forked.corpus_lines()[: len(plain.corpus_lines())] == plain.corpus_lines()


def test_worked_and_restated_answers_share_the_sft_pairs():
    task = ArithmeticTask("addition", digits=2)
    restated = generate_task_data(task, 2000, 10, seed=4, sft_restate=0.5)
    both = generate_task_data(task, 2000, 10, seed=4, sft_restate=0.5, sft_worked=0.5)
    kinds = {"restated": 0, "worked": 0}
    for mixed, alone, true in zip(both.sft, restated.sft, restated.train):
        if mixed.answer.startswith(WORKED_MARKER):
            assert alone.answer == true.answer, "only bare answers get worked"
            kinds["worked"] += 1
        else:
            assert mixed == alone
            kinds["restated"] += mixed.answer.startswith(mixed.prompt)
    assert kinds["worked"] > 300 and kinds["restated"] > 800


def test_demonstrations_continue_after_the_marker_in_the_prompt(tmp_path):
    """sft_worked_demos: a share of the bare answers becomes the worked answer after a prompt that
    ends with the marker; worked answers stay as they were; the prompt's ids are the plain prompt's
    and the marker's, so SFT conditions on exactly what a rollout that sampled the marker holds."""
    task = ArithmeticTask("addition", digits=3)
    worked = generate_task_data(task, 3000, 50, seed=2, sft_worked=0.05)
    demos = generate_task_data(task, 3000, 50, seed=2, sft_worked=0.05, sft_worked_demos=0.3)
    assert demos.train == worked.train and demos.test == worked.test
    num_demos = 0
    for mixed, alone, true in zip(demos.sft, worked.sft, worked.train):
        if mixed.prompt.endswith(WORKED_MARKER):
            assert alone == true, "only bare answers become demonstrations"
            assert mixed.prompt == true.prompt + WORKED_MARKER
            check_worked(WORKED_MARKER + mixed.answer, [int(operand) for operand in true.prompt[:-1].split("+")])
            num_demos += 1
        else:
            assert mixed == alone
    assert abs(num_demos - 0.3 * 0.95 * 3000) < 4 * (3000 * 0.3 * 0.7) ** 0.5
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(line + "\n" for line in demos.corpus_lines()))
    assert load_tool("train_tokenizer").main(["--input", str(corpus), "--vocab-size", "512", "--out", str(tmp_path)]) == 0
    tokenizer = Tokenizer.load(tmp_path)
    demo = next(record for record in demos.sft if record.prompt.endswith(WORKED_MARKER))
    assert tokenizer.encode(demo.prompt) == tokenizer.encode(demo.prompt[:-1]) + tokenizer.encode(WORKED_MARKER)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"task": ArithmeticTask("addition"), "sft_worked": 1.2}, "sft_worked=1.2 must be a probability"),
        ({"task": ArithmeticTask("add_sub"), "sft_worked": 0.1}, "needs task 'addition'"),
        ({"task": ArithmeticTask("addition"), "sft_worked_demos": -0.1}, "sft_worked_demos=-0.1 must be a probability"),
        ({"task": ArithmeticTask("subtraction"), "sft_worked_demos": 0.1}, "sft_worked_demos=0.1 needs task 'addition'"),
    ],
)
def test_worked_teacher_rejects_bad_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        generate_task_data(num_train=10, num_test=5, seed=0, **kwargs)


def test_numeric_reward_grades_both_branches_by_the_sum():
    record = PromptRecord("1234+5678=", "6912")
    assert numeric("6912", record) == 1.0
    assert numeric(worked_answer([1234, 5678]), record) == 1.0
    assert numeric("~4+8=12,3+7+1=11,2+6+1=9,1+5=6;6911", record) == 0.0
    assert numeric("~4+8=12,3+7+1=11", record) == 0.0, "steps without the sum are wrong"
    assert numeric("6913", record) == 0.0
    rng = random.Random(1)
    for _ in range(200):
        operands = [rng.randrange(10**5) for _ in range(2)]
        assert numeric(worked_answer(operands), PromptRecord("", str(sum(operands)))) == 1.0


def test_default_files_are_unchanged_and_the_marker_is_one_token(tmp_path):
    make_task_data = load_tool("make_task_data")
    base = ["--num-train", "300", "--num-test", "20", "--seed", "5", "--digits", "3"]
    assert make_task_data.main(["--out", str(tmp_path / "plain")] + base) == 0
    assert make_task_data.main(["--out", str(tmp_path / "zero")] + base + ["--sft-worked", "0"]) == 0
    assert make_task_data.main(["--out", str(tmp_path / "fork")] + base + ["--sft-worked", "0.2"]) == 0
    files = ("train.jsonl", "sft.jsonl", "test.jsonl", "corpus.txt")
    assert all((tmp_path / "plain" / f).read_bytes() == (tmp_path / "zero" / f).read_bytes() for f in files)
    assert (tmp_path / "plain" / "train.jsonl").read_bytes() == (tmp_path / "fork" / "train.jsonl").read_bytes()
    assert WORKED_MARKER in (tmp_path / "fork" / "sft.jsonl").read_text()
    tokenizer_tool = load_tool("train_tokenizer")
    corpus = str(tmp_path / "fork" / "corpus.txt")
    assert tokenizer_tool.main(["--input", corpus, "--vocab-size", "512", "--out", str(tmp_path / "tok")]) == 0
    tokenizer = Tokenizer.load(tmp_path / "tok")
    answer = worked_answer([123, 989])
    assert len(tokenizer.encode(WORKED_MARKER)) == 1
    assert tokenizer.encode(answer)[0] == tokenizer.encode(WORKED_MARKER)[0]
