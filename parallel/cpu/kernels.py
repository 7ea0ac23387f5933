"""megacispo's C++ CPU kernels (csrc/ beside this file), compiled at set-up or on first use.

- cpu_gemm.cpp: torch's fp32 CPU products (aten::mm, bmm, addmm, addmm_) replaced at the CPU
  dispatch key by faster kernels for the shapes this project multiplies (few rows, one row per
  batch entry, oneDNN where it takes fp32); its header says which and why.
- cpu_decode.cpp: the few-rows product those use, and the fp32 CPU kernels of the model's decode-step
  ops ``megacispo::decode_experts`` (a MoE layer's routed experts in one call) and
  ``megacispo::rms_norm`` (one call where torch runs eight ops); cpu_gemm.cpp registers them.

torch.utils.cpp_extension builds them with the machine's C++ compiler and ninja, about 15 s on 2
cores (tools/setup_env.sh does it); later calls only load them. Each build has its own directory in
torch's extension cache (TORCH_EXTENSIONS_DIR, by default ~/.cache/torch_extensions), named by a hash
of the sources' contents, the flags, Python's version and torch's version and location
(``build_directory``), and builds copies of the sources kept there: checkouts with the same sources and
the same torch share one build, and a change of any of them builds beside the others, never over them.

A build directory's ``build.flock`` is taken (``fcntl.flock``) around every build and load, so the
operating system releases it when its holder dies, however it dies. torch's own ``lock`` beside it,
which a killed build leaves behind and torch would wait on forever, is therefore stale whenever it is
found under ``build.flock``; it is removed, once the compilers the killed build left running (the
processes working in that directory) have finished. A process that finds ``build.flock`` held waits
for it, saying for what, at most ``BUILD_WAIT_S``.

They need AVX2 and FMA; where they can't be built, or another process's build did not end within
``BUILD_WAIT_S``, torch's own kernels run, more slowly, after one warning that says why.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import shutil
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Callable, Iterator, TextIO

import torch
from torch.utils import cpp_extension

EXTENSION_NAME = "megacispo_cpu_kernels"
_SOURCES = [Path(__file__).with_name("csrc") / name for name in ("cpu_decode.cpp", "cpu_gemm.cpp")]
_CFLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp"]
# torch's own libgomp is loaded first, and this library's libgomp.so.1 resolves to it: one
# OpenMP thread pool, the one torch.set_num_threads sizes.
_LDFLAGS = ["-fopenmp"]
# How long a process waits for another one's build: a build takes about 15 s on 2 idle cores, minutes
# on a loaded machine.
BUILD_WAIT_S = 600.0
_POLL_S = 0.2
_FLOCK_NAME = "build.flock"
# torch.utils.cpp_extension's FileBaton: created before a build, removed after it, with no owner recorded.
_TORCH_LOCK_NAME = "lock"


class BuildWaitTimeout(Exception):
    """Another process's build did not end within the bound; the message says what to do."""


def build_directory(sources: list[Path] = _SOURCES, cflags: list[str] = _CFLAGS,
                    ldflags: list[str] = _LDFLAGS) -> Path:
    """The cache directory of a build of ``sources`` with these flags: ``<root>/megacispo_cpu_kernels-<hash>``,
    root TORCH_EXTENSIONS_DIR or torch's default (~/.cache/torch_extensions), the hash of the sources'
    names and contents (not their paths), the flags, Python's version and torch's version and location."""
    digest = hashlib.sha256()
    for part in (sys.version, torch.__version__, str(Path(torch.__file__).parent), *cflags, "--", *ldflags, "--"):
        digest.update(part.encode() + b"\0")
    for source in sources:
        digest.update(source.name.encode() + b"\0" + source.read_bytes() + b"\0")
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    return Path(root).resolve() / f"{EXTENSION_NAME}-{digest.hexdigest()[:16]}"


@functools.cache
def kernels_available() -> bool:
    """Whether the kernels are loaded; the first call builds or loads them. False, with one warning,
    on a CPU without AVX2, where the build fails, or where another process's build outlasts ``BUILD_WAIT_S``."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        warnings.warn(f"megacispo's CPU kernels need AVX2 and this CPU runs torch at {capability}: "
                      "torch's own CPU kernels run instead.", stacklevel=2)
        return False
    try:
        load_kernels(build_directory(), BUILD_WAIT_S)
    except BuildWaitTimeout as error:
        warnings.warn(f"megacispo's CPU kernels were not loaded: {error}; torch's own CPU kernels run instead, "
                      "more slowly.", stacklevel=2)
        return False
    except (OSError, RuntimeError, subprocess.CalledProcessError) as error:
        warnings.warn(f"megacispo's CPU kernels did not build ({error}); torch's own CPU kernels run instead, "
                      "more slowly. They need a C++ compiler (g++) and ninja (pip install ninja).", stacklevel=2)
        return False
    return True


def load_kernels(directory: Path, wait_s: float) -> None:
    """Build (where ``directory`` holds no current build) and load the kernels there, holding its
    ``build.flock``; a stale torch ``lock`` there is removed first. Waits at most ``wait_s`` for another
    process's build, then raises BuildWaitTimeout."""
    directory.mkdir(parents=True, exist_ok=True)
    with _build_flock(directory, wait_s):
        _remove_stale_torch_lock(directory, wait_s)
        sources = [_copy_source(source, directory / "src") for source in _SOURCES]
        if not (directory / f"{EXTENSION_NAME}.so").exists():
            _say(f"building them in {directory} (about 15 s on 2 cores, once per version of their sources)")
        cpp_extension.load(
            name=EXTENSION_NAME, sources=[str(source) for source in sources], extra_cflags=_CFLAGS,
            extra_ldflags=_LDFLAGS, build_directory=str(directory), is_python_module=False,
        )


@contextlib.contextmanager
def _build_flock(directory: Path, wait_s: float) -> Iterator[None]:
    """Hold ``directory``'s build.flock, which names its holder (process and host) while held."""
    path = directory / _FLOCK_NAME
    with open(path, "a+") as file:
        _wait_until(lambda: _try_flock(file),
                    lambda: f"{_holder(path)}, which is building them in {directory} (it holds {path})", wait_s,
                    lambda: f"{path} is still held by {_holder(path)}: wait for its build to end, end that "
                            f"process, or, if no such process is running, remove {path}")
        file.seek(0)
        file.truncate()
        file.write(f"process {os.getpid()} on {socket.gethostname()}\n")
        file.flush()
        yield


def _try_flock(file: TextIO) -> bool:
    try:
        fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _holder(flock_path: Path) -> str:
    return flock_path.read_text().strip() or "another process"


def _remove_stale_torch_lock(directory: Path, wait_s: float) -> None:
    """Under build.flock a torch ``lock`` is a killed build's. Its ninja and compilers may still be
    running, writing the build's files: they finish first."""
    lock = directory / _TORCH_LOCK_NAME
    if not lock.exists():
        return
    _wait_until(lambda: not _processes_working_in(directory),
                lambda: f"the build processes {_processes_working_in(directory)} that a killed build left "
                        f"running in {directory}", wait_s,
                lambda: f"the build processes {_processes_working_in(directory)} that a killed build left "
                        f"running in {directory} have not ended: end them, and the next run removes {lock}")
    lock.unlink()
    _say(f"removed {lock}, left by a build that was killed mid-way")


def _processes_working_in(directory: Path) -> list[int]:
    """The live processes whose working directory is ``directory`` (torch runs ninja, and ninja the
    compilers, there); none where there is no /proc."""
    proc = Path("/proc")
    if not proc.is_dir():
        return []
    found = []
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):  # ended meanwhile, a zombie, or another user's
            if os.readlink(entry / "cwd") == str(directory):
                found.append(int(entry.name))
    return found


def _wait_until(done: Callable[[], bool], waiting_for: Callable[[], str], wait_s: float,
                on_timeout: Callable[[], str]) -> None:
    """Return once ``done()``, after saying once on stderr what it waits for; BuildWaitTimeout after ``wait_s``."""
    if done():
        return
    _say(f"waiting up to {wait_s:.0f} s for {waiting_for()}")
    deadline = time.monotonic() + wait_s
    while not done():
        if time.monotonic() > deadline:
            raise BuildWaitTimeout(f"gave up after {wait_s:.0f} s: {on_timeout()}")
        time.sleep(_POLL_S)


def _say(message: str) -> None:
    print(f"megacispo's CPU kernels: {message}", file=sys.stderr, flush=True)


def _copy_source(source: Path, into: Path) -> Path:
    """``source`` copied into ``into`` unless the copy is already the same: the build commands name the
    build directory's copies, so they are the same in every checkout that shares the build."""
    copy = into / source.name
    if not copy.exists() or copy.read_bytes() != source.read_bytes():
        into.mkdir(exist_ok=True)
        shutil.copyfile(source, copy)
    return copy


def enable_kernels() -> bool:
    """Put the kernels in torch's dispatch for CPU tensors (once; later calls change nothing but
    what ``disable_products`` took out). Returns whether the dense fp32 products run on oneDNN
    (False on CPUs without AVX-512)."""
    return kernels_available() and torch.ops.megacispo.enable_cpu_kernels()


def disable_products() -> None:
    """torch's own CPU products again (a benchmark's peer runs on them); ``enable_kernels`` restores
    ours. The model ops keep their kernels."""
    if kernels_available():
        torch.ops.megacispo.disable_cpu_products()
