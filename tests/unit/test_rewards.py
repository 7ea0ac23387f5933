"""Verifiers, the reward registry and user-function specs, and failure-tolerant scoring."""

from __future__ import annotations

import logging
import math

import pytest

from megacispo.data.prompts import PromptRecord
from megacispo.data.rewards import (
    MAX_LOGGED_FAILURES,
    RewardFailureError,
    boxed_math,
    exact_match,
    get_reward_fn,
    last_boxed,
    last_number,
    numeric,
    reward_names,
    score_responses,
)


def record(answer: str, **extra) -> PromptRecord:
    return PromptRecord(prompt="What is it?", answer=answer, extra=extra)


@pytest.mark.parametrize(
    "response, answer, expected",
    [
        ("19", "19", 1.0),
        ("  19\n", "19", 1.0),
        ("19", " 19 ", 1.0),
        ("18", "19", 0.0),
        ("1 9", "19", 0.0),
        ("19.0", "19", 0.0),
        ("", "19", 0.0),
        ("", "", 1.0),
    ],
)
def test_exact_match(response, answer, expected):
    assert exact_match(response, record(answer)) == expected


@pytest.mark.parametrize(
    "response, answer, expected",
    [
        ("The answer is 19.", "19", 1.0),
        ("first 3, then 4, so 19", "19", 1.0),
        ("19 or maybe 20", "19", 0.0),
        ("-7", "-7", 1.0),
        ("it is \u22127", "-7", 1.0),  # Unicode minus
        ("12-7=5", "5", 1.0),  # "-7" inside an expression is an operator, not a sign
        ("12-7", "-7", 0.0),
        ("x = -2.50", "-2.5", 1.0),
        ("0.1 + 0.2 = 0.30000000000000004", "0.3", 1.0),  # within the tolerance
        ("0.31", "0.3", 0.0),
        ("about .5", "0.5", 1.0),
        ("1,234,567 apples", "1234567", 1.0),
        ("1e3", "1000", 1.0),
        ("12345678901234567891", "12345678901234567890", 0.0),  # exact beyond float precision
        ("12345678901234567890", "12345678901234567890.0", 1.0),
        ("no number here", "19", 0.0),
        ("", "0", 0.0),
    ],
)
def test_numeric(response, answer, expected):
    assert numeric(response, record(answer)) == expected


def test_numeric_uses_the_records_tolerance():
    assert numeric("3.14", record("3.14159", tolerance=0.01)) == 1.0
    assert numeric("3.14", record("3.14159")) == 0.0


def test_numeric_rejects_a_non_numeric_answer():
    with pytest.raises(ValueError, match="answer 'nineteen' is not a number"):
        numeric("19", record("nineteen"))


def test_last_number_reference():
    assert last_number("a 1 b -2.5 c") == last_number("-2.5")
    assert last_number("v2") is not None and last_number("") is None


@pytest.mark.parametrize(
    "response, answer, expected",
    [
        ("so \\boxed{19}", "19", 1.0),
        ("\\boxed{18} no wait \\boxed{19}", "19", 1.0),
        ("\\boxed{19} no wait \\boxed{18}", "19", 0.0),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1.0),  # nested braces
        ("\\boxed{\\dfrac{1}{2}}", "\\frac12", 1.0),  # another spelling of 1/2 (math-verify parses both)
        ("\\boxed{ \\dfrac{1}{ 2 } }", "\\frac{1}{2}", 1.0),
        ("\\boxed{\\left( 1, \\sqrt{2} \\right)}", "(1,\\sqrt{2})", 1.0),
        ("\\boxed{0.50}", "0.5", 1.0),
        ("\\boxed{1,000}", "1000", 1.0),
        ("\\boxed{-3}", "-3", 1.0),
        ("\\boxed{$42$.}", "42", 1.0),
        ("\\boxed{\\text{yes}}", "yes", 1.0),
        ("\\fbox{7}", "7", 1.0),
        ("\\boxed {7}", "7", 1.0),
        ("the answer is 19", "19", 0.0),  # no box
        ("\\boxed{19", "19", 0.0),  # unclosed box
        ("\\boxed{19}", "The solution is \\boxed{19}.", 1.0),  # boxed reference answer
    ],
)
def test_boxed_math(response, answer, expected):
    assert boxed_math(response, record(answer)) == expected


def test_last_boxed_skips_an_unclosed_last_box():
    assert last_boxed("\\boxed{a{b}c} then \\boxed{d") == "a{b}c"
    assert last_boxed("\\boxed{}") == ""
    assert last_boxed("boxed{1}") is None


# ---------------------------------------------------------------------------------------------
# Registry and user functions
# ---------------------------------------------------------------------------------------------


def test_registered_names():
    assert reward_names() == ["boxed_math", "exact_match", "numeric"]
    assert get_reward_fn("numeric") is numeric


def test_unknown_name_lists_the_registered_ones():
    with pytest.raises(ValueError, match=r"'nope'.*boxed_math, exact_match, numeric.*module:function"):
        get_reward_fn("nope")


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A module `my_rewards_mod` in a temporary directory on sys.path."""
    (tmp_path / "my_rewards_mod.py").write_text(
        "def length_reward(response, record):\n"
        "    return float(len(response) == len(record.answer))\n"
        "class Scorer:\n"
        "    @staticmethod\n"
        "    def score(response, record):\n"
        "        return 0.5\n"
        "NOT_CALLABLE = 3\n"
        "def one_argument(response):\n"
        "    return 1.0\n"
    )
    (tmp_path / "broken_rewards_mod.py").write_text("import module_that_does_not_exist_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_rewards_mod"


def test_user_function_is_loaded(user_module):
    reward_fn = get_reward_fn(f"{user_module}:length_reward")
    assert reward_fn("ab", record("xy")) == 1.0 and reward_fn("abc", record("xy")) == 0.0
    assert get_reward_fn(f"{user_module}:Scorer.score")("a", record("b")) == 0.5


@pytest.mark.parametrize(
    "spec, message",
    [
        ("my_rewards_mod", "unknown reward name"),
        ("my_rewards_mod:", "needs both parts of 'module:function'"),
        (":length_reward", "needs both parts of 'module:function'"),
        ("no_such_module_xyz:fn", "module 'no_such_module_xyz' not found; put its directory on PYTHONPATH"),
        ("broken_rewards_mod:fn", "importing module 'broken_rewards_mod' failed"),
        ("my_rewards_mod:missing", "has no attribute 'missing'"),
        ("my_rewards_mod:NOT_CALLABLE", "'NOT_CALLABLE' is a int, not a function"),
        ("my_rewards_mod:one_argument", "cannot be called as fn\\(response, record\\)"),
    ],
)
def test_bad_user_spec_is_named(user_module, spec, message):
    with pytest.raises(ValueError) as error:
        get_reward_fn(spec)
    assert f"reward {spec!r}" in str(error.value)
    assert message.replace("\\", "") in str(error.value)


# ---------------------------------------------------------------------------------------------
# Safe scoring
# ---------------------------------------------------------------------------------------------


def flaky_reward(response: str, record: PromptRecord) -> float:
    if response == "boom":
        raise RuntimeError("verifier crashed")
    if response == "nan":
        return math.nan
    if response == "text":
        return "high"  # type: ignore[return-value]
    if response == "quoted":
        return "1.0"  # type: ignore[return-value]
    return response == record.answer  # type: ignore[return-value]  # a bool is a reward: 0 or 1


def test_failing_rewards_are_counted_and_get_the_failure_reward(caplog):
    records = [PromptRecord("p" + "x" * 500, "1"), PromptRecord("q", "2"), PromptRecord("r", "3")] * 2
    responses = ["1", "boom", "3", "nan", "2", "text"]
    with caplog.at_level(logging.WARNING, logger="megacispo.data.rewards"):
        scores = score_responses(flaky_reward, responses, records, failure_reward=-1.0)
    assert scores.rewards == [1.0, -1.0, 1.0, -1.0, 1.0, -1.0]
    assert scores.num_failures == 3
    messages = [entry.getMessage() for entry in caplog.records]
    assert len(messages) == 3
    assert "RuntimeError: verifier crashed" in messages[0] and "'boom'" in messages[0] and "'q'" in messages[0]
    assert "returned nan" in messages[1] and "(501 chars)" in messages[1], "long prompts are truncated"
    assert "returned str 'high', not a number" in messages[2]
    assert scores.first_failure == "raised RuntimeError: verifier crashed for prompt 'q', response 'boom'"


def test_a_string_is_no_reward_even_when_it_reads_as_a_number():
    scores = score_responses(flaky_reward, ["quoted", "1", "2"], [record("1")] * 3, failure_reward=-1.0)
    assert scores.rewards == [-1.0, 1.0, 0.0] and scores.num_failures == 1, "True and False are 1 and 0"
    assert scores.first_failure.startswith("returned str '1.0', not a number")


def test_reward_failure_error_names_the_reward_the_limit_the_first_failure_and_the_fix():
    error = RewardFailureError("my_rewards:score", 1.0, 0.5, "raised KeyError: 'x' for prompt 'q', response 'a'")
    assert str(error) == (
        "rl.reward = 'my_rewards:score' failed on 100% of a step's samples, more than rl.max_reward_failure_frac = "
        "0.5; the first: raised KeyError: 'x' for prompt 'q', response 'a'. Fix the reward function (a reward is a "
        "number), or raise rl.max_reward_failure_frac"
    )


def test_many_failures_are_summarized(caplog):
    def always_raises(response, record):
        raise KeyError(response)

    with caplog.at_level(logging.WARNING, logger="megacispo.data.rewards"):
        scores = score_responses(always_raises, ["a"] * 10, [record("1")] * 10, failure_reward=0.0)
    assert scores.rewards == [0.0] * 10 and scores.num_failures == 10
    assert len(caplog.records) == MAX_LOGGED_FAILURES + 1
    assert "failed on 10 of 10 samples" in caplog.records[-1].getMessage()


def test_score_responses_checks_lengths():
    with pytest.raises(ValueError, match="2 responses but 1 records"):
        score_responses(exact_match, ["a", "b"], [record("a")], failure_reward=0.0)
