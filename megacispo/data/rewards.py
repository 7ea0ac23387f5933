"""Rule-based verifiers behind one registry, and a scorer that survives a verifier that raises.

Every reward has the signature ``reward(response: str, record: PromptRecord) -> float``; the
record carries the reference answer and the prompt line's extra fields. ``get_reward_fn`` takes a
registered name (``exact_match``, ``numeric``, ``boxed_math``) or a user function as
``module:function``, imported at start-up so a typo fails before the first rollout.

A reward is a number: a float or an int, a bool (True is 1.0, as ``float(response == answer)``
would be) or a numpy or torch scalar. A string is not, even "1.0": it is a failure, like a raise,
NaN or infinity, or a number float32 cannot hold (the advantages' dtype: over 3.4e38). A sample
whose reward fails gets rl.failure_reward; a step whose samples fail more often than
rl.max_reward_failure_frac stops the run (``RewardFailureError``).

A run calls its reward with a time limit (``score_responses(..., timeout_s=rl.reward_timeout_s)``): in
a worker process, one per reward function and process, which is SIGKILLed when a call is late (a
signal cannot stop a call stuck in C code; SIGKILL can) and replaced, the late call counting as a
failure. A batch travels to the worker in one message and each verdict comes back as it is made, so a
call costs the worker a few microseconds more than in-process. The wait for a verdict looks every
``POLL_S`` whether its caller was told to stop (SIGTERM: ``ScoringInterrupted``).
"""

from __future__ import annotations

import atexit
import inspect
import logging
import math
import os
import pickle
import re
import select
import signal
import struct
import subprocess
import sys
import time
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Callable, Sequence

from megacispo.data.math_grading import math_equal, stop_worker
from megacispo.data.prompts import PromptRecord
from megacispo.lifeline import die_with_parent
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

# The largest float32 (the advantages' dtype): a reward beyond it would become infinity there.
FLOAT32_MAX = 3.4028234663852886e38

POLL_S = 0.1
"""How often a wait for a reward worker looks whether its caller was told to stop."""
WORKER_STARTUP_TIMEOUT_S = 120.0
"""The most a reward worker may take to import the reward's module (and torch, for the records)."""


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
    if abs(reward) > FLOAT32_MAX:
        return None, (f"returned {reward}, beyond float32, the dtype of the advantages (at most {FLOAT32_MAX:.3g} "
                      "in size)")
    return reward, ""


@dataclass(frozen=True)
class RewardScores:
    """The rewards of a batch of responses and why the verifier failed on some."""

    rewards: list[float]
    """One per response; failure_reward where the verifier failed."""
    failures: tuple[str, ...]
    """Per response: why its verifier failed (raised, or returned no finite number), with its prompt and
    response (truncated); empty where it did not."""

    @property
    def num_failures(self) -> int:
        return sum(map(bool, self.failures))

    @property
    def first_failure(self) -> str:
        """The first failure; empty when none failed."""
        return next(filter(None, self.failures), "")

    def select(self, rows: slice) -> RewardScores:
        """The scores of ``rows`` alone."""
        return RewardScores(self.rewards[rows], self.failures[rows])

    @staticmethod
    def concat(parts: Sequence[RewardScores]) -> RewardScores:
        """The scores of ``parts``' responses in order."""
        return RewardScores([reward for part in parts for reward in part.rewards],
                            tuple(failure for part in parts for failure in part.failures))


def score_responses(
    reward_fn: RewardFn,
    responses: Sequence[str],
    records: Sequence[PromptRecord],
    failure_reward: float,
    *,
    timeout_s: float | None = None,
    interrupted: Callable[[], bool] = lambda: False,
) -> RewardScores:
    """Reward every (response, record) pair.

    A reward that raises, or returns a non-number or a non-finite value, is logged as a warning
    with the sample's prompt and response (truncated) and scored ``failure_reward``: one bad
    sample costs its reward, not the run. With ``timeout_s`` the calls run in the reward's worker
    process (``RewardWorker``), and a call over ``timeout_s`` is such a failure too; while waiting
    for one, ``interrupted()`` returning True ends the scoring with ``ScoringInterrupted``.
    """
    if len(responses) != len(records):
        raise ValueError(
            f"score_responses got {len(responses)} responses but {len(records)} records; "
            "pass one record per response (repeat each prompt's record for its G samples)"
        )
    if timeout_s is None:
        verdicts = [_score_one(reward_fn, response, record) for response, record in zip(responses, records)]
    else:
        verdicts = reward_worker(reward_fn).score(list(zip(responses, records)), timeout_s, interrupted)
    rewards, failures, num_failures = [], [], 0
    for response, record, (reward, failure) in zip(responses, records, verdicts):
        described = ""
        if reward is None:
            num_failures += 1
            reward = failure_reward
            described = f"{failure} for prompt {_truncate(record.prompt)}, response {_truncate(response)}"
            if num_failures <= MAX_LOGGED_FAILURES:
                logger.warning("reward %s %s; scored %s", getattr(reward_fn, "__name__", repr(reward_fn)),
                               described, failure_reward)
        rewards.append(reward)
        failures.append(described)
    if num_failures > MAX_LOGGED_FAILURES:
        logger.warning(
            "reward failed on %d of %d samples (the first %d logged above)",
            num_failures,
            len(responses),
            MAX_LOGGED_FAILURES,
        )
    return RewardScores(rewards, tuple(failures))


class RewardFailureError(ValueError):
    """Stops a run whose verifier fails too often: training on failure_reward alone would teach the
    policy nothing while looking like a run. Raised on every rank alike (the fraction is reduced)."""

    def __init__(self, spec: str, failure_frac: float, max_failure_frac: float, first_failure: str):
        super().__init__(
            f"rl.reward = {spec!r} failed on {failure_frac:.0%} of a step's samples, more than "
            f"rl.max_reward_failure_frac = {max_failure_frac}; the first: {first_failure}. Fix the reward function "
            "(a reward is a number), or raise rl.max_reward_failure_frac"
        )


# ---------------------------------------------------------------------------------------------
# The worker process
# ---------------------------------------------------------------------------------------------


class ScoringInterrupted(Exception):
    """score_responses stopped waiting for the reward because its caller was told to stop (SIGTERM)."""


_LENGTH = struct.Struct("<Q")
_READY = "ready"


def _send(stream, message) -> None:
    data = pickle.dumps(message)
    stream.write(_LENGTH.pack(len(data)) + data)
    stream.flush()


def serve() -> None:
    """The worker: the reward function (pickled by reference) first, then batches of (response,
    record) pairs on stdin; one verdict of ``_score_one`` per pair on stdout, each as it is made."""
    die_with_parent(int(sys.argv[1]))
    # Ctrl-C and torchrun's SIGTERM reach the whole process group; the parent decides when this worker
    # ends (stdin closes, or it is killed), after its own orderly stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "wb", buffering=0)
    # Whatever the reward prints goes to stderr, never into the replies.
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    requests = sys.stdin.buffer
    reward_fn = pickle.load(requests)
    _send(replies, _READY)
    while True:
        try:
            pairs = pickle.load(requests)
        except EOFError:
            return
        for response, record in pairs:
            _send(replies, _score_one(reward_fn, response, record))


class RewardWorker:
    """The calls of one reward function, in a child process, each within a time limit: a late call's
    worker is SIGKILLed, the call fails, and a fresh worker takes the rest of the batch."""

    def __init__(self, reward_fn: RewardFn, pickled: bytes):
        self.name = getattr(reward_fn, "__name__", repr(reward_fn))
        self._pickled = pickled
        self._process: subprocess.Popen | None = None
        self._buffer = b""

    def score(self, pairs: list[tuple[str, PromptRecord]], timeout_s: float,
              interrupted: Callable[[], bool]) -> list[tuple[float | None, str]]:
        """The verdict of ``_score_one`` for each pair, in order; ScoringInterrupted when
        ``interrupted()`` says so while a call is in flight (the worker is then stopped)."""
        verdicts: list[tuple[float | None, str]] = []
        while len(verdicts) < len(pairs):
            process = self._ready_worker(interrupted)
            pending = pairs[len(verdicts):]
            try:
                pickle.dump(pending, process.stdin)
                process.stdin.flush()
            except BrokenPipeError:
                pending = pending[:1]  # the worker died before the batch: its first call counts the crash
            for _ in pending:
                verdict = self._receive(timeout_s, interrupted)
                if verdict is None:
                    verdicts.append((None, self._late_or_crashed(timeout_s)))
                    break
                verdicts.append(verdict)
        return verdicts

    def close(self) -> None:
        if self._process is not None:
            stop_worker(self._process)
            self._process = None
            self._buffer = b""

    def _late_or_crashed(self, timeout_s: float) -> str:
        """Why the call in flight has no verdict; its worker is gone after this."""
        crashed = self._process.poll() is not None
        self.close()
        if crashed:
            return "crashed its worker process (its error is above)"
        return f"took over rl.reward_timeout_s = {timeout_s:g} s and was stopped"

    def _ready_worker(self, interrupted: Callable[[], bool]) -> subprocess.Popen:
        if self._process is not None:
            return self._process
        # The parent's import path, so that the worker finds the reward's module as the parent did.
        path = [entry or os.getcwd() for entry in sys.path]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
        self._process = subprocess.Popen(
            [sys.executable, "-c", "from megacispo.data.rewards import serve; serve()", str(os.getpid())],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self._process.stdin.write(self._pickled)
        self._process.stdin.flush()
        if self._receive(WORKER_STARTUP_TIMEOUT_S, interrupted) != _READY:
            why = "exited (its error is above)" if self._process.poll() is not None else \
                f"sent nothing for {WORKER_STARTUP_TIMEOUT_S:.0f} s"
            self.close()
            raise RuntimeError(
                f"the worker process of reward {self.name!r} {why} before its first call; check that the reward's "
                "module imports in a fresh `python -c 'import ...'`"
            )
        return self._process

    def _receive(self, timeout_s: float, interrupted: Callable[[], bool]):
        """The worker's next message; None when it sends none within ``timeout_s`` or has died."""
        deadline = time.monotonic() + timeout_s
        stdout = self._process.stdout.fileno()
        while True:
            if len(self._buffer) >= _LENGTH.size:
                (size,) = _LENGTH.unpack_from(self._buffer)
                if len(self._buffer) >= _LENGTH.size + size:
                    message = pickle.loads(self._buffer[_LENGTH.size:_LENGTH.size + size])
                    self._buffer = self._buffer[_LENGTH.size + size:]
                    return message
            if interrupted():
                self.close()
                raise ScoringInterrupted(f"reward {self.name!r}: scoring stopped by SIGTERM")
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            readable, _, _ = select.select([stdout], [], [], min(left, POLL_S))
            if readable:
                data = os.read(stdout, 1 << 16)
                if not data:
                    return None
                self._buffer += data


_workers: dict[bytes, RewardWorker] = {}


def reward_worker(reward_fn: RewardFn) -> RewardWorker:
    """The worker process of ``reward_fn`` in this process, started at its first batch."""
    try:
        pickled = pickle.dumps(reward_fn)
    except (pickle.PicklingError, AttributeError, TypeError) as error:
        raise ValueError(
            f"reward {getattr(reward_fn, '__name__', reward_fn)!r} cannot run in a worker process ({error}); define "
            "it at the top level of a module (rl.reward = 'module:function')"
        ) from error
    if pickled not in _workers:
        _workers[pickled] = RewardWorker(reward_fn, pickled)
    return _workers[pickled]


@atexit.register
def _close_workers() -> None:
    for worker in _workers.values():
        worker.close()
