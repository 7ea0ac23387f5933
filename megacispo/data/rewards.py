"""Rule-based verifiers behind one registry, and a scorer that survives a verifier that raises.

Every reward has the signature ``reward(response: str, record: PromptRecord) -> float``; the
record carries the reference answer and the prompt line's extra fields. ``get_reward_fn`` takes a
registered name (``exact_match``, ``numeric``, ``boxed_math``) or a user function as
``module:function``, imported at start-up so a typo fails before the first rollout.

A reward is a number: a float or an int, a bool (True is 1.0, as ``float(response == answer)``
would be) or a numpy or torch scalar. A string is not, even "1.0": it is a failure, like a raise,
NaN or infinity. A sample whose reward fails gets rl.failure_reward; a step whose samples fail
more often than rl.max_reward_failure_frac stops the run (``RewardFailureError``).
"""

from __future__ import annotations

import inspect
import logging
import math
import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Callable, Sequence

from megacispo.data.math_grading import math_equal
from megacispo.data.prompts import PromptRecord
from megacispo.plugins import import_object

logger = logging.getLogger(__name__)

RewardFn = Callable[[str, PromptRecord], float]

REWARD_FUNCTIONS: dict[str, RewardFn] = {}

# numeric: |prediction - answer| <= tolerance, compared exactly in Decimal. Absolute, not relative:
# a relative tolerance would equate 12345678901 and 12345678902, wrong for integer arithmetic. A
# record may carry its own tolerance in the extra field "tolerance".
NUMERIC_TOLERANCE = Decimal("1e-6")

# How much of a prompt or response a failure warning shows, and how many failures of one call are
# logged in full (a broken verifier fails on every sample; one line per sample would flood the log).
LOG_TRUNCATE_CHARS = 200
MAX_LOGGED_FAILURES = 3


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    def register(fn: RewardFn) -> RewardFn:
        if name in REWARD_FUNCTIONS:
            raise ValueError(f"reward {name!r} is already registered; pick another name")
        REWARD_FUNCTIONS[name] = fn
        return fn

    return register


def reward_names() -> list[str]:
    return sorted(REWARD_FUNCTIONS)


# ---------------------------------------------------------------------------------------------
# exact_match
# ---------------------------------------------------------------------------------------------


@register_reward("exact_match")
def exact_match(response: str, record: PromptRecord) -> float:
    """1.0 if the response equals the answer once surrounding whitespace is stripped, else 0.0."""
    return float(response.strip() == record.answer.strip())


# ---------------------------------------------------------------------------------------------
# numeric
# ---------------------------------------------------------------------------------------------

# A sign counts only where it cannot be a binary operator: "12-7" holds the numbers 12 and 7, not
# 12 and -7. Thousands separators only in their strict form (1,234,567), so "3,4" stays 3 and 4.
_NUMBER_PATTERN = re.compile(
    r"(?P<sign>(?<![\w)\]}.])[-+\u2212])?"
    r"(?P<body>\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d*)?|\.\d+)"
    r"(?P<exponent>[eE][-+]?\d+)?"
)


def _to_decimal(match: re.Match) -> Decimal:
    sign = "-" if match["sign"] in ("-", "\u2212") else ""
    return Decimal(sign + match["body"].replace(",", "") + (match["exponent"] or ""))


def last_number(text: str) -> Decimal | None:
    """The last number written in ``text`` (exact, as a Decimal), or None if there is none."""
    matches = list(_NUMBER_PATTERN.finditer(text))
    return _to_decimal(matches[-1]) if matches else None


def parse_number(text: str) -> Decimal | None:
    """``text`` as a number if it is exactly one (surrounding whitespace allowed), else None."""
    match = _NUMBER_PATTERN.fullmatch(text.strip())
    return _to_decimal(match) if match else None


def _numeric_tolerance(record: PromptRecord) -> Decimal:
    tolerance = record.extra.get("tolerance")
    if tolerance is None:
        return NUMERIC_TOLERANCE
    try:
        return Decimal(str(tolerance))
    except InvalidOperation as error:
        raise ValueError(f"record field 'tolerance'={tolerance!r} is not a number; write e.g. 0.01") from error


@register_reward("numeric")
def numeric(response: str, record: PromptRecord) -> float:
    """1.0 if the last number in the response equals the answer within tolerance, else 0.0."""
    target = parse_number(record.answer)
    if target is None:
        raise ValueError(f"answer {record.answer!r} is not a number; the 'numeric' reward needs numeric answers")
    prediction = last_number(response)
    if prediction is None:
        return 0.0
    return float(abs(prediction - target) <= _numeric_tolerance(record))


# ---------------------------------------------------------------------------------------------
# boxed_math
# ---------------------------------------------------------------------------------------------

_BOX_COMMANDS = ("\\boxed", "\\fbox")


def _braced_content(text: str, open_index: int) -> str | None:
    """Content of the {...} group opening at ``open_index``, nested braces included; None if unclosed."""
    depth = 0
    for index in range(open_index, len(text)):
        if text[index] == "{":
            depth += 1
        elif text[index] == "}":
            depth -= 1
            if depth == 0:
                return text[open_index + 1 : index]
    return None


def last_boxed(text: str) -> str | None:
    """Content of the last complete ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, or None."""
    starts = [(text.rfind(command), command) for command in _BOX_COMMANDS]
    start, command = max(starts)
    while start >= 0:
        brace = start + len(command)
        while brace < len(text) and text[brace] == " ":
            brace += 1
        if brace < len(text) and text[brace] == "{":
            content = _braced_content(text, brace)
            if content is not None:
                return content
        starts = [(text.rfind(cmd, 0, start), cmd) for cmd in _BOX_COMMANDS]
        start, command = max(starts)
    return None


@register_reward("boxed_math")
def boxed_math(response: str, record: PromptRecord) -> float:
    """1.0 if the last \\boxed{...} of the response equals the answer mathematically, else 0.0.

    The answer may itself be boxed (datasets often store the solution's final \\boxed{...}) or plain
    ("3/4", "1,000", "\\frac{1}{2}"). math-verify decides (``math_grading``): equivalent forms count,
    a percentage equals its number both ways (50\\% is 50 and 0.5), (1,2) and [1,2] are different
    intervals, and a comparison over ``math_grading.ANSWER_TIMEOUT_S`` scores 0.0.
    """
    predicted = last_boxed(response)
    if predicted is None:
        return 0.0
    reference = last_boxed(record.answer)
    return float(math_equal(predicted, record.answer if reference is None else reference))


# ---------------------------------------------------------------------------------------------
# Look-up, user functions
# ---------------------------------------------------------------------------------------------

_SPEC_HELP = "give a registered name ({names}) or a user function as 'module:function', e.g. 'my_rewards:score'"


def _spec_error(spec: str, problem: str) -> ValueError:
    return ValueError(f"reward {spec!r}: {problem}; " + _SPEC_HELP.format(names=", ".join(reward_names())))


def _load_user_reward(spec: str) -> RewardFn:
    try:
        target = import_object(spec)
    except ValueError as error:
        raise _spec_error(spec, str(error)) from error.__cause__
    attribute_path = spec.partition(":")[2]
    if not callable(target):
        raise _spec_error(spec, f"{attribute_path!r} is a {type(target).__name__}, not a function")
    try:
        inspect.signature(target).bind("response", PromptRecord(prompt="", answer=""))
    except TypeError as error:
        raise _spec_error(
            spec, f"{attribute_path!r} cannot be called as fn(response, record) ({error})"
        ) from error
    except ValueError:
        pass  # Builtins may have no inspectable signature; calling them is the only test.
    return target


def get_reward_fn(name_or_spec: str) -> RewardFn:
    """A registered reward by name, or a user function ``module:function`` imported now."""
    if name_or_spec in REWARD_FUNCTIONS:
        return REWARD_FUNCTIONS[name_or_spec]
    if ":" not in name_or_spec:
        raise _spec_error(name_or_spec, "unknown reward name")
    return _load_user_reward(name_or_spec)


# ---------------------------------------------------------------------------------------------
# Safe scoring
# ---------------------------------------------------------------------------------------------


def _truncate(text: str) -> str:
    if len(text) <= LOG_TRUNCATE_CHARS:
        return repr(text)
    return repr(text[:LOG_TRUNCATE_CHARS]) + f"... ({len(text)} chars)"


def _score_one(reward_fn: RewardFn, response: str, record: PromptRecord) -> tuple[float | None, str]:
    """(reward, "") or (None, why it failed)."""
    try:
        reward = reward_fn(response, record)
    except Exception as error:
        return None, f"raised {type(error).__name__}: {error}"
    not_a_number = f"returned {type(reward).__name__} {reward!r}, not a number"
    # float() would parse '1.0': a verifier that returns text has a bug, and its text is no reward.
    if isinstance(reward, (str, bytes)):
        return None, not_a_number
    try:
        reward = float(reward)
    except (TypeError, ValueError):
        return None, not_a_number
    # A NaN or inf reward would poison every advantage of its group.
    if not math.isfinite(reward):
        return None, f"returned {reward}"
    return reward, ""


@dataclass(frozen=True)
class RewardScores:
    """The rewards of a batch of responses and how often the verifier failed on them."""

    rewards: list[float]
    """One per response; failure_reward where the verifier failed."""
    num_failures: int
    """Responses whose verifier raised or returned no finite number."""
    first_failure: str
    """The first failure, with its prompt and response (truncated); empty when none failed."""


def score_responses(
    reward_fn: RewardFn,
    responses: Sequence[str],
    records: Sequence[PromptRecord],
    failure_reward: float,
) -> RewardScores:
    """Reward every (response, record) pair.

    A reward that raises, or returns a non-number or a non-finite value, is logged as a warning
    with the sample's prompt and response (truncated) and scored ``failure_reward``: one bad
    sample costs its reward, not the run.
    """
    if len(responses) != len(records):
        raise ValueError(
            f"score_responses got {len(responses)} responses but {len(records)} records; "
            "pass one record per response (repeat each prompt's record for its G samples)"
        )
    rewards = []
    num_failures = 0
    first_failure = ""
    for response, record in zip(responses, records):
        reward, failure = _score_one(reward_fn, response, record)
        if reward is None:
            num_failures += 1
            reward = failure_reward
            if num_failures <= MAX_LOGGED_FAILURES:
                described = f"{failure} for prompt {_truncate(record.prompt)}, response {_truncate(response)}"
                first_failure = first_failure or described
                logger.warning("reward %s %s; scored %s", getattr(reward_fn, "__name__", repr(reward_fn)),
                               described, failure_reward)
        rewards.append(reward)
    if num_failures > MAX_LOGGED_FAILURES:
        logger.warning(
            "reward failed on %d of %d samples (the first %d logged above)",
            num_failures,
            len(responses),
            MAX_LOGGED_FAILURES,
        )
    return RewardScores(rewards, num_failures, first_failure)


class RewardFailureError(ValueError):
    """Stops a run whose verifier fails too often: training on failure_reward alone would teach the
    policy nothing while looking like a run. Raised on every rank alike (the fraction is reduced)."""

    def __init__(self, spec: str, failure_frac: float, max_failure_frac: float, first_failure: str):
        super().__init__(
            f"rl.reward = {spec!r} failed on {failure_frac:.0%} of a step's samples, more than "
            f"rl.max_reward_failure_frac = {max_failure_frac}; the first: {first_failure}. Fix the reward function "
            "(a reward is a number), or raise rl.max_reward_failure_frac"
        )
