"""Verifiable arithmetic tasks for the quick start: prompt "12+7=", answer "19".

Difficulty knobs: ``digits`` (operands are drawn from 0 .. 10**digits - 1) and ``num_operands``.
Two-digit addition is the quick start's default: an 8-layer, hidden-64 model learns it from a
1000-step SFT warm start.

Problems are drawn without replacement from the task's whole problem space by index, so the
train and test sets are disjoint by construction and the draw is exact for any space size.

The SFT pairs can come from a wordy teacher (``sft_restate``) who, in that fraction of answers,
restates the question before the result ("12+7=" -> "12+7=19"). The sum is right either way;
the exact-match verifier accepts only the bare number, so the warm-started model, which usually
restates, is graded wrong until RL teaches it to answer with the number alone.

For addition, the teacher can also work the sum out (``sft_worked``, issue #26's fork task): in
that fraction of answers it writes ``WORKED_MARKER``, then one step per column from the ones digit
up, then ";" and the sum. A step adds the column's digits (0 where an operand has no such digit),
then the carry in if there is one: "1234+56=" -> "~4+6=10,3+5+1=9,2+0=2,1+0=1;1290". The marker is
the fork: a model that writes it takes the worked branch, any digit starts the direct one.
``sft_worked_demos`` adds demonstrations of the worked branch that do not teach taking it: in that
fraction of the answers the prompt ends with the marker ("1234+56=~") and the answer is the rest of
the worked sum. SFT's loss covers the answer only, so the model learns to carry out the branch from
many examples while the marker's probability at the answer's start stays near ``sft_worked`` (a
pretrained model can reflect, but rarely starts to). The
``numeric`` reward (the last number in the response) grades both: the sum after ";" is the last
number, and no step reads as a signed or comma-grouped number (each step starts with one digit).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from megacispo.data.prompts import PromptRecord, format_jsonl
from megacispo.files import atomic_write_text

TASK_OPERATORS: dict[str, tuple[str, ...]] = {
    "addition": ("+",),
    "subtraction": ("-",),
    "add_sub": ("+", "-"),
}

MAX_DIGITS = 9
MAX_OPERANDS = 6

# Starts a worked answer; one sentencepiece token: a character of the corpus that no BPE merge joins
# to the digit after it (split_digits) and that nothing else in the corpus contains.
WORKED_MARKER = "~"


@dataclass(frozen=True)
class ArithmeticTask:
    """Left-to-right integer expressions of ``num_operands`` operands with ``digits`` digits at most."""

    name: str
    """One of TASK_OPERATORS: which operators appear between operands."""
    digits: int = 2
    """Operands are uniform in [0, 10**digits)."""
    num_operands: int = 2
    """Operands per expression; the answer is evaluated left to right."""

    def __post_init__(self) -> None:
        if self.name not in TASK_OPERATORS:
            raise ValueError(f"task={self.name!r} is not a task; choose one of {sorted(TASK_OPERATORS)}")
        if not 1 <= self.digits <= MAX_DIGITS:
            raise ValueError(f"digits={self.digits} must be in [1, {MAX_DIGITS}]")
        if not 2 <= self.num_operands <= MAX_OPERANDS:
            raise ValueError(f"num_operands={self.num_operands} must be in [2, {MAX_OPERANDS}]")

    @property
    def operators(self) -> tuple[str, ...]:
        return TASK_OPERATORS[self.name]

    @property
    def num_problems(self) -> int:
        """Size of the problem space: every operand tuple times every operator sequence."""
        operand_choices = 10**self.digits
        return operand_choices**self.num_operands * len(self.operators) ** (self.num_operands - 1)

    def problem(self, index: int) -> PromptRecord:
        """The problem with this index in [0, num_problems): a mixed-radix decoding of the index."""
        assert 0 <= index < self.num_problems, index
        operand_choices = 10**self.digits
        operands = []
        for _ in range(self.num_operands):
            index, operand = divmod(index, operand_choices)
            operands.append(operand)
        operators = []
        for _ in range(self.num_operands - 1):
            index, operator_index = divmod(index, len(self.operators))
            operators.append(self.operators[operator_index])
        return make_problem(operands, operators)


def evaluate(operands: list[int], operators: list[str]) -> int:
    """Left-to-right value, as Python would evaluate the expression (only + and - occur)."""
    value = operands[0]
    for operator, operand in zip(operators, operands[1:]):
        value = value + operand if operator == "+" else value - operand
    return value


def make_problem(operands: list[int], operators: list[str]) -> PromptRecord:
    assert len(operators) == len(operands) - 1
    expression = str(operands[0]) + "".join(op + str(operand) for op, operand in zip(operators, operands[1:]))
    return PromptRecord(prompt=expression + "=", answer=str(evaluate(operands, operators)))


def worked_answer(operands: list[int]) -> str:
    """The teacher's worked sum of ``operands`` (non-negative): the marker, the column steps, ";", the sum.

    Written ones column first, the order in which the carries are known."""
    assert operands and all(operand >= 0 for operand in operands), operands
    columns = max(len(str(operand)) for operand in operands)
    steps, carry = [], 0
    for column in range(columns):
        terms = [operand // 10**column % 10 for operand in operands] + ([carry] if carry else [])
        total = sum(terms)
        steps.append("+".join(map(str, terms)) + f"={total}")
        carry = total // 10
    return f"{WORKED_MARKER}{','.join(steps)};{sum(operands)}"


def operands_of(prompt: str) -> list[int]:
    """The operands of an addition prompt ("12+7=" -> [12, 7])."""
    return [int(operand) for operand in prompt.removesuffix("=").split("+")]


@dataclass(frozen=True)
class TaskData:
    """The files of one task: RL prompts, SFT pairs (a prefix of train), held-out test prompts."""

    train: list[PromptRecord]
    sft: list[PromptRecord]
    test: list[PromptRecord]

    def corpus_lines(self) -> list[str]:
        """Tokenizer training text: each training prompt and answer, each on its own line, then the
        SFT pairs' worked answers (so their marker becomes a token).

        Separate lines because the model always sees them tokenized separately (prompt, then
        answer): "=" followed by a negative answer's "-" must not become a "=-" piece.
        """
        return [text for record in self.train for text in (record.prompt, record.answer)] + [
            record.answer for record in self.sft if record.answer.startswith(WORKED_MARKER)
        ]


def generate_task_data(
    task: ArithmeticTask,
    num_train: int,
    num_test: int,
    seed: int,
    num_sft: int | None = None,
    sft_restate: float = 0.0,
    sft_worked: float = 0.0,
    sft_worked_demos: float = 0.0,
) -> TaskData:
    """Draw num_train + num_test distinct problems; the SFT pairs are the first ``num_sft`` of train.

    Each SFT answer restates the question with probability ``sft_restate`` (see the module
    docstring); of the others, an addition answer is worked out (``worked_answer``) with probability
    ``sft_worked``, and of the rest a fraction ``sft_worked_demos`` are demonstrations that continue
    after the marker. RL and test answers are always the bare number. Deterministic in (task, counts,
    seed and the three fractions). ``num_sft`` defaults to ``num_train``.
    """
    num_sft = num_train if num_sft is None else num_sft
    if not 0.0 <= sft_restate <= 1.0:
        raise ValueError(f"sft_restate={sft_restate} must be a probability in [0, 1]")
    if not 0.0 <= sft_worked <= 1.0:
        raise ValueError(f"sft_worked={sft_worked} must be a probability in [0, 1]")
    if not 0.0 <= sft_worked_demos <= 1.0:
        raise ValueError(f"sft_worked_demos={sft_worked_demos} must be a probability in [0, 1]")
    for name, value in (("sft_worked", sft_worked), ("sft_worked_demos", sft_worked_demos)):
        if value and task.name != "addition":
            raise ValueError(f"{name}={value} needs task 'addition' (got {task.name!r}); set it to 0")
    # Every file must hold a record: load_prompts rejects an empty one.
    if num_train < 1 or num_test < 1:
        raise ValueError(f"num_train={num_train} and num_test={num_test} must both be >= 1")
    if not 1 <= num_sft <= num_train:
        raise ValueError(f"num_sft={num_sft} must be in [1, num_train={num_train}]: SFT pairs are drawn from train")
    if num_train + num_test > task.num_problems:
        raise ValueError(
            f"num_train + num_test = {num_train + num_test} exceeds the {task.num_problems} distinct problems of "
            f"{task.name} with digits={task.digits}, num_operands={task.num_operands}; "
            "ask for fewer or raise --digits"
        )
    # A string seed is hashed with SHA-512: a stable stream across Python versions.
    rng = random.Random(f"arithmetic_tasks:{task.name}:{task.digits}:{task.num_operands}:{seed}")
    indices = rng.sample(range(task.num_problems), num_train + num_test)
    problems = [task.problem(index) for index in indices]
    train, test = problems[:num_train], problems[num_train:]
    # Its own stream, so the teacher's coin flips leave the problem draw unchanged.
    teacher = random.Random(f"arithmetic_tasks.teacher:{seed}")
    sft = [
        PromptRecord(record.prompt, record.prompt + record.answer) if teacher.random() < sft_restate else record
        for record in train[:num_sft]
    ]
    if sft_worked:
        # Its own stream again: with sft_worked = 0 the files are those written before it existed.
        worker = random.Random(f"arithmetic_tasks.worked:{seed}")
        sft = [
            PromptRecord(record.prompt, worked_answer(operands_of(record.prompt)))
            if worker.random() < sft_worked and record.answer == true.answer else record
            for record, true in zip(sft, train)
        ]
    if sft_worked_demos:
        demonstrator = random.Random(f"arithmetic_tasks.worked_demos:{seed}")
        sft = [
            PromptRecord(record.prompt + WORKED_MARKER, worked_answer(operands_of(record.prompt)).removeprefix(WORKED_MARKER))
            if demonstrator.random() < sft_worked_demos and record.answer == true.answer else record
            for record, true in zip(sft, train)
        ]
    return TaskData(train=train, sft=sft, test=test)


class TaskFiles(Protocol):
    """What a task's files are made of (TaskData here, make_tool_task's ToolTaskData)."""

    train: list[PromptRecord]
    sft: list[PromptRecord]
    test: list[PromptRecord]

    def corpus_lines(self) -> list[str]: ...


def write_task_data(out_dir: Path, data: TaskFiles) -> list[Path]:
    """The task's train.jsonl, sft.jsonl, test.jsonl and corpus.txt (tokenizer training text), each atomically."""
    files = {
        "train.jsonl": format_jsonl(data.train),
        "sft.jsonl": format_jsonl(data.sft),
        "test.jsonl": format_jsonl(data.test),
        "corpus.txt": "".join(line + "\n" for line in data.corpus_lines()),
    }
    paths = []
    for name, text in files.items():
        atomic_write_text(out_dir / name, text)
        paths.append(out_dir / name)
    return paths
