"""The built-in environments: ``python``, a sandboxed Python tool for verifiable arithmetic, and
``guess_number``, a higher-or-lower game without tools (tools/make_tool_task.py writes their data).

``python`` (``PythonTool``): a model turn that holds a tool call, ``<python>CODE</python>``, gets the
code's output as a "tool" message; a turn without one is the final answer, graded like the
``numeric`` reward (the last number written against the record's answer). The close tag must be one
of ``env.stop_tokens``, so that a turn ends right after its call; a tokenizer for it is trained with
the tags as single pieces (``tools/train_tokenizer.py --symbols "<python>" "</python>"``). Each call
starts a sandboxed Python process (``megacispo.envs.sandbox``) bounded by ``limits``, so the
sandbox's ``wall_s`` must stay under ``env.timeout_s``, the bound on one ``step``.

``guess_number`` (``GuessNumber``): the record's answer is a secret integer that its prompt gives a
range for; each model turn's last integer is a guess, answered "higher" or "lower" as a user message
until the guess is right (reward 1) or a turn holds no number (the game ends, reward 0).

Every step reports the same metric names, zero where they do not apply, so that a metric's mean
over samples counts the samples that never took such a turn as zeros.
"""

from __future__ import annotations

import ast
import dataclasses
from decimal import Decimal
from typing import Any, Mapping

from megacispo.data.prompts import PromptRecord
from megacispo.data.rewards import last_number, parse_number
from megacispo.envs.base import EnvStep, register_environment
from megacispo.envs.sandbox import SandboxLimits, SandboxResult, run_python

TIMEOUT_STATUSES = ("timeout", "cpu_limit")
"""The sandbox statuses that count as a tool timeout (wall clock or CPU time ran out)."""

FAILURE_LINES = {
    "timeout": "error: timeout",
    "cpu_limit": "error: cpu time limit",
    "memory": "error: memory limit",
    "killed": "error: killed",
}
"""The reply to a failed call by sandbox status; "error" and "refused" show the last line of stderr."""


def _answer_number(record: PromptRecord, env_name: str) -> Decimal:
    target = parse_number(record.answer)
    if target is None:
        raise ValueError(f"record answer {record.answer!r} (prompt {record.prompt!r:.80}) is not a number; the "
                         f"{env_name!r} environment grades against a numeric answer: write it as digits, e.g. \"2146\"")
    return target


def _sandbox_limits(limits: Mapping[str, Any] | None) -> SandboxLimits:
    if limits is None:
        return SandboxLimits()
    if not isinstance(limits, Mapping):
        raise ValueError(f"env.params.limits = {limits!r} is not a mapping; give a dict such as {{'wall_s': 5}}")
    names = [field.name for field in dataclasses.fields(SandboxLimits)]
    unknown = sorted(set(limits) - set(names))
    if unknown:
        raise ValueError(f"env.params.limits has unknown field(s) {', '.join(map(repr, unknown))}; the sandbox's "
                         f"limits are {', '.join(names)}")
    return SandboxLimits(**limits)


def _failure_line(result: SandboxResult) -> str:
    if result.status in FAILURE_LINES:
        return FAILURE_LINES[result.status]
    lines = [line.strip() for line in result.stderr.splitlines() if line.strip()]
    # A traceback's last line names the exception: "ZeroDivisionError: division by zero".
    detail = lines[-1] if lines else f"exit status {result.returncode}"
    return f"error: {detail}" if result.status == "error" else f"error: {result.status}: {detail}"


def _expression_program(code: str) -> str:
    """``code`` as a program that prints its value, as a REPL would, when it is a single expression."""
    try:
        ast.parse(code, mode="eval")
    except SyntaxError:
        return code
    # eval of the source itself, not the source pasted into a template: a comment or a line break in
    # the expression stays harmless, and the traceback's last line is the expression's own error.
    return (f"__value = eval(compile({code!r}, '<python>', 'eval'))\n"
            "if __value is not None:\n"
            "    print(repr(__value))\n")


@register_environment("python")
class PythonTool:
    """One conversation with a sandboxed Python tool; its final answer is graded against record.answer."""

    def __init__(self, open_tag: str = "<python>", close_tag: str = "</python>", reply_format: str = "{output}",
                 max_tool_calls: int = 4, limits: Mapping[str, Any] | None = None) -> None:
        """
        open_tag:       starts a tool call in a model turn
        close_tag:      ends it (one of env.stop_tokens, so the turn ends there)
        reply_format:   the tool message's content, with {output} the call's output or failure line
        max_tool_calls: the calls a conversation may make; the next one ends it with reward 0
        limits:         SandboxLimits fields for each call (the sandbox's defaults where absent)
        """
        for name, tag in (("open_tag", open_tag), ("close_tag", close_tag)):
            if not isinstance(tag, str) or not tag:
                raise ValueError(f"env.params.{name} = {tag!r} must be a non-empty string, e.g. '<python>'")
        try:
            reply_format.format(output="")
        except (AttributeError, IndexError, KeyError, ValueError) as error:
            raise ValueError(f"env.params.reply_format = {reply_format!r} is not a format string with only the "
                             f"field {{output}} ({type(error).__name__}: {error}); e.g. 'Output: {{output}}'") from None
        if isinstance(max_tool_calls, bool) or not isinstance(max_tool_calls, int) or max_tool_calls < 0:
            raise ValueError(f"env.params.max_tool_calls = {max_tool_calls!r} must be an integer >= 0")
        self.open_tag = open_tag
        self.close_tag = close_tag
        self.reply_format = reply_format
        self.max_tool_calls = max_tool_calls
        self.limits = _sandbox_limits(limits)
        self._target: Decimal | None = None
        self._tool_calls = 0
        self._tool_found_answer = False

    def reset(self, record: PromptRecord) -> None:
        self._target = _answer_number(record, "python")
        self._tool_calls = 0
        self._tool_found_answer = False
        return None

    def tool_call(self, code: str) -> str:
        """The text of a model turn that calls the tool on ``code``."""
        return f"{self.open_tag}{code}{self.close_tag}"

    def reply(self, output: str) -> dict[str, str]:
        """The tool message that carries ``output`` (a call's output or failure line)."""
        return {"role": "tool", "content": self.reply_format.format(output=output)}

    def find_call(self, assistant_message: str) -> str | None:
        """The code of the turn's first complete tool call; None when it has none (a final answer).

        The first: text after it is the model imagining the reply, when close_tag is no stop token."""
        start = assistant_message.find(self.open_tag)
        if start < 0:
            return None
        end = assistant_message.find(self.close_tag, start + len(self.open_tag))
        return None if end < 0 else assistant_message[start + len(self.open_tag):end]

    def run(self, code: str) -> tuple[str, SandboxResult]:
        """(the call's output or failure line, the sandbox's result) for ``code``."""
        result = run_python(_expression_program(code), self.limits)
        return (result.stdout.strip() if result.status == "ok" else _failure_line(result)), result

    def step(self, assistant_message: str) -> EnvStep:
        if self._target is None:
            raise RuntimeError("PythonTool.step() before reset(record): an environment serves one conversation, "
                               "reset with its record first")
        code = self.find_call(assistant_message)
        if code is None:
            return self._grade(assistant_message)
        self._tool_calls += 1
        if self._tool_calls > self.max_tool_calls:
            return EnvStep([self.reply("error: too many tool calls")], 0.0, True,
                           self._metrics(tool_calls=1, tool_failures=1, tool_limit=1))
        output, result = self.run(code)
        failed = result.status != "ok"
        if not failed and last_number(output) == self._target:
            self._tool_found_answer = True
        return EnvStep([self.reply(output)], 0.0, False,
                       self._metrics(tool_calls=1, tool_failures=int(failed),
                                     tool_timeouts=int(result.status in TIMEOUT_STATUSES)))

    def _grade(self, assistant_message: str) -> EnvStep:
        correct = last_number(assistant_message) == self._target
        return EnvStep([], float(correct), True,
                       self._metrics(answered=1, correct_tool_use=float(correct and self._tool_found_answer)))

    @staticmethod
    def _metrics(**counts: float) -> dict[str, float]:
        names = ("tool_calls", "tool_failures", "tool_timeouts", "tool_limit", "answered", "correct_tool_use")
        return {name: float(counts.get(name, 0)) for name in names}


@register_environment("guess_number")
class GuessNumber:
    """One higher-or-lower game: record.answer is the secret integer, each model turn one guess."""

    def __init__(self, higher: str = "higher", lower: str = "lower") -> None:
        """
        higher: the reply to a guess below the secret
        lower:  the reply to a guess above it
        """
        for name, reply in (("higher", higher), ("lower", lower)):
            if not isinstance(reply, str) or not reply.strip():
                raise ValueError(f"env.params.{name} = {reply!r} must be a non-blank string, e.g. {name!r}")
        if higher == lower:
            raise ValueError(f"env.params.higher and env.params.lower are both {higher!r}; the model could not tell "
                             "them apart: make them differ")
        self.higher = higher
        self.lower = lower
        self._secret: Decimal | None = None

    def reset(self, record: PromptRecord) -> None:
        secret = _answer_number(record, "guess_number")
        if secret != secret.to_integral_value():
            raise ValueError(f"record answer {record.answer!r} is not an integer; guess_number's secret is one")
        self._secret = secret
        return None

    def step(self, assistant_message: str) -> EnvStep:
        if self._secret is None:
            raise RuntimeError("GuessNumber.step() before reset(record): an environment serves one conversation, "
                               "reset with its record first")
        guess = last_number(assistant_message)
        if guess is None:
            return EnvStep([], 0.0, True, {"guesses": 1.0, "invalid": 1.0})
        metrics = {"guesses": 1.0, "invalid": 0.0}
        if guess == self._secret:
            return EnvStep([], 1.0, True, metrics)
        reply = self.higher if guess < self._secret else self.lower
        return EnvStep([{"role": "user", "content": reply}], 0.0, False, metrics)
