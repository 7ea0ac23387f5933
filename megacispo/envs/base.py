"""The environment protocol: what answers the model between its turns in a multi-turn rollout.

One environment object serves one sample (a conversation), made by its factory (``env.name``: a
built-in name or ``module:Class``, called with ``env.params`` as keyword arguments):

    reset(record) -> messages          the conversation's first messages (None: the record's prompt)
    step(assistant_message) -> EnvStep the environment's reply to one model turn

A model turn ends at a stop id (EOS, the chat template's end of turn) or at one of ``env.stop_tokens``
(a tool call's closing token). ``step`` gets the turn's text (the stop token's text included) and
returns the messages to append ({"role": "tool" | "user", "content": str}), a reward for the turn,
and whether the conversation is over. ``tools``, when an environment has them, are the JSON schemas
the chat template renders (``apply_chat_template(..., tools=...)``).

An environment runs on the rollout's host threads (``megacispo.envs.turns``), each call under
``env.timeout_s``; whatever a call raises, returns malformed or is late makes that sample a failure,
counted with the reward failures (``rl.max_reward_failure_frac``), never the run's crash.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol, runtime_checkable

from megacispo.data.prompts import Messages, PromptRecord
from megacispo.data.rewards import FLOAT32_MAX
from megacispo.plugins import import_object

ROLES = ("user", "tool", "system")
"""The roles an environment's reply messages may take (the model speaks as "assistant")."""
MAX_MESSAGES_CHARS = 4 << 20
"""The most characters the messages of one reset or step may hold in all. The rollout's thread tokenizes
them (10 MiB took 10 s and 2.5 GB there), and more than this fits no context: a million tokens at the
four characters a token of ordinary text. An environment whose tool prints more cuts it itself."""


@dataclass(frozen=True)
class EnvStep:
    """An environment's answer to one model turn."""

    messages: Messages = field(default_factory=list)
    """Appended to the conversation and fed to the model before its next turn (empty when done)."""
    reward: float = 0.0
    """This turn's reward; a sample's environment reward is the sum over its turns (within float32, the
    advantages' dtype, as each turn's must be: beyond it the sample fails)."""
    done: bool = False
    """The conversation is over: the model gets no further turn."""
    metrics: Mapping[str, float] = field(default_factory=dict)
    """Counts to log (summed over turns, averaged over samples as env/<name>), e.g. {"tool_calls": 1}."""


@runtime_checkable
class Environment(Protocol):
    """One conversation's environment (see the module docstring)."""

    def reset(self, record: PromptRecord) -> Messages | None: ...

    def step(self, assistant_message: str) -> EnvStep: ...


EnvFactory = Callable[..., Environment]

ENVIRONMENTS: dict[str, EnvFactory] = {}


def register_environment(name: str) -> Callable[[EnvFactory], EnvFactory]:
    """Register a built-in environment factory under ``name`` (env.name)."""

    def register(factory: EnvFactory) -> EnvFactory:
        ENVIRONMENTS[name] = factory
        return factory

    return register


def environment_names() -> list[str]:
    importlib.import_module("megacispo.envs.builtin")  # its classes register themselves
    return sorted(ENVIRONMENTS)


def get_environment_factory(spec: str) -> EnvFactory:
    """The factory ``spec`` names: a built-in name or ``module:Class`` (imported now)."""
    names = environment_names()
    if spec in ENVIRONMENTS:
        return ENVIRONMENTS[spec]
    if ":" not in spec:
        raise ValueError(f"env.name = {spec!r} is not a built-in environment ({', '.join(names)}); give one of "
                         "them or your own as 'module:Class'")
    try:
        factory = import_object(spec, kind="Class")
    except ValueError as error:
        raise ValueError(f"env.name = {spec!r}: {error}") from None
    if not callable(factory):
        raise ValueError(f"env.name = {spec!r} is a {type(factory).__name__}, not a class or function that makes an "
                         "environment")
    return factory


def make_environment(factory: EnvFactory, params: Mapping[str, Any], spec: str) -> Environment:
    """One environment from ``factory(**params)``; ValueError naming env.name and env.params when it fails."""
    try:
        env = factory(**params)
    except Exception as error:
        raise ValueError(f"env.name = {spec!r} with env.params = {dict(params)!r} could not be made: "
                         f"{type(error).__name__}: {error}; fix env.params") from error
    missing = [name for name in ("reset", "step") if not callable(getattr(env, name, None))]
    if missing:
        raise ValueError(f"env.name = {spec!r} makes a {type(env).__name__} without {' and '.join(missing)}(); an "
                         "environment needs reset(record) and step(assistant_message) (megacispo.envs.base)")
    return env


def check_messages(messages: Any, what: str) -> Messages:
    """``messages`` as a list of {"role", "content"} dicts of the reply roles; ValueError saying what is wrong."""
    if not isinstance(messages, list):
        raise ValueError(f"{what} returned messages of type {type(messages).__name__}, not a list of "
                         "{'role', 'content'} dicts")
    checked = []
    for index, message in enumerate(messages):
        if not (isinstance(message, Mapping) and message.get("role") in ROLES
                and isinstance(message.get("content"), str)):
            raise ValueError(f"{what} returned message {index} = {message!r:.200}: each must be "
                             f"{{'role': one of {', '.join(ROLES)}, 'content': str}}")
        checked.append({"role": message["role"], "content": message["content"]})
    chars = sum(len(message["content"]) for message in checked)
    if chars > MAX_MESSAGES_CHARS:
        raise ValueError(f"{what} returned messages of {chars} characters, over the {MAX_MESSAGES_CHARS} one call may "
                         "return (megacispo.envs.base.MAX_MESSAGES_CHARS); cut the text the environment replies with")
    return checked


def check_number(value: Any, what: str) -> float:
    """``value`` (a Python, numpy or one-element torch number) as a float within float32, the dtype of the
    advantages; ValueError naming ``what`` otherwise."""
    if isinstance(value, (str, bytes)):  # float() would parse '1.0': text is a bug, not a number
        raise ValueError(f"{what} = {value!r:.80} is text, not a number")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what} = {value!r:.80} is a {type(value).__name__}, not a number") from None
    if not abs(number) <= FLOAT32_MAX:
        raise ValueError(f"{what} = {number} is not a finite number within float32 (at most {FLOAT32_MAX:.3g} in size)")
    return number


def check_step(result: Any) -> EnvStep:
    """An environment's step result, checked: an EnvStep with finite reward and well-formed messages."""
    if not isinstance(result, EnvStep):
        raise ValueError(f"step() returned {type(result).__name__} {result!r:.200}, not an EnvStep")
    reward = check_number(result.reward, "step()'s reward")
    # "no" would be truthy: only what compares equal to a bool is one (numpy's and torch's included)
    if result.done not in (True, False):
        raise ValueError(f"step()'s done = {result.done!r:.80} is not a bool")
    messages = check_messages(list(result.messages) if isinstance(result.messages, tuple) else result.messages,
                              "step()")
    if not result.done and not messages:
        raise ValueError("step() returned no messages and done=False: the model would have nothing to answer")
    metrics = {}
    for name, value in dict(result.metrics).items():
        if not isinstance(name, str):
            raise ValueError(f"step() returned metric name {name!r}: metrics are str -> number")
        metrics[name] = check_number(value, f"step()'s metric {name!r}")
    return EnvStep(messages, reward, bool(result.done), metrics)
