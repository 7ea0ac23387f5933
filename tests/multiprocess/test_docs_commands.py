"""Every command in README.md and docs/**/*.md runs as written: each one's scripts, configs, tools and
modules exist, and the cheap ones (--help, --dry-run, tools/plan.py, tools/model_info.py,
tools/config_reference.py --check) run for real and exit 0. Every relative link and image of those
documents points at a file of the repository (and a link's #anchor at a heading of its page), every
project path and megacispo module they name exists, and docs/reference/cli.md lists exactly the
flags of each program's parser."""

from __future__ import annotations

import ast
import functools
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

# The repository root, wherever under tests/ this file sits.
REPO = next(parent for parent in Path(__file__).resolve().parents if (parent / "setup.py").is_file())
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
CLI_REFERENCE = REPO / "docs" / "reference" / "cli.md"
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
        first = next((word for word in text.split() if not re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", word)), "")
        if not first.startswith(PROGRAMS):
            continue  # output shown in a code block (an error message, apostrophes and all), not a command
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


_RESULTS: dict[str, subprocess.CompletedProcess] = {}


def _run(command: Command) -> subprocess.CompletedProcess:
    """A cheap command's result, run once however many tests read it."""
    if command.where not in _RESULTS:
        words, env = _as_local_process(command)
        _RESULTS[command.where] = subprocess.run(words, cwd=REPO, env=env, capture_output=True, text=True,
                                                 timeout=RUN_TIMEOUT_S)
    return _RESULTS[command.where]


@pytest.mark.parametrize("command", [c for c in ALL_COMMANDS if _is_cheap(c)], ids=str)
def test_cheap_command_runs(command: Command):
    result = _run(command)
    assert result.returncode == 0, f"{command} exited {result.returncode}:\n{result.stdout[-2000:]}{result.stderr[-2000:]}"


# ---------------------------------------------------------------------------------------------
# Links, and the paths and modules the documents name
# ---------------------------------------------------------------------------------------------

# [text](target) and ![alt](target); the target ends at a space (a title may follow) or at ")".
INLINE_LINK = re.compile(r"(!?)\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.MULTILINE)
INLINE_CODE = re.compile(r"(`+).+?\1", re.DOTALL)  # a code span may wrap a line
# A path into one of the project's folders, not inside another path or a URL; it ends before a
# placeholder (runs/<name>, tests/test_*.py), which is left unchecked.
PATH_MENTION = re.compile(rf"(?<![\w./<$-])((?:{'|'.join(PROJECT_FOLDERS)})/[\w./-]*)(?![\w./-]*[<*{{$\[])")
MODULE_MENTION = re.compile(r"(?<![\w./])megacispo(?:\.\w+)+")


def _outside_code_blocks(text: str) -> str:
    """The text with its fenced and indented code blocks blanked."""
    code = {number for number, _ in _code_lines(text)}
    return "\n".join("" if number in code or line.lstrip().startswith("```") else line
                     for number, line in enumerate(text.splitlines(), start=1))


def _prose(text: str) -> str:
    """The text outside code blocks and inline code spans."""
    return INLINE_CODE.sub("", _outside_code_blocks(text))


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@functools.cache
def _anchors(path: Path) -> frozenset[str]:
    """The anchors of a Markdown page's headings (a repeated heading gets -1, -2, ...)."""
    anchors, seen = set(), {}
    for line in _outside_code_blocks(path.read_text()).splitlines():
        heading = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading:
            slug = _slug(heading.group(1))
            anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
    return frozenset(anchors)


def _links(path: Path) -> list[tuple[bool, str]]:
    """(is an image, target) of every link of a Markdown page outside its code."""
    prose = _prose(path.read_text())
    links = [(bang == "!", target) for bang, target in INLINE_LINK.findall(prose)]
    return links + [(False, target) for target in REFERENCE_LINK.findall(prose)]


def _broken_links(path: Path, root: Path = REPO) -> list[str]:
    """The relative links and images of a page whose file (or heading) does not exist under ``root``."""
    broken = []
    for is_image, target in _links(path):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):
            continue  # https:, mailto:: not a file of the repository
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / file_part).resolve() if file_part else path.resolve()
        if not resolved.is_relative_to(root) or not resolved.exists() or (is_image and not resolved.is_file()):
            broken.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            broken.append(f"{target}: {resolved.relative_to(root)} has no heading #{anchor}")
    return broken


def _top_level_names(module: Path) -> set[str]:
    """What a module defines or imports at its top level, read without importing it."""
    names = set()
    for node in ast.parse(module.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {name.id for target in targets for name in ast.walk(target) if isinstance(name, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
    return names


# The subpackages of megacispo whose files live elsewhere (setup.py's package_dir).
INSTALLED_AS = {"models": "models", "parallel": "parallel", "testing": "tests/support"}


def _module_exists(dotted: str) -> bool:
    """megacispo.a.b[.name]: a module of the package (models, parallel and tests/support install as its
    subpackages models, parallel and testing), optionally followed by a name the module defines."""
    parts = dotted.split(".")[1:]
    folder = REPO / INSTALLED_AS[parts[0]] if parts[0] in INSTALLED_AS else REPO / "megacispo"
    parts = parts[1:] if parts[0] in INSTALLED_AS else parts
    for index, part in enumerate(parts):
        if (folder / part / "__init__.py").is_file():
            folder = folder / part
        elif (folder / f"{part}.py").is_file():
            rest = parts[index + 1:]
            return not rest or rest[0] in _top_level_names(folder / f"{part}.py")
        else:
            init = folder / "__init__.py"
            return folder != REPO / "megacispo" and init.is_file() and part in _top_level_names(init)
    return True


def _missing_mentions(path: Path) -> list[str]:
    """The project paths and megacispo modules a page names that do not exist."""
    text = path.read_text()
    paths = {mention.rstrip(".") for mention in PATH_MENTION.findall(text)}
    missing = [mention for mention in sorted(paths) if not (REPO / mention).exists()]
    return missing + [module for module in sorted(set(MODULE_MENTION.findall(text))) if not _module_exists(module)]


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda path: str(path.relative_to(REPO)))
def test_links_point_at_existing_files(document: Path):
    broken = _broken_links(document)
    assert not broken, f"{document.relative_to(REPO)} links to what does not exist: {broken}"


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda path: str(path.relative_to(REPO)))
def test_named_paths_and_modules_exist(document: Path):
    missing = _missing_mentions(document)
    assert not missing, f"{document.relative_to(REPO)} names paths or modules that do not exist: {missing}"


def test_the_link_check_finds_what_is_broken(tmp_path: Path):
    """The checks above can fail: a missing page, image and heading, and an old module, are reported."""
    page = tmp_path / "page.md"
    page.write_text("# A page\n\nSee [the guide](missing.md), [here](#a-page), [there](#nowhere) and\n"
                    "[a site](https://example.com).\n\n![plot](plot.png)\n\n    [not a link](in_code.md)\n\n"
                    "`megacispo.losses`, `megacispo.rl.losses.compute_policy_loss`, `megacispo.rl.nothing`.\n")
    assert _broken_links(page, root=tmp_path) == [
        "missing.md: no such file", "#nowhere: page.md has no heading #nowhere", "plot.png: no such file"]
    (tmp_path / "missing.md").write_text("# Missing\n")
    (tmp_path / "plot.png").write_bytes(b"")
    assert _broken_links(page, root=tmp_path) == ["#nowhere: page.md has no heading #nowhere"]
    assert _missing_mentions(page) == ["megacispo.losses", "megacispo.rl.nothing"]


def test_every_page_is_in_the_readme_table():
    """README.md's documentation table links every guide, reference page and report."""
    linked = {(REPO / target.partition("#")[0]).resolve() for _, target in _links(REPO / "README.md")}
    pages = [*(REPO / "docs" / "guides").glob("*.md"), *(REPO / "docs" / "reference").glob("*.md"),
             *(REPO / "docs" / "reports").glob("*.md")]
    assert len(pages) >= 10 and sum(is_image for document in DOCUMENTS for is_image, _ in _links(document)) >= 5
    unlisted = [str(page.relative_to(REPO)) for page in pages if page.resolve() not in linked]
    assert not unlisted, f"pages missing from README.md's documentation table: {unlisted}"


# ---------------------------------------------------------------------------------------------
# docs/reference/cli.md against the parsers
# ---------------------------------------------------------------------------------------------

FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def _cli_sections() -> list:
    """Each --help command of cli.md with the flags of its section's table (first column), as params."""
    lines = CLI_REFERENCE.read_text().splitlines()
    headings = [number for number, line in enumerate(lines, start=1) if re.match(r"#{1,6} ", line)] + [len(lines) + 1]
    sections = []
    for command in _commands(CLI_REFERENCE):
        if "--help" not in command.words:
            continue
        line = int(command.where.rsplit(":", 1)[1])
        start = max(number for number in headings if number < line)
        end = min(number for number in headings if number > line)
        rows = [row for row in lines[start:end - 1] if row.startswith("|") and not row.startswith("|---")][1:]
        documented = {flag for row in rows for flag in FLAG.findall(row.split("|")[1])}
        sections.append(pytest.param(command, documented, id=str(command)))
    return sections


@pytest.mark.parametrize("command, documented", _cli_sections())
def test_cli_reference_lists_every_flag(command: Command, documented: set[str]):
    result = _run(command)
    assert result.returncode == 0, f"{command} exited {result.returncode}:\n{result.stderr[-2000:]}"
    usage = result.stdout.split("\n\n")[0]  # argparse's usage block names every flag
    flags = set(FLAG.findall(usage))
    assert documented == flags, (f"{command}: docs/reference/cli.md's table lacks {sorted(flags - documented)} "
                                 f"and lists flags the parser does not have: {sorted(documented - flags)}")
