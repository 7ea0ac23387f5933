"""A sandboxed Python runner for model-written code (the built-in tool environment's ``python`` tool).

``run_python(code, limits)`` runs ``code`` in a fresh interpreter (``sys.executable -I -B -u``) in its
own session, with an almost empty environment, in a new temporary working directory that is deleted
afterwards; the code goes in as ``main.py`` in that directory, never on the command line.

Threat model: the code is written by a model under training, which may be wrong, wasteful or reward
hacking: looping, forking, exhausting memory, reading the run's files (checkpoints, data, answers),
writing outside its directory, opening sockets, or killing the trainer. Two layers stand against it.

Hard limits, enforced by the kernel and the parent, whatever the child does:
  - CPU seconds (RLIMIT_CPU, soft = hard, so the kernel SIGKILLs), address space (RLIMIT_AS: big
    allocations fail at once with MemoryError), file size (RLIMIT_FSIZE), no core dumps;
  - wall clock: past ``wall_s`` the parent SIGKILLs the child's whole process group, and it kills the
    group again when the child ends, so nothing it started outlives it; output is read as it comes
    and capped (head and tail kept), so a flood cannot fill the parent's memory; a child whose parent
    has ended (a run that exits mid-call) ends itself within 0.2 s;
  - where ``unshare --net`` works (root with CAP_SYS_ADMIN), an empty network namespace; in an
    ordinary container it fails and the child runs without it.

A Python-level guard: an audit hook (``sys.addaudithook``), installed before the code runs, refuses
(PermissionError; ImportError for imports, so optional-import fallbacks work; status "refused" when one
ends the code, stderr says what) processes and signals (os.fork, os.exec*, os.system, os.posix_spawn,
subprocess.Popen, os.kill); the network (socket.connect/bind/sendto, DNS, sockets other than AF_UNIX,
which asyncio's self-pipe needs); native code other than the standard library's and ``NATIVE_PACKAGES``
(``DENIED_MODULES``: _ctypes, _posixsubprocess, sqlite3, subinterpreters, the test modules; ``import
ctypes`` gives a stand-in with C type sizes only, which sympy reads); reading outside the working
directory except Python's own installation (so imports work; no directory there can be opened, so no
dir_fd points outside); writing, renaming, removing, chmod or mkdir outside the working directory and
chdir out of it; symlinks and hard links; raising rlimits; gc introspection. Paths are checked as text
after the call has converted them (str subclasses are copied first; other path types are refused), and
".." may not climb out of the working directory. The hook reads no global name (all it uses is bound as
default arguments), so rebinding builtins or modules does not sway it. Functions with no audit event in
3.11 (``DISARMED``: os.mknod, os.chroot, os.pidfd_open, signal.pidfd_send_signal, time.clock_settime,
_posixsubprocess.fork_exec, and _imp.create_builtin, which could make fresh copies of those modules) are
replaced by refusing stubs.

Not covered: audit hooks are not a security boundary. Forged bytecode (marshal.loads of crafted data)
and interpreter bugs can defeat any in-process guard, leaving only the hard limits. Metadata stays
visible (os.stat of any path), the disk can be filled with many files up to the size limit each until
the run ends, and the network namespace needs privileges an ordinary container lacks. For untrusted
production use, run this inside a container or VM that has no access to the run's files.
"""

from __future__ import annotations

import functools
import inspect
import json
import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from typing import Callable

STATUSES = ("ok", "error", "timeout", "cpu_limit", "memory", "refused", "killed")
"""The values of SandboxResult.status."""

NATIVE_PACKAGES = ("numpy",)
"""Third-party packages whose extension modules may load; others (torch, safetensors, ...) read and write
files in native code that no audit hook sees, so their native imports are refused (ImportError)."""

DENIED_MODULES = frozenset({
    "_ctypes", "_ctypes_test", "_posixsubprocess", "_posixshmem", "_multiprocessing", "_sqlite3", "_dbm",
    "_gdbm", "_xxsubinterpreters", "_xxinterpchannels", "_xxtestfuzz", "_testcapi", "_testinternalcapi",
    "_testbuffer", "_testclinic", "_testimportmultiple", "_testmultiphase", "_testsinglephase", "xxlimited",
    "xxlimited_35", "_tkinter", "_curses", "_curses_panel", "readline", "nis", "spwd", "syslog", "ossaudiodev"})
"""Modules the child may not import (by last dotted component): raw memory and foreign calls, process
creation or shared memory without audit events, native file access (sqlite ATTACH, dbm), subinterpreters
(which have no audit hooks of their own), and the interpreter's test modules."""

DISARMED = {
    "posix": ("mknod", "chroot", "pidfd_open", "sched_setscheduler", "sched_setparam"),
    "os": ("mknod", "chroot", "pidfd_open", "sched_setscheduler", "sched_setparam"),
    "_signal": ("pidfd_send_signal",),
    "signal": ("pidfd_send_signal",),
    "time": ("clock_settime", "clock_settime_ns"),
    "_posixsubprocess": ("fork_exec",),
    "_imp": ("create_builtin",),
}
"""Functions with no audit event in 3.11, replaced by refusing stubs in the child (module -> names)."""

_EXIT_REFUSED = 97
"""The child's exit status when a refusal of the guard ended the code (anywhere in the exception chain)."""
_EXIT_MEMORY = 98
"""The child's exit status when a MemoryError ended the code."""
_REAP_S = 5.0
"""How long the parent waits for the child to vanish after SIGKILL before it gives up."""


@dataclass(frozen=True)
class SandboxLimits:
    """The limits of one sandboxed run."""

    cpu_s: float = 2.0
    """CPU seconds (RLIMIT_CPU, rounded up to whole seconds); the kernel kills the child past it."""
    wall_s: float = 5.0
    """Wall-clock seconds; past it the child's whole process group is SIGKILLed."""
    memory_mb: int = 256
    """Address space of the child in MiB (RLIMIT_AS); allocations past it raise MemoryError."""
    max_output_chars: int = 2000
    """Characters of stdout and of stderr kept (the first and last halves; the middle is cut, marked)."""
    file_size_mb: int = 16
    """Largest file the child may write, in MiB (RLIMIT_FSIZE)."""

    def __post_init__(self) -> None:
        for name, kinds in (("cpu_s", (int, float)), ("wall_s", (int, float)), ("memory_mb", int),
                            ("max_output_chars", int), ("file_size_mb", int)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, kinds) or not value > 0:
                kind = "int" if kinds is int else "number"
                raise ValueError(f"SandboxLimits.{name} = {value!r}: give a positive {kind}")


@dataclass(frozen=True)
class SandboxResult:
    """What one sandboxed run did."""

    status: str
    """One of STATUSES: "ok" (exit 0), "error" (nonzero exit, an exception), "timeout" (wall clock),
    "cpu_limit", "memory", "refused" (the guard refused an operation), "killed" (another signal)."""
    stdout: str
    """The child's standard output, capped at max_output_chars (the cut is marked)."""
    stderr: str
    """The child's standard error (tracebacks, what was refused), capped the same way."""
    returncode: int
    """The child's exit status; -N when signal N ended it."""
    wall_s: float
    """Seconds from start to the child's end."""


def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run ``code`` in a fresh sandboxed interpreter (see the module docstring) and say what happened."""
    workdir = os.path.realpath(tempfile.mkdtemp(prefix="megacispo-sandbox-"))
    try:
        with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8") as file:
            file.write(code)
        start = time.monotonic()
        process = subprocess.Popen(_command(workdir, limits), cwd=workdir, env=_environment(workdir),
                                   stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   start_new_session=True)
        try:
            stdout, stderr, timed_out = _collect(process, limits)
        finally:
            _kill_group(process.pid)
            process.stdout.close()
            process.stderr.close()
            returncode, cpu_s = _reap(process)
        wall_s = time.monotonic() - start
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return SandboxResult(_status(returncode, timed_out, cpu_s, limits), stdout, stderr, returncode, wall_s)


def _status(returncode: int, timed_out: bool, cpu_s: float, limits: SandboxLimits) -> str:
    if timed_out:
        return "timeout"
    if returncode == _EXIT_REFUSED:
        return "refused"
    if returncode == _EXIT_MEMORY:
        return "memory"
    if returncode < 0:
        # RLIMIT_CPU with soft = hard ends in SIGKILL: the CPU time used tells it from other kills
        return "cpu_limit" if cpu_s >= math.ceil(limits.cpu_s) - 0.05 else "killed"
    return "ok" if returncode == 0 else "error"


def _command(workdir: str, limits: SandboxLimits) -> list[str]:
    paths = sysconfig.get_paths()
    read_roots = [paths[name] for name in ("stdlib", "platstdlib", "purelib", "platlib")]
    native_roots = [sysconfig.get_config_var("DESTSHARED")] + [
        os.path.join(paths[name], package) for name in ("purelib", "platlib") for package in NATIVE_PACKAGES]
    config = {
        "workdir": workdir,
        "read_roots": _with_realpaths(read_roots),
        "native_roots": _with_realpaths(native_roots),
        "denied_modules": sorted(DENIED_MODULES),
        "disarmed": DISARMED,
        "rlimits": {"RLIMIT_CPU": math.ceil(limits.cpu_s), "RLIMIT_AS": limits.memory_mb << 20,
                    "RLIMIT_FSIZE": limits.file_size_mb << 20, "RLIMIT_CORE": 0},
        "exit_refused": _EXIT_REFUSED,
        "exit_memory": _EXIT_MEMORY,
        "parent_pid": os.getpid(),
    }
    return [*_network_isolation(), sys.executable, "-I", "-B", "-u", "-c", _child_source(), json.dumps(config)]


def _with_realpaths(paths: list[str]) -> list[str]:
    return sorted({os.path.abspath(path) for path in paths} | {os.path.realpath(path) for path in paths})


def _environment(workdir: str) -> dict[str, str]:
    # HOME and TMPDIR keep Python's defaults (tempfile, ~) inside the working directory; one BLAS thread
    # keeps numpy's per-thread buffers inside the address-space limit.
    return {"HOME": workdir, "TMPDIR": workdir, "LC_ALL": "C.UTF-8", "OPENBLAS_NUM_THREADS": "1",
            "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


@functools.lru_cache(maxsize=None)
def _network_isolation() -> tuple[str, ...]:
    """``unshare --net --`` where this machine allows a new network namespace, else nothing."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return ()
    try:
        works = subprocess.run([unshare, "--net", "true"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, timeout=10).returncode == 0
    except subprocess.TimeoutExpired:
        works = False
    return (unshare, "--net", "--") if works else ()


@functools.lru_cache(maxsize=None)
def _child_source() -> str:
    """The child's bootstrap: the functions below as written here, then the call of _child_main."""
    functions = (_make_guard, _ctypes_stand_in, _child_main)
    return "\n".join(inspect.getsource(function) for function in functions) + "\n_child_main()\n"


class _Capture:
    """The first and last bytes of a stream (2 * max_chars bytes of each, at least max_chars / 2 characters)."""

    def __init__(self, max_chars: int) -> None:
        self.max_chars = max_chars
        self.budget = 2 * max_chars
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def add(self, data: bytes) -> None:
        self.total += len(data)
        room = max(self.budget - len(self.head), 0)
        self.head += data[:room]
        self.tail += data[room:]
        del self.tail[:-self.budget]

    def text(self) -> str:
        if self.total == len(self.head) + len(self.tail):  # nothing dropped yet
            head = tail = (self.head + self.tail).decode("utf-8", errors="replace")
            if len(head) <= self.max_chars:
                return head
        else:
            head, tail = self.head.decode("utf-8", errors="replace"), self.tail.decode("utf-8", errors="replace")
        keep_head = self.max_chars // 2
        keep_tail = self.max_chars - keep_head
        return (f"{head[:keep_head]}\n[... output cut: {self.total} bytes in all, the first {keep_head} and last "
                f"{keep_tail} characters kept ...]\n{tail[len(tail) - keep_tail:]}")


def _collect(process: subprocess.Popen, limits: SandboxLimits) -> tuple[str, str, bool]:
    """The child's capped stdout and stderr, read until it exits or the wall clock runs out (then killed)."""
    deadline = time.monotonic() + limits.wall_s
    captures = {process.stdout: _Capture(limits.max_output_chars), process.stderr: _Capture(limits.max_output_chars)}
    timed_out = False
    with selectors.DefaultSelector() as selector:
        for stream in captures:
            selector.register(stream, selectors.EVENT_READ)
        while not _exited(process.pid):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            _read(selector, captures, min(remaining, 0.05 if selector.get_map() else 0.005))
        # The child is gone (a zombie holds its group id) or past its time: kill what it left behind, then
        # read what is still in the pipes (bounded, in case something escaped the group and holds them).
        _kill_group(process.pid)
        drain_deadline = time.monotonic() + 1.0
        while selector.get_map() and time.monotonic() < drain_deadline:
            _read(selector, captures, 0.05)
    return captures[process.stdout].text(), captures[process.stderr].text(), timed_out


def _read(selector: selectors.BaseSelector, captures: dict, timeout: float) -> None:
    for key, _ in selector.select(timeout):
        data = os.read(key.fd, 1 << 16)
        if data:
            captures[key.fileobj].add(data)
        else:
            selector.unregister(key.fileobj)


def _exited(pid: int) -> bool:
    # WNOWAIT leaves the child a zombie, so its pid and group id cannot be reused before _kill_group
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _reap(process: subprocess.Popen) -> tuple[int, float]:
    """The child's exit status and CPU seconds (os.wait4 gives its rusage, Popen.wait does not)."""
    deadline = time.monotonic() + _REAP_S
    while True:
        pid, status, rusage = os.wait4(process.pid, os.WNOHANG)
        if pid:
            process.returncode = os.waitstatus_to_exitcode(status)
            return process.returncode, rusage.ru_utime + rusage.ru_stime
        if time.monotonic() > deadline:
            raise RuntimeError(f"the sandboxed child (pid {process.pid}) did not exit within {_REAP_S} s of SIGKILL")
        time.sleep(0.005)


# Everything below runs in the child (shipped as source by _child_source), so it imports what it uses.
def _make_guard(config: dict, refusal: type, import_refusal: type) -> "Callable[[str, tuple], None]":
    """The audit hook: raises ``refusal`` (``import_refusal`` for imports) for what the sandbox forbids.

    The hook and its helper read no global name: all they use is bound as default arguments, so the user's
    code cannot sway them by rebinding builtins or modules. Paths are normalized textually (the working
    directory holds no symlinks: the hook refuses making them), relative to the working directory.
    """
    import posix

    workdir = config["workdir"]

    def resolve(value, workdir_parts=tuple(workdir.split("/")[1:]), type=type, issubclass=issubclass, len=len,
                str=str, bytes=bytes, int=int, as_text=str.__str__, decode=bytes.decode):
        """A path argument as a normalized absolute str; "" for an fd; None where it cannot be checked: a
        path-like object, or ".." that climbs out of the working directory or through a directory outside it
        (a symlink there would make the text lie)."""
        if issubclass(type(value), int):
            return ""
        if issubclass(type(value), str):
            text = as_text(value)  # an exact copy: a str subclass cannot answer differently later
        elif issubclass(type(value), bytes):
            text = decode(value, "utf-8", "surrogateescape")
        else:
            return None
        parts = [] if text.startswith("/") else [*workdir_parts]
        base = len(workdir_parts)
        for part in text.split("/"):
            if part == "..":
                if len(parts) <= base or parts[:base] != [*workdir_parts]:
                    return None
                parts.pop()
            elif part and part != ".":
                parts.append(part)
        return "/" + "/".join(parts)

    def hook(event, args, resolve=resolve, stat=posix.stat, workdir=workdir, workdir_slash=workdir + "/",
             read_roots=tuple(root + "/" for root in config["read_roots"]),
             native_roots=tuple(root + "/" for root in config["native_roots"]),
             denied_modules=frozenset(config["denied_modules"]),
             refused_events=frozenset({
                 "os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "subprocess.Popen",
                 "pty.spawn", "os.kill", "os.killpg", "signal.pthread_kill", "os.symlink", "os.link",
                 "socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg", "socket.getaddrinfo",
                 "socket.gethostbyname", "socket.gethostbyaddr", "socket.getnameinfo", "socket.getservbyname",
                 "socket.getservbyport", "socket.sethostname", "resource.setrlimit", "resource.prlimit",
                 "gc.get_objects", "gc.get_referrers", "gc.get_referents", "fcntl.ioctl",
                 "cpython.PyInterpreterState_New"}),
             write_events=frozenset({"os.mkdir", "os.rmdir", "os.remove", "os.rename", "os.chmod", "os.chown",
                                     "os.utime", "os.truncate", "os.setxattr", "os.removexattr", "os.chdir"}),
             read_events=frozenset({"os.listdir", "os.scandir", "os.getxattr", "os.listxattr"}),
             fd_refused=frozenset({"os.chmod", "os.chown", "os.utime", "os.setxattr", "os.removexattr"}),
             write_flags=posix.O_WRONLY | posix.O_RDWR | posix.O_CREAT | posix.O_TRUNC | posix.O_APPEND,
             refusal=refusal, import_refusal=import_refusal, type=type, issubclass=issubclass, str=str,
             as_text=str.__str__, OSError=OSError):
        if event in refused_events or event.startswith("ctypes."):
            raise refusal(f"{event} is not allowed in the sandbox: it runs Python alone, without processes, "
                          "signals, network, ctypes or interpreter introspection")
        if event == "import":
            module = as_text(args[0]) if issubclass(type(args[0]), str) else "?"
            if module.rpartition(".")[2] in denied_modules:
                raise import_refusal(f"import of {module} is not allowed in the sandbox")
            if args[1] is not None:  # an extension module: native code
                origin = resolve(args[1])
                if not origin or not (origin + "/").startswith(native_roots):
                    raise import_refusal(f"loading the extension module {module} from {origin!r} is not allowed "
                                         "in the sandbox (only the standard library's and numpy's)")
            return
        if event == "socket.__new__":
            if args[1] != 1:  # AF_UNIX alone: connect, bind and sendto are refused anyway
                raise refusal("socket.__new__ is not allowed in the sandbox: it has no network")
            return
        if event == "object.__setattr__":
            if args[0] is resolve:  # its defaults hold the working directory; it is in tracebacks' frames
                raise refusal("changing the sandbox's guard is not allowed")
            return
        if event == "open":
            mode = args[1] if issubclass(type(args[1]), str) else ""
            writing = args[2] & write_flags or "w" in mode or "a" in mode or "x" in mode or "+" in mode
            targets = args[:1]
        elif event in write_events:
            writing = True
            targets = args[:2] if event == "os.rename" else args[:1]
        elif event in read_events:
            writing = False
            targets = args[:1]
        else:
            return
        for value in targets:
            if value is None:  # os.listdir() and os.scandir() of the current directory, inside the working one
                continue
            path = resolve(value)
            if path == "":
                if event in fd_refused:
                    raise refusal(f"{event} on a file descriptor is not allowed in the sandbox: pass a str path "
                                  "inside the working directory")
                continue
            if path is None and issubclass(type(value), str):
                raise refusal(f"{event} of {as_text(value)!r} is not allowed in the sandbox: '..' may not climb out "
                              "of the working directory, nor through a directory outside it")
            if path is None:
                raise refusal(f"{event} of a {type(value).__name__} path is not allowed in the sandbox: pass a str")
            # The working directory itself: readable, and open (O_TMPFILE) and chdir may name it, but it may not be
            # removed, renamed or changed.
            if path == "/dev/null" or path.startswith(workdir_slash) or (
                    path == workdir and (not writing or event == "open" or event == "os.chdir")):
                continue
            if writing:
                raise refusal(f"{event} of {path!r} is not allowed in the sandbox: it writes outside the "
                              f"working directory {workdir}")
            if not (path + "/").startswith(read_roots):
                raise refusal(f"{event} of {path!r} is not allowed in the sandbox: it reads outside the working "
                              "directory (only Python's own installation is readable)")
            if event == "open":
                try:
                    is_directory = stat(path).st_mode & 0o170000 == 0o040000
                except OSError:
                    is_directory = False
                if is_directory:
                    raise refusal(f"opening the directory {path!r} is not allowed in the sandbox: it lies outside "
                                  "the working directory")

    return hook


def _ctypes_stand_in(refusal: type, import_refusal: type) -> object:
    """A module that answers ``sizeof`` of the simple C types (sympy reads sizeof(c_long) at import) and refuses
    everything else, in place of ctypes, whose raw memory access would undo the guard."""
    import struct
    import types

    class CType:
        def __new__(cls, *args: object, **kwargs: object) -> None:
            raise refusal(f"ctypes.{cls.__name__} objects cannot be made in the sandbox (its ctypes only gives C "
                          "type sizes)")

    def missing(name: str) -> None:
        if name.startswith("__"):  # the import system probes __path__ and the like
            raise AttributeError(name)
        raise import_refusal(f"ctypes.{name} is not available in the sandbox (its ctypes only gives C type sizes)")

    ctypes = types.ModuleType("ctypes", "A sandbox stand-in for ctypes: C type sizes only.")
    for code, name in (("b", "c_byte"), ("B", "c_ubyte"), ("h", "c_short"), ("H", "c_ushort"), ("i", "c_int"),
                       ("I", "c_uint"), ("l", "c_long"), ("L", "c_ulong"), ("q", "c_longlong"),
                       ("Q", "c_ulonglong"), ("n", "c_ssize_t"), ("N", "c_size_t"), ("f", "c_float"),
                       ("d", "c_double"), ("P", "c_void_p")):
        setattr(ctypes, name, type(name, (CType,), {"_type_": code, "__module__": "ctypes"}))
    ctypes.sizeof = lambda ctype: struct.calcsize(ctype._type_)
    ctypes.__getattr__ = missing
    return ctypes


def _child_main() -> None:
    """The sandboxed process: set the limits, disarm what has no audit event, install the guard, run main.py."""
    import builtins
    import json
    import os
    import resource
    import sys
    import threading
    import time
    import traceback
    import types

    config = json.loads(sys.argv[1])
    for name, value in config["rlimits"].items():
        resource.setrlimit(getattr(resource, name), (value, value))

    def watch_parent(parent=config["parent_pid"], parent_now=os.getppid, sleep=time.sleep, end=os._exit) -> None:
        # The wall clock is the parent's: a parent that ends mid-call (a trainer that exits or is killed, the
        # thread of a late environment call with it) leaves the child to its session, where a sleep would
        # never end. Polled, as a thread of the child; its functions bound now, out of the code's reach.
        while parent_now() == parent:
            sleep(0.2)
        end(1)

    threading.Thread(target=watch_parent, daemon=True, name="sandbox-parent-watch").start()
    for name in sys.builtin_module_names:  # all of them now, so no fresh one is needed once create_builtin is gone
        __import__(name)

    class SandboxRefusal(PermissionError):
        __qualname__ = "SandboxRefusal"

    class SandboxImportRefusal(ImportError):
        __qualname__ = "SandboxImportRefusal"

    def disarmed(name: str) -> "Callable[..., None]":
        def refuse(*args: object, **kwargs: object) -> None:
            raise SandboxRefusal(f"{name}() is not allowed in the sandbox")
        return refuse

    for module_name, names in config["disarmed"].items():
        module = __import__(module_name)
        for name in names:
            if hasattr(module, name):  # some are missing on older kernels or libcs
                setattr(module, name, disarmed(f"{module_name}.{name}"))
    sys.modules["ctypes"] = _ctypes_stand_in(SandboxRefusal, SandboxImportRefusal)
    with open("main.py", encoding="utf-8") as file:
        source = file.read()
    main = types.ModuleType("__main__")
    main.__file__ = "main.py"
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    # bound now: the report below must not depend on builtins that the user's code may rebind
    report, is_instance, system_exit, memory_error = traceback.print_exception, isinstance, SystemExit, MemoryError
    refusals = (SandboxRefusal, SandboxImportRefusal)
    sys.addaudithook(_make_guard(config, SandboxRefusal, SandboxImportRefusal))
    try:
        exec(compile(source, "main.py", "exec"), main.__dict__)
    except system_exit:
        raise
    except BaseException as error:
        exit_status, cause = 1, error
        for _ in range(100):  # the chain, in case a library turned the refusal into its own error
            if cause is None:
                break
            if is_instance(cause, refusals):
                exit_status = config["exit_refused"]
                break
            if is_instance(cause, memory_error):
                exit_status = config["exit_memory"]
            cause = cause.__cause__ or cause.__context__
        try:
            report(type(error), error, error.__traceback__.tb_next)
        except BaseException:
            sys.__stderr__.write(f"{type(error).__name__}: {error}\n")
        raise system_exit(exit_status) from None
