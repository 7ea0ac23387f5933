"""The sandboxed Python runner (megacispo.envs.sandbox): ordinary code runs; hostile code is refused or
killed within its limits, leaves no process behind, and cannot touch the test's files or process."""

from __future__ import annotations

import dis
import os
import signal
import socket
import sys

import pytest

from megacispo.envs.sandbox import SandboxLimits, SandboxResult, _make_guard, run_python

HOSTILE = SandboxLimits(cpu_s=1, wall_s=10, memory_mb=128, max_output_chars=4000)
"""Small limits for the hostile cases; the wall clock's is far above the others, so that a status of
"cpu_limit", "memory" or "refused" shows that limit acted, not the wall clock, on a loaded machine too."""
REFUSED_WITHIN_S = 5.0
"""A refusal comes at once: the child's start plus the refused call (seconds on a loaded 2-core machine)."""
LIMIT_MARGIN_S = 2.0
"""Slack over a wall limit for the kill and the reaping."""
PID_LINE = "import os; print('PID', os.getpid())\n"
"""Prefixed to hostile code, so the test knows the child's pid and can look for what it left behind."""


def _leftovers(pid: int, existing: frozenset[str] = frozenset()) -> list[str]:
    """Processes still alive (or unreaped) from the child ``pid``: itself, its group, its session, or any child
    of this test process but those in ``existing`` (earlier tests' long-lived workers, such as a reward's)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or entry in existing:
            continue
        try:
            with open(f"/proc/{entry}/stat") as file:
                stat = file.read()
        except OSError:  # it ended while we looked
            continue
        state, ppid, pgrp, session = stat[stat.rindex(")") + 2:].split()[:4]
        if int(entry) == pid or int(pgrp) == pid or int(session) == pid or int(ppid) == os.getpid():
            found.append(f"pid {entry} ({state}): {stat[:80]}")
    return found


def _hostile(code: str, status: str, within_s: float = REFUSED_WITHIN_S,
             limits: SandboxLimits = HOSTILE) -> SandboxResult:
    """Run hostile ``code``; assert its status, that it ended within ``within_s``, and that nothing is left."""
    existing = frozenset(os.listdir("/proc"))
    result = run_python(PID_LINE + code, limits)
    assert result.status == status, (result.status, result.returncode, result.stderr)
    assert result.wall_s < within_s, f"took {result.wall_s:.2f} s, limit {within_s} s"
    pid = int(result.stdout.split()[1])
    assert _leftovers(pid, existing) == []
    return result


@pytest.fixture
def signals_received():
    """SIGUSR1s this test process receives while the test runs (the hostile code aims them at it)."""
    received = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: received.append(signum))
    yield received
    signal.signal(signal.SIGUSR1, previous)


def test_ordinary_code_prints_the_answer() -> None:
    result = run_python("print(37 * 58)")
    assert (result.status, result.stdout, result.stderr, result.returncode) == ("ok", "2146\n", "", 0)
    assert 0 < result.wall_s < SandboxLimits().wall_s


def test_exception_is_an_error_with_its_traceback() -> None:
    result = run_python("def f():\n    return 1 / 0\nf()")
    assert (result.status, result.returncode) == ("error", 1)
    assert 'File "main.py", line 2, in f' in result.stderr and "ZeroDivisionError: division by zero" in result.stderr
    assert run_python("import sys\nsys.exit(3)").returncode == 3
    assert run_python("def (:").status == "error"
    assert "EOFError" in run_python("input()").stderr  # stdin is empty


def test_runs_in_a_fresh_directory_removed_afterwards_with_an_empty_environment() -> None:
    result = run_python("import os\nopen('notes.txt', 'w').write('x')\nprint(os.getcwd())\nprint(sorted(os.environ))")
    workdir, environment = result.stdout.splitlines()
    assert result.status == "ok" and os.path.basename(workdir).startswith("megacispo-sandbox-")
    assert not os.path.exists(workdir)
    assert eval(environment) == ["HOME", "LC_ALL", "MKL_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                                 "TMPDIR"]
    inside = run_python("import os, tempfile\nos.mkdir('d')\nos.rename('main.py', 'd/m.py')\n"
                        "with tempfile.NamedTemporaryFile() as f, tempfile.TemporaryFile() as g:\n"
                        "    f.write(b'x')\n    g.write(b'y')\nprint(os.listdir('d'), 'é')")
    assert (inside.status, inside.stdout) == ("ok", "['m.py'] é\n"), inside.stderr


def test_output_is_capped_keeping_head_and_tail() -> None:
    result = run_python("import sys\nprint('a' * 100000)\nsys.exit('the end')", SandboxLimits(max_output_chars=100))
    assert result.stdout.startswith("a" * 50 + "\n[... output cut: 100001 bytes in all")
    assert result.stdout.endswith("a" * 49 + "\n") and len(result.stdout) < 200
    assert result.stderr == "the end\n"


def test_numpy_and_sympy_import() -> None:
    result = run_python("import numpy, sympy\nprint(numpy.arange(4).sum(), sympy.factor('x**2 - 1'))")
    assert (result.status, result.stdout) == ("ok", "6 (x - 1)*(x + 1)\n"), result.stderr


@pytest.mark.parametrize("code", [
    "while True:\n    os.fork()",
    "import subprocess\nsubprocess.Popen(['sleep', '100'])",
    "os.system('sleep 100')",
    "os.posix_spawn('/bin/sleep', ['sleep', '100'], {})",
    "import multiprocessing\nmultiprocessing.get_context('spawn').Process(target=print).start()",
    "import _posixsubprocess\n_posixsubprocess.fork_exec()",  # no audit event: a stub refuses it
    "import sys\ndel sys.modules['_posixsubprocess']\nimport _posixsubprocess",  # a fresh copy would have it back
    "os.kill(os.getppid(), __import__('signal').SIGUSR1)",
    "import signal\nsignal.pidfd_send_signal(os.pidfd_open(os.getppid()), signal.SIGUSR1)",
])
def test_processes_and_signals_are_refused(code: str, signals_received: list) -> None:
    result = _hostile(code, "refused")
    assert "is not allowed in the sandbox" in result.stderr
    assert signals_received == []


@pytest.mark.parametrize("code", [
    "while True:\n    pass",
    "import threading\ndef spin():\n    while True:\n        pass\n"
    "for _ in range(3):\n    threading.Thread(target=spin, daemon=True).start()\nspin()",
    "import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True:\n    pass",
])
def test_cpu_limit_kills(code: str) -> None:
    _hostile(code, "cpu_limit", within_s=HOSTILE.wall_s)


@pytest.mark.parametrize("code", [
    "import time\ntime.sleep(100)",
    "import time\nos.close(1)\nos.close(2)\ntime.sleep(100)",  # no EOF to wait for
    "import sys\nwhile True:\n    sys.stdout.write('y' * 65536)",  # a flood: kept bounded
])
def test_wall_clock_limit_kills(code: str) -> None:
    limits = SandboxLimits(cpu_s=5, wall_s=1, max_output_chars=4000)
    result = _hostile(code, "timeout", within_s=limits.wall_s + LIMIT_MARGIN_S, limits=limits)
    assert result.wall_s >= limits.wall_s
    assert len(result.stdout) < 2 * limits.max_output_chars


@pytest.mark.parametrize("code", ["bytearray(10 * 2**30)", "x = [0] * 10**9",
                                  "x = []\nwhile True:\n    x.append(' ' * 10**6)"])
def test_memory_limit(code: str) -> None:
    result = _hostile(code, "memory")
    assert "MemoryError" in result.stderr


def test_file_size_limit() -> None:
    result = run_python("open('big', 'wb').write(b'x' * (2 << 20))", SandboxLimits(file_size_mb=1))
    assert result.status == "error" and "File too large" in result.stderr


@pytest.mark.parametrize("code", [
    "open(TARGET, 'w').write('x')",
    "os.open(TARGET, os.O_CREAT | os.O_WRONLY)",
    "import pathlib\npathlib.Path(TARGET).write_text('x')",
    "os.mkdir(TARGET)",
    "os.rename('main.py', TARGET)",
    "import shutil\nshutil.copy('main.py', TARGET)",
    "os.symlink(TARGET, 'link')\nopen('link', 'w')",
    "os.link('main.py', TARGET)",
    "open(os.path.relpath(TARGET), 'w')",
    "open(os.getcwd() + '/..' + TARGET[len(os.path.dirname(os.getcwd())):], 'w')",
    "os.chdir(os.path.dirname(TARGET))\nopen(os.path.basename(TARGET), 'w')",
    "import tempfile\ntempfile.mkstemp(dir=os.path.dirname(TARGET))",
    "import sqlite3\nsqlite3.connect(TARGET)",
    "import io\nio.FileIO(TARGET, 'w')",
    "open(TARGET.encode(), 'w')",
    "class Sly(str):\n    def startswith(self, *args):\n        return True\nopen(Sly(TARGET), 'w')",
    "import builtins\nbuiltins.issubclass = builtins.isinstance = lambda *args: True\nopen(TARGET, 'w')",
    "fd = os.open(os.path.dirname(os.__file__), os.O_RDONLY)\nos.open('x', os.O_CREAT | os.O_WRONLY, dir_fd=fd)",
    "os.mknod('disk', 0o600 | 0o060000, os.makedev(8, 0))",
    "import _imp, importlib.machinery\n_imp.create_builtin(importlib.machinery.ModuleSpec('posix', None)).mknod('x')",
    "os.chmod(VICTIM, 0o777)",
    "os.remove(VICTIM)",
    "os.truncate(VICTIM, 0)",
    "import resource\nresource.setrlimit(resource.RLIMIT_CPU, (100, 100))",
])
def test_writing_outside_its_directory_is_refused(code: str, tmp_path) -> None:
    target, victim = tmp_path / "written", tmp_path / "victim"
    victim.write_text("keep")
    os.chmod(victim, 0o644)
    result = _hostile(f"TARGET, VICTIM = {str(target)!r}, {str(victim)!r}\n{code}", "refused")
    assert "is not allowed in the sandbox" in result.stderr
    assert not target.exists() and not os.path.lexists(target)
    assert victim.read_text() == "keep" and victim.stat().st_mode & 0o777 == 0o644


@pytest.mark.parametrize("code", [
    "print(open(CHECKPOINT).read())",
    "print(os.read(os.open(CHECKPOINT, os.O_RDONLY), 100))",
    "import pathlib\nprint(pathlib.Path(CHECKPOINT).read_bytes())",
    "import io\nprint(io.open_code(CHECKPOINT).read())",
    "print(open(os.path.relpath(CHECKPOINT)).read())",
    "print(open('/proc/self/root' + CHECKPOINT).read())",
    "print(open(f'/proc/{os.getppid()}/environ').read())",
    "print(os.listdir(os.path.dirname(CHECKPOINT)))",
    "import shutil\nshutil.copy(CHECKPOINT, 'copy')\nprint(open('copy').read())",
    "fd = os.open('/', os.O_RDONLY)\nprint(os.read(os.open(CHECKPOINT[1:], os.O_RDONLY, dir_fd=fd), 100))",
    "import runpy\nprint(runpy.run_path(CHECKPOINT)['SECRET'])",
    "import _xxsubinterpreters as interpreters\n"
    "interpreters.run_string(interpreters.create(), f'print(open({CHECKPOINT!r}).read())')",
    "import megacispo",  # the project's own files are not readable either
])
def test_reading_a_checkpoint_outside_is_refused(code: str, tmp_path) -> None:
    checkpoint = tmp_path / "checkpoint.py"
    checkpoint.write_text("SECRET = 'weights-4f2a9c'\n")
    result = _hostile(f"CHECKPOINT = {str(checkpoint)!r}\n{code}", "refused")
    assert "weights-4f2a9c" not in result.stdout and "weights-4f2a9c" not in result.stderr
    assert "is not allowed in the sandbox" in result.stderr


@pytest.mark.parametrize("code", [
    "import socket\nsocket.socket()",
    "import socket\nsocket.create_connection(('127.0.0.1', PORT))",
    "import urllib.request\nurllib.request.urlopen(f'http://127.0.0.1:{PORT}/')",
    "import socket\nsocket.getaddrinfo('localhost', PORT)",
    "import socket\nsocket.socket(socket.AF_UNIX).connect('/tmp/megacispo-sandbox-test.sock')",
])
def test_network_is_refused(code: str) -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.setblocking(False)
        port = server.getsockname()[1]
        _hostile(f"PORT = {port}\n{code}", "refused")
        with pytest.raises(BlockingIOError):
            server.accept()  # nobody connected


@pytest.mark.parametrize("code", [
    "import ctypes\nctypes.CDLL(None)",
    "from ctypes import pythonapi",
    "import sys\ndel sys.modules['ctypes']\nimport ctypes",
    "import _ctypes",
    "import glob, importlib.util\n"
    "path = glob.glob(os.path.dirname(os.__file__) + '/lib-dynload/_ctypes.*')[0]\n"
    "importlib.util.module_from_spec(importlib.util.spec_from_file_location('x._ctypes', path))",
    "import sys\nopen('evil.cpython-311-x86_64-linux-gnu.so', 'wb').write(b'\\x7fELF')\n"
    "sys.path.insert(0, '.')\nimport evil",  # native code written into the working directory
    "import gc\ngc.get_objects()",
    "try:\n    open('/etc/passwd')\nexcept PermissionError as error:\n    tb = error.__traceback__\n"
    "    while tb.tb_next:\n        tb = tb.tb_next\n    resolve = tb.tb_frame.f_locals['resolve']\n"
    "    resolve.__defaults__ = (('',),) + resolve.__defaults__[1:]",  # the guard's helper, from its frame
])
def test_ctypes_and_guard_bypasses_are_refused(code: str) -> None:
    _hostile(code, "refused")


def test_a_caught_refusal_is_not_fatal() -> None:
    result = run_python("try:\n    open('/etc/passwd')\nexcept PermissionError as error:\n    print('no:', error)")
    assert result.status == "ok" and result.stdout.startswith("no: open of '/etc/passwd' is not allowed")


def test_guard_reads_no_global_names() -> None:
    config = {"workdir": "/tmp/w", "read_roots": [sys.prefix], "native_roots": [], "denied_modules": ["_ctypes"]}
    hook = _make_guard(config, PermissionError, ImportError)
    resolve = hook.__defaults__[0]
    for function in (hook, resolve):
        loads = {instruction.opname for instruction in dis.get_instructions(function)}
        assert not loads & {"LOAD_GLOBAL", "LOAD_NAME", "LOAD_DEREF", "LOAD_CLASSDEREF"}, function.__name__
        assert function.__closure__ is None
    assert resolve("a/./b//c") == "/tmp/w/a/b/c" and resolve("a/../b") == "/tmp/w/b" and resolve(3) == ""
    assert resolve("../w/x") is None and resolve("/usr/../etc") is None and resolve(b"/etc") == "/etc"
    hook("open", ("/tmp/w/x", "w", os.O_WRONLY))
    with pytest.raises(PermissionError):
        hook("open", ("/tmp/x", "r", 0))


@pytest.mark.parametrize("field, value", [("cpu_s", 0), ("wall_s", -1.0), ("memory_mb", 1.5),
                                          ("max_output_chars", True)])
def test_limits_are_checked(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"SandboxLimits.{field} = "):
        SandboxLimits(**{field: value})
