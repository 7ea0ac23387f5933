"""The host side of a multi-turn rollout: one environment per sample, called on worker threads while
the device decodes, so that a slow tool holds only its own sample's slot.

The slot engine (megacispo.rollout.generate) hands a sample's finished model turn to ``submit``
and takes ``replies`` whenever the host looks: for each conversation whose environment has answered,
the ids to feed before the model's next turn (``ReplyRenderer.reply_ids``), or None when the
conversation is over (the environment said done, ``env.max_turns`` is reached, or the sample failed).

Every call (reset and step) has ``env.timeout_s``, counted from when it is handed to the workers. A
call that raises, returns something malformed (``check_step``) or is late fails its sample: the
sample's conversation ends there, its reward is rl.failure_reward and it counts with the reward
failures. As every call's time counts from its hand-over, calls waiting for a thread included, a
rollout whose environment hangs on every call fails all its samples within ``env.timeout_s`` of
their calls, however many there are. A late call that has not started is never run; one that has
keeps its thread (Python cannot stop a thread; it is a daemon, so it never holds the process's exit),
and a fresh thread takes that thread's place in the pool, so calls that never return cost threads,
not the pool's capacity: an environment whose calls may hang should run them in a process it can
kill, as the built-in python tool does (megacispo.envs.sandbox).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

from megacispo.data.chat import ReplyRenderer
from megacispo.data.prompts import PromptRecord
from megacispo.data.rewards import FLOAT32_MAX, LATE, MAX_LOGGED_FAILURES, RewardScores
from megacispo.envs.base import EnvFactory, Environment, check_messages, check_step, make_environment
from megacispo.envs.config import EnvConfig

logger = logging.getLogger(__name__)


class EnvWorkers:
    """``workers`` daemon threads that run calls handed to them; each result comes back with its tag. A
    call given up on (``abandon``) is not run if it has not started; if it has, its thread leaves the
    pool, to end when the call returns, and a fresh one takes its place."""

    def __init__(self, workers: int):
        self._calls: queue.Queue = queue.Queue()
        self._results: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._queued: set = set()
        self._running: dict[Any, threading.Thread] = {}
        self._names = itertools.count()
        self._threads: list[threading.Thread] = []
        for _ in range(workers):
            self._add_thread()

    def _add_thread(self) -> None:
        thread = threading.Thread(target=self._serve, daemon=True, name=f"env-worker-{next(self._names)}")
        self._threads.append(thread)
        thread.start()

    def _serve(self) -> None:
        me = threading.current_thread()
        while True:
            call = self._calls.get()
            if call is None:
                return
            tag, fn = call
            with self._lock:
                if tag not in self._queued:
                    continue  # abandoned before it started
                self._queued.remove(tag)
                self._running[tag] = me
            started = time.monotonic()
            try:
                result, error = fn(), None
            # An environment's error is its sample's failure; SystemExit too, which would end this thread
            # silently, its sample found only at its timeout and the pool a thread short for good.
            except BaseException as raised:
                result, error = None, f"raised {type(raised).__name__}: {raised}"
            with self._lock:
                self._running.pop(tag, None)
                replaced = me not in self._threads
            self._results.put((tag, result, error, time.monotonic() - started))
            if replaced:
                return

    def abandon(self, tags: Iterable[Any]) -> None:
        """Give up on the calls ``tags`` (late): those not started are never run, and the thread of each
        one running is replaced (all of them marked first, so that no fresh thread starts one of them)."""
        with self._lock:
            self._queued.difference_update(tags)
            stuck = [self._running.pop(tag) for tag in tags if tag in self._running]
            for thread in stuck:
                self._threads.remove(thread)
            for _ in stuck:
                self._add_thread()

    def submit(self, tag: Any, fn: Callable[[], Any]) -> None:
        with self._lock:
            self._queued.add(tag)
        self._calls.put((tag, fn))

    def results(self, timeout_s: float = 0.0) -> list[tuple[Any, Any, str | None, float]]:
        """The results ready now: (tag, result, error or None, seconds); waits up to ``timeout_s`` for a first."""
        ready = []
        try:
            ready.append(self._results.get(timeout=timeout_s) if timeout_s > 0 else self._results.get_nowait())
            while True:
                ready.append(self._results.get_nowait())
        except queue.Empty:
            pass
        return ready

    def close(self) -> None:
        """Stop the threads once their current calls return (a hung call's thread stays, a daemon)."""
        with self._lock:
            threads = len(self._threads)
        for _ in range(threads):
            self._calls.put(None)


@dataclass
class Conversation:
    """One sample's conversation as the host follows it."""

    record: PromptRecord
    env: Environment | None = None
    turns: int = 0
    """Model turns handed to the environment."""
    reward: float = 0.0
    """The environment's turn rewards, summed."""
    failure: str = ""
    """Why the environment failed this sample (empty: it did not)."""
    timed_out: bool = False
    metrics: dict[str, float] = field(default_factory=dict)
    """The environment's counts, summed over its turns."""
    env_seconds: float = 0.0
    """Time its environment calls took, from hand-over to answer."""
    fed_tokens: int = 0
    """Reply tokens fed to the model."""
    last_turn: str = ""
    """The text of the model's last turn (rl.reward scores it)."""
    done: bool = False


class Conversations:
    """The conversations of one rollout's samples (``records``, one per sample, a group's repeated)."""

    def __init__(self, config: EnvConfig, factory: EnvFactory, renderer: ReplyRenderer, records: Sequence[PromptRecord],
                 workers: EnvWorkers, max_prompt_tokens: int):
        self.config, self.factory, self.renderer, self.workers = config, factory, renderer, workers
        self.max_prompt_tokens = max_prompt_tokens
        """The longest first prompt (Config.max_prompt_tokens): the rollout's context leaves no more."""
        self.conversations = [Conversation(record) for record in records]
        self._deadlines: dict[int, float] = {}
        self._submitted: dict[int, float] = {}
        self._last_ids: dict[int, int] = {}
        self.num_failed = 0
        """Samples failed so far; the first MAX_LOGGED_FAILURES are logged, a broken environment fails them all."""

    # -- the first prompts -----------------------------------------------------------------------

    def prompts(self, prompt_ids: Callable[[PromptRecord], list[int]]) -> list[list[int]]:
        """Each sample's first prompt: its environment made and reset (on the workers, all at once), the
        messages reset returns rendered, or the record's own prompt ids (``prompt_ids``) when it returns
        None. A sample whose environment fails here keeps the record's prompt and ends after its first turn."""
        def reset(sample: int) -> Any:
            env = make_environment(self.factory, self.config.params, self.config.name)
            messages = env.reset(self.conversations[sample].record)
            return env, None if messages is None else check_messages(messages, "reset()")

        for sample in range(len(self.conversations)):
            self._hand_over(sample, lambda sample=sample: reset(sample))
        prompts: list[list[int] | None] = [None] * len(self.conversations)
        for sample, result in self._wait_all():
            conversation = self.conversations[sample]
            if result is not None:
                conversation.env, messages = result
                if messages is not None:
                    prompts[sample] = self._first_prompt(sample, messages)
        return [ids if ids is not None else prompt_ids(c.record) for ids, c in zip(prompts, self.conversations)]

    def _first_prompt(self, sample: int, messages: list) -> list[int] | None:
        """The ids of the messages reset returned; None, the sample failed, when they cannot be rendered or
        make no ids (the model is given no empty prompt)."""
        try:
            ids = self.renderer.prompt_ids(messages)
        except ValueError as error:  # the tokenizer's, for a chat template that fails on them
            self._fail(sample, f"reset()'s messages could not be rendered: {error}")
            return None
        if not ids:
            self._fail(sample, "reset()'s messages render to no tokens: give the model a prompt to answer")
            return None
        if len(ids) > self.max_prompt_tokens:
            self._fail(sample, f"reset()'s messages render to {len(ids)} tokens, more than the "
                               f"{self.max_prompt_tokens} a prompt may have (data.max_prompt_tokens, or what the "
                               "context leaves): shorten them")
            return None
        return ids

    # -- model turns -----------------------------------------------------------------------------

    def submit(self, sample: int, turn_ids: list[int]) -> None:
        """The model's turn ``turn_ids`` of ``sample`` ended at a stop id or tool tag: its environment answers."""
        conversation = self.conversations[sample]
        conversation.turns += 1
        conversation.last_turn = self.renderer.tokenizer.decode(turn_ids)
        self._last_ids[sample] = turn_ids[-1]
        if conversation.env is None or conversation.failure:
            self.end(sample)
            return
        env, text = conversation.env, conversation.last_turn
        self._hand_over(sample, lambda: check_step(env.step(text)))

    def end(self, sample: int, last_turn_ids: list[int] | None = None) -> None:
        """The conversation of ``sample`` ends without the environment (its length limit, early truncation)."""
        conversation = self.conversations[sample]
        if last_turn_ids is not None:
            conversation.turns += 1
            conversation.last_turn = self.renderer.tokenizer.decode(last_turn_ids)
        conversation.done = True

    @property
    def pending(self) -> int:
        """Environment calls handed over and not yet answered (nor timed out)."""
        return len(self._deadlines)

    def replies(self, wait_s: float = 0.0) -> list[tuple[int, list[int] | None]]:
        """The conversations the environment has answered since the last call: (sample, the ids to feed
        before the model's next turn, or None: the conversation is over). Waits up to ``wait_s`` for one."""
        answered = []
        for sample, step in self._collect(wait_s):
            conversation = self.conversations[sample]
            if step is None or step.done or conversation.turns >= self.config.max_turns:
                conversation.done = True
                answered.append((sample, None))
                continue
            try:
                ids = self.renderer.reply_ids(step.messages, self._last_ids[sample])
            except ValueError as error:
                self._fail(sample, str(error))
                answered.append((sample, None))
                continue
            conversation.fed_tokens += len(ids)
            answered.append((sample, ids))
        return answered

    def wait_any(self) -> list[tuple[int, list[int] | None]]:
        """``replies``, waiting for the first one for as long as the earliest pending call may take."""
        if not self._deadlines:
            return []
        return self.replies(wait_s=max(0.0, min(self._deadlines.values()) - time.monotonic()) + 0.01)

    def shorten(self, sample: int, fed: int) -> None:
        """The reply of ``sample`` did not fit its length limit: none of its ``fed`` ids was fed; it is over."""
        conversation = self.conversations[sample]
        conversation.fed_tokens -= fed
        conversation.done = True

    # -- results ---------------------------------------------------------------------------------

    def rewards(self) -> list[float | None]:
        """Each sample's environment reward; None where the environment failed it."""
        return [None if c.failure else c.reward for c in self.conversations]

    def final_texts(self) -> list[str]:
        return [c.last_turn for c in self.conversations]

    def failures(self) -> list[str]:
        return [c.failure for c in self.conversations]

    def sample_metrics(self) -> list[dict[str, float]]:
        """Each sample's env/* counts (``sum_metrics`` adds them up; the trainer divides by the samples)."""
        per_sample = []
        for c in self.conversations:
            counts = {"env/turns": float(c.turns), "env/failures": float(bool(c.failure)),
                      "env/timeouts": float(c.timed_out), "env/time_s": c.env_seconds,
                      "env/fed_tokens": float(c.fed_tokens)}
            counts.update((f"env/{name}", float(value)) for name, value in c.metrics.items())
            per_sample.append(counts)
        return per_sample

    # -- the calls -------------------------------------------------------------------------------

    def _hand_over(self, sample: int, fn: Callable[[], Any]) -> None:
        now = time.monotonic()
        self._submitted[sample] = now
        self._deadlines[sample] = now + self.config.timeout_s
        self.workers.submit((id(self), sample, now), fn)

    def _collect(self, wait_s: float) -> list[tuple[int, Any]]:
        """(sample, result or None on failure) of the calls answered or late now."""
        done = []
        for (owner, sample, submitted), result, error, _ in self.workers.results(wait_s if self._deadlines else 0.0):
            # A late call's answer (its sample already failed) or another rollout's is dropped.
            if owner != id(self) or self._submitted.get(sample) != submitted or sample not in self._deadlines:
                continue
            del self._deadlines[sample]
            conversation = self.conversations[sample]
            conversation.env_seconds += time.monotonic() - submitted
            if error is not None:
                self._fail(sample, error)
                done.append((sample, None))
                continue
            if hasattr(result, "reward"):
                conversation.reward += result.reward
                for name, value in result.metrics.items():
                    conversation.metrics[name] = conversation.metrics.get(name, 0.0) + value
                if not abs(conversation.reward) <= FLOAT32_MAX:
                    self._fail(sample, f"turn rewards sum to {conversation.reward}, beyond float32 (at most "
                                       f"{FLOAT32_MAX:.3g} in size), the dtype of the advantages")
                    result = None
            done.append((sample, result))
        now = time.monotonic()
        late = [sample for sample, deadline in self._deadlines.items() if now >= deadline]
        self.workers.abandon([(id(self), sample, self._submitted[sample]) for sample in late])
        for sample in late:
            del self._deadlines[sample]
            conversation = self.conversations[sample]
            conversation.timed_out = True
            conversation.env_seconds += self.config.timeout_s
            self._fail(sample, f"took over env.timeout_s = {self.config.timeout_s:g} s")
            done.append((sample, None))
        return done

    def _wait_all(self) -> list[tuple[int, Any]]:
        """Every pending call's (sample, result or None), each within its timeout."""
        done = []
        while self._deadlines:
            done += self._collect(max(0.0, min(self._deadlines.values()) - time.monotonic()) + 0.01)
        return done

    def _fail(self, sample: int, why: str) -> None:
        conversation = self.conversations[sample]
        conversation.done = True
        if conversation.failure:
            return
        conversation.failure = f"environment {self.config.name!r} {why}"
        self.num_failed += 1
        if self.num_failed <= MAX_LOGGED_FAILURES:
            logger.warning("sample %d: %s", sample, conversation.failure)


# ---------------------------------------------------------------------------------------------
# What a run builds once


def turn_stop_ids(config: EnvConfig, tokenizer) -> tuple[int, ...]:
    """The tokenizer's stop ids and env.stop_tokens' ids; ValueError naming a stop token that is not one token."""
    extra = []
    for text in config.stop_tokens:
        try:
            extra.append(tokenizer.single_token_id(text))
        except ValueError as error:
            raise ValueError(f"env.stop_tokens: {error}; make it one token (tools/train_tokenizer.py --symbols, or a "
                             "tokenizer whose added tokens include it)") from None
    return tuple(dict.fromkeys((*tokenizer.stop_ids, *extra)))


def build_renderer(config: EnvConfig, factory: EnvFactory, tokenizer, chat_template: bool) -> ReplyRenderer:
    """The run's reply renderer, with the tools an environment of env.name declares (its ``tools``
    attribute: JSON schemas for the chat template) and the turn-ending env.stop_tokens."""
    tools = getattr(make_environment(factory, config.params, config.name), "tools", None)
    stops = turn_stop_ids(config, tokenizer)
    return ReplyRenderer(tokenizer, chat_template, tools=tools, tool_stop_ids=stops[len(tokenizer.stop_ids):])


def combine_rewards(mode: str, conversations: Conversations, scores: RewardScores | None,
                    failure_reward: float) -> RewardScores:
    """The samples' rewards as env.reward says: the environment's (env), rl.reward's ``scores`` of the
    final turns (reward), or both added (sum). A sample whose environment or verifier failed gets
    ``failure_reward`` and counts as one failure, with its cause (a late environment call's is LATE)."""
    rewards, failures, causes = [], [], []
    for index, (env_reward, env_failure) in enumerate(zip(conversations.rewards(), conversations.failures())):
        failure = env_failure or (scores.failures[index] if scores is not None else "")
        total = (0.0 if mode == "reward" else env_reward or 0.0) + (0.0 if mode == "env" else scores.rewards[index])
        if not failure and not abs(total) <= FLOAT32_MAX:
            failure = (f"env.reward = {mode}: environment {conversations.config.name!r}'s {env_reward} and "
                       f"rl.reward's {scores.rewards[index]} add up to {total}, beyond float32")
        rewards.append(failure_reward if failure else total)
        failures.append(failure)
        if env_failure:
            causes.append(LATE if conversations.conversations[index].timed_out else "")
        else:
            causes.append(scores.causes[index] if scores is not None and scores.causes else "")
    if conversations.num_failed > MAX_LOGGED_FAILURES:
        logger.warning("environment %r failed %d of %d samples (the first %d logged above)", conversations.config.name,
                       conversations.num_failed, len(failures), MAX_LOGGED_FAILURES)
    return RewardScores(rewards, tuple(failures), tuple(causes))


def sum_metrics(per_sample: Iterable[dict[str, float]]) -> dict[str, float]:
    """Counts added up by name (environments name their own: not every sample has every name)."""
    totals: dict[str, float] = {}
    for counts in per_sample:
        for name, value in counts.items():
            totals[name] = totals.get(name, 0.0) + value
    return totals
