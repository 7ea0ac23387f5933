"""The built-in environments (python, guess_number) and the data tools/make_tool_task.py writes for them.

Each python tool call starts a sandboxed Python process (tens of ms), so the tests make few of them."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from megacispo.data.prompts import PromptRecord, load_prompts
from megacispo.envs.base import EnvStep, check_step, get_environment_factory, make_environment
from megacispo.envs.builtin import GuessNumber, PythonTool
from megacispo.testing.tool_modules import load_tool

PRODUCT = PromptRecord(prompt="37*58=", answer="2146")


def python_tool(**params) -> PythonTool:
    env = make_environment(get_environment_factory("python"), params, "python")
    assert isinstance(env, PythonTool)
    assert env.reset(PRODUCT) is None, "the record's prompt is the first message"
    return env


def tool_step(env: PythonTool, message: str) -> EnvStep:
    step = check_step(env.step(message))
    assert not step.done and step.reward == 0.0 and len(step.messages) == 1 and step.messages[0]["role"] == "tool"
    return step


# ---------------------------------------------------------------------------------------------
# python
# ---------------------------------------------------------------------------------------------


def test_python_tool_runs_calls_and_grades_the_final_answer():
    env = python_tool(reply_format="Output: {output}")
    step = tool_step(env, "Let me compute. <python>37*58</python>")
    assert step.messages[0]["content"] == "Output: 2146", "an expression's value is printed, as in a REPL"
    assert step.metrics == {"tool_calls": 1, "tool_failures": 0, "tool_timeouts": 0, "tool_limit": 0,
                            "answered": 0, "correct_tool_use": 0}
    step = tool_step(env, "<python>x = 6\nprint(x * 7, end='  \\n')</python> ignored after the call")
    assert step.messages[0]["content"] == "Output: 42", "a program's stdout, stripped"
    final = check_step(env.step("So 37*58 is 2146."))
    assert final == EnvStep([], 1.0, True, {"tool_calls": 0, "tool_failures": 0, "tool_timeouts": 0, "tool_limit": 0,
                                            "answered": 1, "correct_tool_use": 1})


@pytest.mark.parametrize("tool_code, answer, reward, correct_tool_use", [
    ("37*58", "2146", 1.0, 1.0),
    ("37*58", "2147", 0.0, 0.0),    # the tool found it, the answer is wrong
    ("37+58", "2146", 1.0, 0.0),    # right without the tool's help
    (None, "about 2146.0", 1.0, 0.0),
    (None, "no number", 0.0, 0.0),
])
def test_python_tool_counts_correct_tool_use(tool_code, answer, reward, correct_tool_use):
    env = python_tool(open_tag="[py]", close_tag="[/py]")
    if tool_code is not None:
        tool_step(env, f"[py]{tool_code}[/py]")
    final = check_step(env.step(answer))
    assert (final.reward, final.done, final.metrics["correct_tool_use"]) == (reward, True, correct_tool_use)


def test_python_tool_reports_errors_and_timeouts():
    env = python_tool(limits={"wall_s": 0.5, "cpu_s": 2.0})
    step = tool_step(env, "<python>1/0</python>")
    assert step.messages[0]["content"] == "error: ZeroDivisionError: division by zero"
    assert (step.metrics["tool_failures"], step.metrics["tool_timeouts"]) == (1, 0)
    step = tool_step(env, "<python>while True: pass</python>")
    assert step.messages[0]["content"] == "error: timeout"
    assert (step.metrics["tool_failures"], step.metrics["tool_timeouts"]) == (1, 1)


def test_python_tool_ends_the_conversation_past_max_tool_calls():
    env = python_tool(max_tool_calls=1)
    assert tool_step(env, "<python>2**10</python>").messages[0]["content"] == "1024"
    step = check_step(env.step("<python>2146</python>"))
    assert (step.reward, step.done) == (0.0, True)
    assert step.messages == [{"role": "tool", "content": "error: too many tool calls"}]
    assert (step.metrics["tool_calls"], step.metrics["tool_limit"], step.metrics["answered"]) == (1, 1, 0)


def test_python_tool_takes_an_unclosed_call_for_the_final_answer():
    env = python_tool()
    final = check_step(env.step("<python>37*58 = 2146"))
    assert (final.reward, final.done, final.metrics["tool_calls"]) == (1.0, True, 0)


@pytest.mark.parametrize("params, message", [
    ({"limits": {"wall": 1}}, "unknown field.*'wall'.*wall_s"),
    ({"reply_format": "{out}"}, "reply_format = '{out}'"),
    ({"close_tag": ""}, "close_tag = ''"),
    ({"max_tool_calls": -1}, "max_tool_calls = -1"),
])
def test_python_tool_rejects_bad_params(params, message):
    with pytest.raises(ValueError, match=message):
        make_environment(get_environment_factory("python"), params, "python")


def test_environments_reject_non_numeric_answers_and_steps_before_reset():
    with pytest.raises(RuntimeError, match="before reset"):
        PythonTool().step("2146")
    with pytest.raises(ValueError, match="answer 'many' .* not a number"):
        PythonTool().reset(PromptRecord("37*58=", "many"))
    with pytest.raises(ValueError, match="not an integer"):
        GuessNumber().reset(PromptRecord("guess 1-4:", "2.5"))


# ---------------------------------------------------------------------------------------------
# guess_number
# ---------------------------------------------------------------------------------------------


def test_guess_number_answers_higher_lower_and_ends_at_the_secret():
    env = make_environment(get_environment_factory("guess_number"), {"lower": "too high"}, "guess_number")
    assert env.reset(PromptRecord("guess 1-32:", "20")) is None
    higher = check_step(env.step("16"))
    assert higher == EnvStep([{"role": "user", "content": "higher"}], 0.0, False, {"guesses": 1, "invalid": 0})
    lower = check_step(env.step("after 16, I guess 24"))
    assert lower.messages == [{"role": "user", "content": "too high"}] and not lower.done
    assert check_step(env.step("20")) == EnvStep([], 1.0, True, {"guesses": 1, "invalid": 0})


def test_guess_number_ends_a_game_at_a_turn_without_a_number():
    env = GuessNumber()
    env.reset(PromptRecord("guess 1-32:", "20"))
    assert check_step(env.step("no idea")) == EnvStep([], 0.0, True, {"guesses": 1, "invalid": 1})


# ---------------------------------------------------------------------------------------------
# tools/make_tool_task.py
# ---------------------------------------------------------------------------------------------


def make_task(out: Path, *arguments: str) -> dict[str, bytes]:
    assert load_tool("make_tool_task").main(["--out", str(out), *arguments]) == 0
    files = {path.name: path.read_bytes() for path in sorted(out.iterdir())}
    assert sorted(files) == ["corpus.txt", "sft.jsonl", "test.jsonl", "train.jsonl"], "no temporary files left"
    return files


def loaded(out: Path) -> tuple[list[PromptRecord], list[PromptRecord], list[PromptRecord]]:
    return load_prompts(out / "train.jsonl"), load_prompts(out / "test.jsonl"), load_prompts(out / "sft.jsonl")


def replay(env, record: PromptRecord) -> float:
    """Play a demonstration's assistant turns against ``env``; each reply must be the demo's next turns."""
    env.reset(record)
    turns = record.extra["turns"]
    index, step = 0, None
    while index < len(turns):
        assert turns[index]["role"] == "assistant", turns
        step = check_step(env.step(turns[index]["content"]))
        replies = turns[index + 1:index + 1 + len(step.messages)]
        assert step.messages == replies, f"the environment answers {step.messages}, the demo {replies}"
        index += 1 + len(step.messages)
        assert step.done == (index == len(turns)), "the demo ends where the conversation does"
    return step.reward


def corpus_covers(files: dict[str, bytes], records: list[PromptRecord]) -> None:
    corpus = set(files["corpus.txt"].decode())
    texts = [record.prompt for record in records] + [turn["content"] for r in records for turn in r.extra["turns"]]
    missing = set("".join(texts)) - corpus
    assert not missing, f"characters the tokenizer would not learn: {missing}"


def test_make_tool_task_writes_multiply_demos_the_python_tool_replays(tmp_path):
    arguments = ["--task", "multiply", "--num-train", "40", "--num-test", "10", "--seed", "1", "--sft-tool-frac", "0.3"]
    files = make_task(tmp_path / "a", *arguments)
    assert files == make_task(tmp_path / "b", *arguments), "the same seed gives the same files"
    assert files != make_task(tmp_path / "c", *arguments[:-3], "2", *arguments[-2:]), "another seed, other problems"
    train, test, sft = loaded(tmp_path / "a")
    assert len(train) == 40 and len(test) == 10 and not {r.prompt for r in train} & {r.prompt for r in test}
    for record in train + test:
        a, b = map(int, record.prompt.removesuffix("=").split("*"))
        assert 10 <= a < 100 and 10 <= b < 100 and record.answer == str(a * b)
    assert [(r.prompt, r.answer) for r in sft] == [(r.prompt, r.answer) for r in train]
    with_tool = [record for record in sft if len(record.extra["turns"]) == 3]
    direct = [record for record in sft if record.extra["turns"] == [{"role": "assistant", "content": record.answer}]]
    assert len(with_tool) == 12 and len(direct) == 28
    corpus_covers(files, sft)
    # Two tool calls and a direct answer keep the sandbox's process starts few.
    assert [replay(PythonTool(), record) for record in with_tool[:2] + direct[:1]] == [1.0, 1.0, 1.0]


def test_make_tool_task_writes_binary_search_demos(tmp_path):
    arguments = ["--task", "guess", "--num-train", "60", "--num-test", "20", "--seed", "0", "--max-number", "40"]
    files = make_task(tmp_path / "a", *arguments)
    assert files == make_task(tmp_path / "b", *arguments)
    train, test, sft = loaded(tmp_path / "a")
    pairs = {(r.prompt, r.answer) for r in train}
    assert len(pairs) == 60 and not pairs & {(r.prompt, r.answer) for r in test}
    for record in sft:
        high = int(record.prompt.removeprefix("guess 1-").removesuffix(":"))
        assert 2 <= high <= 40 and 1 <= int(record.answer) <= high
        guesses = [turn["content"] for turn in record.extra["turns"] if turn["role"] == "assistant"]
        assert guesses[-1] == record.answer and len(guesses) <= math.ceil(math.log2(high)) + 1, (record, guesses)
        assert replay(GuessNumber(), record) == 1.0
    corpus_covers(files, sft)


@pytest.mark.parametrize("arguments, message", [
    (["--task", "multiply", "--digits", "1", "--num-train", "95", "--num-test", "10"], "exceeds the 100 distinct"),
    (["--task", "guess", "--max-number", "4", "--num-train", "9", "--num-test", "1"], "exceeds the 9 distinct"),
    (["--task", "guess", "--num-train", "9", "--num-test", "1", "--sft-tool-frac", "0.5"], "applies to --task"),
    (["--task", "multiply", "--num-train", "9", "--num-test", "1", "--sft-tool-frac", "1.5"], "sft_tool_frac=1.5"),
])
def test_make_tool_task_reports_bad_settings(tmp_path, capsys, arguments, message):
    assert load_tool("make_tool_task").main(["--out", str(tmp_path), "--seed", "0", *arguments]) == 2
    assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir()), "a failed run must write nothing"
