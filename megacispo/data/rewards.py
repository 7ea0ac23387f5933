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
worker processes, rl.reward_workers per reward function and process, one call in flight in each. A late
call's worker is SIGKILLed (a signal cannot stop a call stuck in C code; SIGKILL can) and replaced, the
late call counting as a failure. A circuit breaker bounds a batch whatever its size (``RewardPool``):
once more than rl.max_reward_failure_frac of the calls decided so far have failed (judged from as many
calls as there are workers on), the rest are not made and fail too, so a reward that hangs on every
call costs one time limit a batch, not one a sample. The wait for a verdict looks every ``POLL_S``
whether its caller was told to stop (SIGTERM: ``ScoringInterrupted``).
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
from collections import deque
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
LATE = "late"
"""The cause of a failure that ran out of time: a reward call over rl.reward_timeout_s, an environment call
over env.timeout_s."""
NOT_CALLED = "not called"
"""The cause of a failure the circuit breaker left out (``RewardPool``)."""
Verdict = tuple[float | None, str, str]
"""A call's reward (None: it failed), why it failed, and its cause (empty, LATE or NOT_CALLED)."""


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
    causes: tuple[str, ...] = ()
    """Per response: LATE (its call, or its environment's, ran out of time), NOT_CALLED (the circuit
    breaker left it out) or empty; empty throughout: none of these."""

    @property
    def num_failures(self) -> int:
        return sum(map(bool, self.failures))

    @property
    def num_late(self) -> int:
        return self.causes.count(LATE)

    @property
    def num_not_called(self) -> int:
        return self.causes.count(NOT_CALLED)

    @property
    def first_failure(self) -> str:
        """The first failure; empty when none failed."""
        return next(filter(None, self.failures), "")

    def select(self, rows: slice) -> RewardScores:
        """The scores of ``rows`` alone."""
        return RewardScores(self.rewards[rows], self.failures[rows], self.causes[rows])

    @staticmethod
    def concat(parts: Sequence[RewardScores]) -> RewardScores:
        """The scores of ``parts``' responses in order."""
        return RewardScores([reward for part in parts for reward in part.rewards],
                            tuple(failure for part in parts for failure in part.failures),
                            tuple(cause for part in parts for cause in part.causes or ("",) * len(part.rewards)))


def score_responses(
    reward_fn: RewardFn,
    responses: Sequence[str],
    records: Sequence[PromptRecord],
    failure_reward: float,
    *,
    timeout_s: float | None = None,
    workers: int = 1,
    max_failure_frac: float = 1.0,
    interrupted: Callable[[], bool] = lambda: False,
) -> RewardScores:
    """Reward every (response, record) pair.

    A reward that raises, or returns a non-number or a non-finite value, is logged as a warning
    with the sample's prompt and response (truncated) and scored ``failure_reward``: one bad
    sample costs its reward, not the run. With ``timeout_s`` the calls run in ``workers`` worker
    processes of the reward (``RewardPool``): a call over ``timeout_s`` is such a failure too, and
    once more than ``max_failure_frac`` of the calls decided have failed the rest are not made (failures
    as well); while waiting for one, ``interrupted()`` returning True ends the scoring with
    ``ScoringInterrupted``.
    """
    if len(responses) != len(records):
        raise ValueError(
            f"score_responses got {len(responses)} responses but {len(records)} records; "
            "pass one record per response (repeat each prompt's record for its G samples)"
        )
    if timeout_s is None:
        verdicts = [(*_score_one(reward_fn, response, record), "") for response, record in zip(responses, records)]
    else:
        verdicts = reward_pool(reward_fn).score(list(zip(responses, records)), timeout_s, workers, max_failure_frac,
                                                interrupted)
    rewards, failures, num_failures = [], [], 0
    for response, record, (reward, failure, _) in zip(responses, records, verdicts):
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
    return RewardScores(rewards, tuple(failures), tuple(cause for _, _, cause in verdicts))


class RewardFailureError(ValueError):
    """Stops a run whose verifier fails too often: training on failure_reward alone would teach the
    policy nothing while looking like a run. Raised on every rank alike (the counts are reduced).
    ``late`` and ``not_called``: how many of the failed calls ran out of ``time_limits`` (e.g.
    "rl.reward_timeout_s = 30 s") and how many the circuit breaker left out."""

    def __init__(self, spec: str, failure_frac: float, max_failure_frac: float, first_failure: str, *,
                 late: int = 0, not_called: int = 0, time_limits: str = ""):
        counts = [f"{late} calls late, over {time_limits}"] if late else []
        counts += [f"{not_called} not called once too many had failed"] if not_called else []
        timing = f" ({'; '.join(counts)}, each counted as a failure)" if counts else ""
        super().__init__(
            f"rl.reward = {spec!r} failed on {failure_frac:.0%} of a step's samples{timing}, more than "
            f"rl.max_reward_failure_frac = {max_failure_frac}; the first: {first_failure}. Fix the reward function "
            f"(a reward is a number{', returned within ' + time_limits if late else ''}), or raise "
            "rl.max_reward_failure_frac"
        )


# ---------------------------------------------------------------------------------------------
# The worker processes
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
    """The worker: the reward function (pickled by reference) first, then one (response, record) pair
    at a time on stdin; the verdict of ``_score_one`` for each on stdout."""
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
            response, record = pickle.load(requests)
        except EOFError:
            return
        _send(replies, _score_one(reward_fn, response, record))


class _Worker:
    """One worker process of a reward: starting (not ``ready`` yet), idle, or on the call ``call`` until
    ``deadline``."""

    def __init__(self) -> None:
        self.process: subprocess.Popen | None = None
        self.ready = False
        self.call: int | None = None
        self.deadline = 0.0
        self._buffer = b""

    @property
    def waited_for(self) -> bool:
        """Whether the pool waits for a message from it (its readiness or a verdict)."""
        return self.process is not None and (not self.ready or self.call is not None)

    def start(self, pickled: bytes) -> None:
        # The parent's import path, so that the worker finds the reward's module as the parent did.
        path = [entry or os.getcwd() for entry in sys.path]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
        self.process = subprocess.Popen(
            [sys.executable, "-c", "from megacispo.data.rewards import serve; serve()", str(os.getpid())],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self.process.stdin.write(pickled)
        self.process.stdin.flush()
        self.ready, self.call, self._buffer = False, None, b""
        self.deadline = time.monotonic() + WORKER_STARTUP_TIMEOUT_S

    def send(self, call: int, pair: tuple[str, PromptRecord], timeout_s: float) -> None:
        self.call, self.deadline = call, time.monotonic() + timeout_s
        try:
            pickle.dump(pair, self.process.stdin)
            self.process.stdin.flush()
        except BrokenPipeError:
            pass  # it died while idle: the end of its output fails the call as a crash

    def read(self) -> list | None:
        """The messages that have come in whole; None when the worker has died."""
        data = os.read(self.process.stdout.fileno(), 1 << 16)
        if not data:
            return None
        self._buffer += data
        messages = []
        while len(self._buffer) >= _LENGTH.size:
            (size,) = _LENGTH.unpack_from(self._buffer)
            if len(self._buffer) < _LENGTH.size + size:
                break
            messages.append(pickle.loads(self._buffer[_LENGTH.size:_LENGTH.size + size]))
            self._buffer = self._buffer[_LENGTH.size + size:]
        return messages

    def stop(self) -> None:
        if self.process is not None:
            stop_worker(self.process)
        self.process, self.ready, self.call, self._buffer = None, False, None, b""


class RewardPool:
    """The calls of one reward function in up to rl.reward_workers child processes, one call in flight in
    each, each within a time limit: a late call's worker is SIGKILLed, the call fails, and a fresh worker
    takes its place. A circuit breaker bounds a batch whatever its size: once as many calls as there are
    workers have a verdict, and more than ``max_failure_frac`` of those with one failed, the calls in flight
    are stopped and the rest not made (they fail too). A reward that hangs on every call so costs one
    time limit a batch; one that is only sometimes late passes, its late calls having their verdicts
    last (a fast call is decided before a slow one)."""

    def __init__(self, reward_fn: RewardFn, pickled: bytes):
        self.name = getattr(reward_fn, "__name__", repr(reward_fn))
        self._pickled = pickled
        self._workers: list[_Worker] = []

    def score(self, pairs: list[tuple[str, PromptRecord]], timeout_s: float, workers: int, max_failure_frac: float,
              interrupted: Callable[[], bool]) -> list[Verdict]:
        """The verdict of each pair, in order; ScoringInterrupted when ``interrupted()`` says so while the
        pool waits (its workers are then stopped)."""
        verdicts: list[Verdict | None] = [None] * len(pairs)
        while len(self._workers) < min(workers, len(pairs)):
            self._workers.append(_Worker())
        slots = self._workers[:min(workers, len(pairs))]
        for slot in slots:
            if slot.process is None:
                slot.start(self._pickled)
        waiting = deque(range(len(pairs)))
        # The first call waits for every worker to be ready: a call's time limit counts the call, not a start-up.
        calling = False
        decided = failed = 0
        while waiting or any(slot.call is not None for slot in slots):
            calling = calling or all(slot.ready for slot in slots)
            for slot in slots if calling else ():
                if waiting and slot.process is None:
                    slot.start(self._pickled)
                elif waiting and slot.ready and slot.call is None:
                    call = waiting.popleft()
                    slot.send(call, pairs[call], timeout_s)
            for call, verdict in self._next_verdicts(slots, timeout_s, interrupted):
                verdicts[call] = verdict
                decided += 1
                failed += verdict[0] is None
            if decided >= len(slots) and failed > max_failure_frac * decided:
                return self._break_circuit(verdicts, slots, decided, failed, max_failure_frac)
        return verdicts

    def close(self) -> None:
        for slot in self._workers:
            slot.stop()

    def _next_verdicts(self, slots: list[_Worker], timeout_s: float,
                       interrupted: Callable[[], bool]) -> list[tuple[int, Verdict]]:
        """The verdicts that come in within ``POLL_S`` or are late by then, and the workers that became ready."""
        if interrupted():
            self.close()
            raise ScoringInterrupted(f"reward {self.name!r}: scoring stopped by SIGTERM")
        watched = [slot for slot in slots if slot.waited_for]
        left = min(slot.deadline for slot in watched) - time.monotonic()
        readable, _, _ = select.select([slot.process.stdout for slot in watched], [], [], max(min(left, POLL_S), 0))
        verdicts = []
        for slot in watched:
            messages = slot.read() if slot.process.stdout in readable else []
            if messages is None:
                if not slot.ready:
                    self._fail_start("exited (its error is above)")
                verdicts.append((slot.call, (None, "crashed its worker process (its error is above)", "")))
                slot.stop()
                continue
            for message in messages:
                if slot.ready:
                    verdicts.append((slot.call, (*message, "")))
                    slot.call = None
                else:
                    slot.ready = message == _READY
            if slot.waited_for and time.monotonic() >= slot.deadline:
                if not slot.ready:
                    self._fail_start(f"sent nothing for {WORKER_STARTUP_TIMEOUT_S:.0f} s")
                verdicts.append((slot.call, (None, f"took over rl.reward_timeout_s = {timeout_s:g} s and was stopped",
                                             LATE)))
                slot.stop()
        return verdicts

    def _break_circuit(self, verdicts: list[Verdict | None], slots: list[_Worker], decided: int, failed: int,
                       max_failure_frac: float) -> list[Verdict]:
        """``verdicts`` with the calls not decided yet failed (those in flight stopped)."""
        for slot in slots:
            if slot.call is not None:
                slot.stop()
        late = sum(verdict is not None and verdict[2] == LATE for verdict in verdicts)
        why = (f"was not called: {failed} of the first {decided} calls failed ({late} of them late), more than "
               f"rl.max_reward_failure_frac = {max_failure_frac}")
        logger.warning("reward %s failed on %d of its first %d calls (%d late), more than rl.max_reward_failure_frac "
                       "= %s: the other %d of the batch are not made and count as failures", self.name, failed,
                       decided, late, max_failure_frac, len(verdicts) - decided)
        return [(None, why, NOT_CALLED) if verdict is None else verdict for verdict in verdicts]

    def _fail_start(self, why: str) -> None:
        self.close()
        raise RuntimeError(
            f"the worker process of reward {self.name!r} {why} before its first call; check that the reward's "
            "module imports in a fresh `python -c 'import ...'`"
        )


_pools: dict[bytes, RewardPool] = {}


def reward_pool(reward_fn: RewardFn) -> RewardPool:
    """The worker processes of ``reward_fn`` in this process, started at its first batch."""
    try:
        pickled = pickle.dumps(reward_fn)
    except (pickle.PicklingError, AttributeError, TypeError) as error:
        raise ValueError(
            f"reward {getattr(reward_fn, '__name__', reward_fn)!r} cannot run in a worker process ({error}); define "
            "it at the top level of a module (rl.reward = 'module:function')"
        ) from error
    if pickled not in _pools:
        _pools[pickled] = RewardPool(reward_fn, pickled)
    return _pools[pickled]


@atexit.register
def _close_pools() -> None:
    for pool in _pools.values():
        pool.close()
