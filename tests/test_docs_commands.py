"""Every command in README.md and docs/*.md runs as written: each one's scripts, configs, tools and
modules exist, and the cheap ones (--help, --dry-run, tools/plan.py, tools/model_info.py,
tools/config_reference.py --check) run for real and exit 0."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# What starts a command line (after VAR=value assignments).
PROGRAMS = (".venv/bin/", "python", "bash", "torchrun")
# Top-level folders whose files a command may name; anything else (runs/, placeholders) is output or input.
PROJECT_FOLDERS = ("examples", "tools", "benchmarks", "tests", "megacispo", "models", "parallel", "docs")
CHEAP_TOOLS = ("tools/plan.py", "tools/model_info.py")
RUN_TIMEOUT_S = 120


@dataclass(frozen=True)
class Command:
    """One command of a document: where it is, its environment assignments and its words."""

    where: str
    env: dict[str, str]
    words: list[str]

    def __str__(self) -> str:
        return f"{self.where}: {shlex.join(self.words)}"


def _code_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of the fenced and indented code blocks of a Markdown text."""
    lines, fenced, previous_blank, in_indented = [], False, True, False
    for number, line in enumerate(text.splitlines(), start=1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        in_indented = line.startswith("    ") and (previous_blank or in_indented) and not fenced
        if fenced or in_indented:
            lines.append((number, line.strip()))
        previous_blank = not line.strip()
    return lines


def _commands(path: Path) -> list[Command]:
    """The command lines of a document, continuation lines joined and comments dropped."""
    commands, pending, start = [], "", 0
    for number, line in _code_lines(path.read_text()):
        if not pending:
            start = number
        pending += line.rstrip("\\").strip() + " "
        if line.endswith("\\"):
            continue
        text, pending = pending.strip(), ""
        words = shlex.split(text, comments=True)
        env = {}
        while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
            key, value = words.pop(0).split("=", 1)
            env[key] = value
        if words and words[0].startswith(PROGRAMS):
            commands.append(Command(f"{path.relative_to(REPO)}:{start}", env, words))
    return commands


ALL_COMMANDS = [command for document in DOCUMENTS for command in _commands(document)]


def _project_files(command: Command) -> list[str]:
    """The project files a command names: paths under the project's folders and -m modules."""
    named = [word for word in command.words if word.split("/")[0] in PROJECT_FOLDERS and "/" in word]
    for flag, value in zip(command.words, command.words[1:]):
        if flag == "-m" and value.startswith("megacispo."):
            named.append(value.replace("megacispo.", "megacispo/", 1).replace(".", "/") + ".py")
    return named


def _is_cheap(command: Command) -> bool:
    words = command.words
    if any(word.startswith("$") or word.startswith("[") for word in words):
        return False  # a variable or a synopsis: not a literal command
    if "--help" in words or "--dry-run" in words:
        return True
    if any(word in CHEAP_TOOLS for word in words):
        return True
    return "tools/config_reference.py" in words and "--check" in words


def _as_local_process(command: Command) -> tuple[list[str], dict[str, str]]:
    """The command as this test runs it: this interpreter for python, torchrun's -m module as one
    process that sees torchrun's WORLD_SIZE (a dry run and --help build nothing)."""
    words, env = list(command.words), {**os.environ, **command.env}
    if words[0].endswith("torchrun"):
        nproc = words[words.index("--nproc-per-node") + 1] if "--nproc-per-node" in words else "1"
        env.setdefault("WORLD_SIZE", nproc)
        words = [sys.executable, *words[words.index("-m"):]]
    elif words[0].endswith("python"):
        words = [sys.executable, *words[1:]]
    return words, env


def test_the_documents_have_commands():
    """The extraction works: the README's two commands and the docs' launch commands are found."""
    texts = {shlex.join(command.words) for command in ALL_COMMANDS}
    assert "bash examples/quickstart.sh" in texts and "bash tests/run.sh" in texts
    assert sum(_is_cheap(command) for command in ALL_COMMANDS) >= 5


@pytest.mark.parametrize("command", ALL_COMMANDS, ids=str)
def test_command_names_existing_files(command: Command):
    missing = [name for name in _project_files(command) if not (REPO / name).exists()]
    assert not missing, f"{command} names files that do not exist: {missing}"


@pytest.mark.parametrize("command", [c for c in ALL_COMMANDS if _is_cheap(c)], ids=str)
def test_cheap_command_runs(command: Command):
    words, env = _as_local_process(command)
    result = subprocess.run(words, cwd=REPO, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert result.returncode == 0, f"{command} exited {result.returncode}:\n{result.stdout[-2000:]}{result.stderr[-2000:]}"
