"""Prompt JSONL loading, SFT tokens, the resumable sampler, and the arithmetic task generator."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from arithmetic_tasks import ArithmeticTask, evaluate, generate_task_data

from megacispo.data.prompts import (
    PromptLimit,
    PromptRecord,
    PromptSampler,
    build_sft_example,
    collate_sft,
    encode_prompt,
    format_jsonl,
    load_prompts,
    prompt_token_ids,
)
from megacispo.testing.tool_modules import load_tool


def write_lines(tmp_path: Path, lines: list[str], name: str = "prompts.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------


def test_load_keeps_extra_fields_and_skips_blank_lines(tmp_path):
    path = write_lines(
        tmp_path,
        [
            '{"prompt": "12+7=", "answer": "19"}',
            "",
            '{"prompt": "é ✓", "answer": "-3.5", "tolerance": 0.1, "meta": {"source": "x", "ids": [1, 2]}}',
            "   ",
        ],
    )
    records = load_prompts(path)
    assert records == [
        PromptRecord("12+7=", "19", {}),
        PromptRecord("é ✓", "-3.5", {"tolerance": 0.1, "meta": {"source": "x", "ids": [1, 2]}}),
    ]


def test_format_jsonl_round_trips(tmp_path):
    records = [PromptRecord("1+1=", "2", {"k": [1, "ü"]}), PromptRecord('quote " and \\', "x\ny")]
    path = tmp_path / "out.jsonl"
    path.write_text(format_jsonl(records), encoding="utf-8")
    assert load_prompts(path) == records


@pytest.mark.parametrize(
    "bad_line, expected",
    [
        ('{"prompt": "1+1=", "answer": "2"', "invalid JSON"),
        ("[1, 2]", "expected a JSON object, got list"),
        ('"just a string"', "expected a JSON object, got str"),
        ('{"answer": "2"}', "missing field 'prompt'"),
        ('{"prompt": "1+1="}', "missing field 'answer'"),
        ('{"prompt": "1+1=", "answer": true}', "field 'answer' must be a string (or a number), got bool True"),
        ('{"prompt": "1+1=", "answer": [2]}', "field 'answer' must be a string (or a number), got list [2]"),
        ('{"prompt": [{"role": "user", "content": "1+1="}], "answer": "2"}',
         "field 'prompt' is a list of chat messages, which only data.chat_template: true renders"),
        ('{"prompt": null, "answer": "2"}', "field 'prompt' must be a string, got NoneType"),
    ],
)
def test_bad_line_names_file_and_line(tmp_path, bad_line, expected):
    # The bad line is the 3rd of the file (a blank line before it still counts).
    path = write_lines(tmp_path, ['{"prompt": "a", "answer": "b"}', "", bad_line, '{"prompt": "c", "answer": "d"}'])
    with pytest.raises(ValueError) as error:
        load_prompts(path)
    assert f"{path}:3:" in str(error.value)
    assert expected in str(error.value)


def test_non_utf8_line_names_file_and_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"prompt": "a", "answer": "b"}\n{"prompt": "\xe9", "answer": "b"}\n')
    with pytest.raises(ValueError, match=rf"{path}:2: not UTF-8"):
        load_prompts(path)


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_empty_file_is_an_error(tmp_path, content):
    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=rf"{path}: no records"):
        load_prompts(path)


def test_missing_file_names_the_path(tmp_path):
    path = tmp_path / "nope.jsonl"
    with pytest.raises(ValueError, match="nope.jsonl"):
        load_prompts(path)


# ---------------------------------------------------------------------------------------------
# SFT tokens
# ---------------------------------------------------------------------------------------------


class CharTokenizer:
    """One id per character, offset past the specials: makes expected ids easy to write down."""

    pad_id, bos_id, eos_id = 0, 2, 3

    def encode(self, text: str) -> list[int]:
        return [10 + ord(char) - ord("0") if char.isdigit() else 30 + "+-=".index(char) for char in text]


def test_an_empty_answer_trains_the_eos_alone_and_an_empty_prompt_is_bos_alone():
    """Catalog 3 (#56): a pair with an empty answer is a one-token target (the model learns to stop), and
    an empty prompt is [BOS] (an environment's reset may give the conversation): neither a zero-length
    sequence nor a loss over nothing."""
    tokenizer = CharTokenizer()
    example = build_sft_example(tokenizer, PromptRecord("1+2=", ""))
    batch = collate_sft([example], pad_id=tokenizer.pad_id)
    assert batch.labels[batch.loss_mask.bool()].tolist() == [tokenizer.eos_id]
    assert prompt_token_ids(tokenizer, PromptRecord("", "3")) == [tokenizer.bos_id]


def test_sft_example_and_collate_align_labels_with_the_answer():
    tokenizer = CharTokenizer()
    short = build_sft_example(tokenizer, PromptRecord("1+2=", "3"))
    long = build_sft_example(tokenizer, PromptRecord("12+34=", "46"))
    assert short.token_ids == [2, 11, 30, 12, 32, 13, 3]
    assert short.num_prompt_tokens == 5 and encode_prompt(tokenizer, "1+2=") == short.token_ids[:5]

    batch = collate_sft([short, long], pad_id=tokenizer.pad_id)
    assert batch.input_ids.shape == batch.labels.shape == batch.loss_mask.shape == (2, 9)
    full = torch.tensor([short.token_ids + [0, 0, 0], long.token_ids])
    assert torch.equal(batch.input_ids, full[:, :-1]) and torch.equal(batch.labels, full[:, 1:])
    # The loss covers exactly the labels that are answer tokens or the EOS.
    for row, example in enumerate([short, long]):
        expected = [
            float(example.num_prompt_tokens <= position + 1 < len(example.token_ids)) for position in range(9)
        ]
        assert batch.loss_mask[row].tolist() == expected
    assert batch.labels[batch.loss_mask.bool()].tolist() == [13, 3, 14, 16, 3]
    # Padding: the input positions after each sequence's last token (the short one has 7).
    assert batch.padding_mask.tolist() == [[False] * 7 + [True] * 2, [False] * 9]


def test_sft_example_longer_than_max_length_raises():
    with pytest.raises(ValueError, match="10 tokens, more than max_length=9"):
        build_sft_example(CharTokenizer(), PromptRecord("12+34=", "46"), max_length=9)


# ---------------------------------------------------------------------------------------------
# Prompt length: PromptLimit
# ---------------------------------------------------------------------------------------------


class CountingTokenizer(CharTokenizer):
    def __init__(self):
        self.texts: list[str] = []

    def encode(self, text: str) -> list[int]:
        self.texts.append(text)
        return super().encode(text)


def write_prompts(tmp_path: Path, prompts: list[str]) -> Path:
    return write_lines(tmp_path, [json.dumps({"prompt": prompt, "answer": "1"}) for prompt in prompts])


def limit(max_tokens: int, overlong: str = "error", **options) -> PromptLimit:
    return PromptLimit(CountingTokenizer(), max_tokens, f"the limit = {max_tokens}", overlong, **options)


def test_limit_tokenizes_each_prompt_once_as_it_loads(tmp_path):
    fit = limit(7)
    records = load_prompts(write_prompts(tmp_path, ["1+2=", "12+34="]), fit)
    assert [record.prompt_ids for record in records] == [(2, 11, 30, 12, 32), (2, 11, 12, 30, 13, 14, 32)]
    assert fit.tokenizer.texts == ["1+2=", "12+34="]
    # Rollouts and SFT start from the stored ids: nothing is tokenized again.
    assert prompt_token_ids(fit.tokenizer, records[1]) == [2, 11, 12, 30, 13, 14, 32]
    assert build_sft_example(fit.tokenizer, records[0]).token_ids == [2, 11, 30, 12, 32, 11, 3]
    assert fit.tokenizer.texts == ["1+2=", "12+34=", "1"]  # the answer only
    assert records[0] == PromptRecord("1+2=", "1", prompt_ids=(2, 11, 30, 12, 32))
    assert "prompt_ids" not in repr(records[0]), "a 100k-token prompt would flood every message that shows a record"


def test_overlong_prompt_is_an_error_naming_line_length_limit_and_fix(tmp_path):
    path = write_prompts(tmp_path, ["1+2=", "12+34="])
    with pytest.raises(ValueError) as error:
        load_prompts(path, limit(6))
    assert str(error.value) == (
        f"{path}:2: the prompt ([BOS] + prompt) is 7 tokens, more than the limit = 6; shorten it, or set "
        "data.overlong_prompts to skip or truncate_left"
    )


def test_overlong_prompts_are_skipped_and_counted(tmp_path):
    fit = limit(6, "skip")
    records = load_prompts(write_prompts(tmp_path, ["12+34=", "1+2=", "99+99="]), fit)
    assert [record.prompt for record in records] == ["1+2="]
    assert (fit.num_skipped, fit.num_truncated) == (2, 0)
    with pytest.raises(ValueError, match=r"all 3 records are longer than the limit = 4 and data.overlong_prompts"):
        load_prompts(write_prompts(tmp_path, ["12+34=", "1+2=", "99+99="]), limit(4, "skip"))


def test_overlong_prompts_keep_bos_and_their_end(tmp_path):
    fit = limit(5, "truncate_left")
    records = load_prompts(write_prompts(tmp_path, ["12+34=", "1+2="]), fit)
    assert records[0].prompt == "12+34=", "the text stays whole for the reward"
    assert records[0].prompt_ids == (2, 30, 13, 14, 32)
    assert records[1].prompt_ids == (2, 11, 30, 12, 32)
    assert (fit.num_skipped, fit.num_truncated) == (0, 1)


def test_an_sft_pair_must_fit_whole(tmp_path):
    path = write_lines(tmp_path, ['{"prompt": "12+34=", "answer": "46"}'])  # 7 + 2 + EOS = 10 tokens
    with pytest.raises(ValueError, match=rf"{path}:1: the pair \(\[BOS\] \+ prompt \+ answer \+ EOS\) is 10 tokens"):
        load_prompts(path, limit(9, with_answer=True))
    fit = limit(9, "truncate_left", with_answer=True)
    [record] = load_prompts(path, fit)
    assert build_sft_example(fit.tokenizer, record).token_ids == [2, 12, 30, 13, 14, 32, 14, 16, 3]
    with pytest.raises(ValueError, match=r"its answer alone \(3 tokens with EOS\) leaves no room for the prompt"):
        load_prompts(path, limit(3, "truncate_left", with_answer=True))


# ---------------------------------------------------------------------------------------------
# Sampler
# ---------------------------------------------------------------------------------------------


def make_records(count: int) -> list[PromptRecord]:
    return [PromptRecord(f"p{i}", f"a{i}") for i in range(count)]


def draw(sampler: PromptSampler, batch_sizes: list[int]) -> list[str]:
    return [record.prompt for size in batch_sizes for record in sampler.next_batch(size)]


def test_sampler_is_deterministic_by_seed():
    records = make_records(23)
    sizes = [4, 7, 1, 9, 5, 8]
    assert draw(PromptSampler(records, seed=3), sizes) == draw(PromptSampler(records, seed=3), sizes)
    assert draw(PromptSampler(records, seed=3), sizes) != draw(PromptSampler(records, seed=4), sizes)


def test_sampler_covers_every_prompt_once_per_epoch():
    records = make_records(17)
    sampler = PromptSampler(records, seed=0)
    # Batch size 5 does not divide 17: batches straddle epoch boundaries.
    prompts = draw(sampler, [5] * 17)  # 85 prompts = exactly 5 epochs
    epochs = [prompts[start : start + 17] for start in range(0, 85, 17)]
    for epoch in epochs:
        assert Counter(epoch) == Counter(record.prompt for record in records)
    assert len({tuple(epoch) for epoch in epochs}) == 5, "each epoch should have its own order"
    # The next epoch starts lazily, on the next draw.
    assert (sampler.epoch, sampler.position) == (4, 17)


def test_sampler_state_dict_round_trip_continues_identically():
    records = make_records(13)
    sizes_before, sizes_after = [3, 6, 5], [4, 13, 2, 7, 1]
    uninterrupted = PromptSampler(records, seed=11)
    draw(uninterrupted, sizes_before)
    expected = draw(uninterrupted, sizes_after)

    stopped = PromptSampler(records, seed=11)
    draw(stopped, sizes_before)
    # Through JSON: the state must survive a checkpoint file as plain values.
    state = json.loads(json.dumps(stopped.state_dict()))
    resumed = PromptSampler(records, seed=11)
    resumed.load_state_dict(state)
    assert (resumed.epoch, resumed.position) == (stopped.epoch, stopped.position) == (1, 1)
    assert draw(resumed, sizes_after) == expected


def test_sampler_rejects_state_of_other_data_or_seed():
    state = PromptSampler(make_records(5), seed=1).state_dict()
    with pytest.raises(ValueError, match="seed=1"):
        PromptSampler(make_records(5), seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="num_records=5"):
        PromptSampler(make_records(6), seed=1).load_state_dict(state)
    changed = make_records(5)
    changed[2] = PromptRecord("other", "a2")
    with pytest.raises(ValueError, match="fingerprint"):
        PromptSampler(changed, seed=1).load_state_dict(state)


def test_sampler_rejects_bad_arguments():
    with pytest.raises(ValueError, match="no records"):
        PromptSampler([], seed=0)
    with pytest.raises(ValueError, match="seed=-1"):
        PromptSampler(make_records(2), seed=-1)
    with pytest.raises(ValueError, match="batch_size=0"):
        PromptSampler(make_records(2), seed=0).next_batch(0)


# ---------------------------------------------------------------------------------------------
# Arithmetic tasks
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "task",
    [ArithmeticTask("addition"), ArithmeticTask("subtraction", digits=2), ArithmeticTask("add_sub", 2, 3)],
)
def test_task_answers_are_correct_and_train_test_disjoint(task):
    data = generate_task_data(task, num_train=300, num_test=80, seed=5, num_sft=50)
    assert len(data.train) == 300 and len(data.test) == 80 and data.sft == data.train[:50]
    for record in data.train + data.test:
        expression = record.prompt
        assert expression.endswith("=") and set(expression[:-1]) <= set("0123456789" + "".join(task.operators))
        # Python evaluates + and - left to right, the task's rule.
        assert int(record.answer) == eval(expression[:-1])  # noqa: S307 (digits and +- only, checked above)
        assert expression.count("+") + expression.count("-") == task.num_operands - 1
    prompts = [record.prompt for record in data.train + data.test]
    assert len(set(prompts)) == len(prompts), "problems must be distinct, so train and test are disjoint"


def test_task_is_deterministic_by_seed():
    task = ArithmeticTask("add_sub", digits=2)
    first = generate_task_data(task, 100, 20, seed=7)
    assert first == generate_task_data(task, 100, 20, seed=7)
    assert first.train != generate_task_data(task, 100, 20, seed=8).train


def test_task_can_use_its_whole_problem_space():
    task = ArithmeticTask("addition", digits=1)
    assert task.num_problems == 100
    data = generate_task_data(task, 90, 10, seed=0)
    assert {record.prompt for record in data.train + data.test} == {f"{a}+{b}=" for a in range(10) for b in range(10)}
    with pytest.raises(ValueError, match="exceeds the 100 distinct problems"):
        generate_task_data(task, 90, 11, seed=0)


def test_problem_indexing_covers_operators():
    task = ArithmeticTask("add_sub", digits=1, num_operands=3)
    problems = [task.problem(index) for index in range(task.num_problems)]
    assert len({record.prompt for record in problems}) == task.num_problems == 10**3 * 2**2
    assert evaluate([9, 3, 4], ["-", "+"]) == 10


def test_wordy_teacher_restates_the_question_in_sft_answers_only():
    task = ArithmeticTask("add_sub", digits=2)
    exact = generate_task_data(task, 2000, 50, seed=1)
    wordy = generate_task_data(task, 2000, 50, seed=1, sft_restate=0.6)
    assert wordy.train == exact.train and wordy.test == exact.test, "RL and test answers stay bare numbers"
    restated = 0
    for sft, true in zip(wordy.sft, exact.sft):
        assert sft.prompt == true.prompt and sft.answer in (true.answer, true.prompt + true.answer)
        restated += sft.answer != true.answer
    # A coin flip per pair: within 4 binomial standard deviations of 0.6 * 2000.
    assert abs(restated - 1200) < 4 * (2000 * 0.6 * 0.4) ** 0.5
    always = generate_task_data(task, 2000, 50, seed=1, sft_restate=1.0)
    assert [record.answer for record in always.sft] == [r.prompt + r.answer for r in exact.sft]


@pytest.mark.parametrize("probability", [1.5, -0.1])
def test_wordy_teacher_rejects_a_bad_probability(probability):
    with pytest.raises(ValueError, match=f"sft_restate={probability} must be a probability"):
        generate_task_data(ArithmeticTask("addition"), 10, 5, seed=0, sft_restate=probability)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"name": "multiplication"}, "task='multiplication'"),
        ({"name": "addition", "digits": 0}, "digits=0"),
        ({"name": "addition", "num_operands": 1}, "num_operands=1"),
    ],
)
def test_task_rejects_bad_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ArithmeticTask(**kwargs)


def test_make_task_data_cli_writes_loadable_deterministic_files(tmp_path):
    make_task_data = load_tool("make_task_data")

    def run(out: Path) -> dict[str, bytes]:
        arguments = ["--out", str(out), "--task", "addition", "--num-train", "40", "--num-test", "10"]
        assert make_task_data.main(arguments + ["--num-sft", "15", "--seed", "3"]) == 0
        return {path.name: path.read_bytes() for path in sorted(out.iterdir())}

    files = run(tmp_path / "a")
    assert sorted(files) == ["corpus.txt", "sft.jsonl", "test.jsonl", "train.jsonl"], "no temporary files left"
    assert files == run(tmp_path / "b")
    train, test = load_prompts(tmp_path / "a" / "train.jsonl"), load_prompts(tmp_path / "a" / "test.jsonl")
    assert len(train) == 40 and len(test) == 10 and load_prompts(tmp_path / "a" / "sft.jsonl") == train[:15]
    assert not {r.prompt for r in train} & {r.prompt for r in test}
    assert files["corpus.txt"].decode().splitlines() == [text for r in train for text in (r.prompt, r.answer)]


def test_make_task_data_cli_writes_the_wordy_teachers_sft_pairs(tmp_path):
    arguments = ["--out", str(tmp_path), "--num-train", "30", "--num-test", "5", "--seed", "0", "--sft-restate", "1"]
    assert load_tool("make_task_data").main(arguments) == 0
    train, sft = load_prompts(tmp_path / "train.jsonl"), load_prompts(tmp_path / "sft.jsonl")
    assert [record.answer for record in sft] == [record.prompt + record.answer for record in train]


def test_make_task_data_cli_reports_bad_counts(tmp_path, capsys):
    arguments = ["--out", str(tmp_path), "--digits", "1", "--num-train", "95", "--num-test", "10", "--seed", "0"]
    assert load_tool("make_task_data").main(arguments) == 2
    assert "exceeds the 100 distinct problems" in capsys.readouterr().err
    assert not list(tmp_path.iterdir()), "a failed run must write nothing"
