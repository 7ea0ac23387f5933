"""The CPU kernels' build cache (parallel/cpu/kernels.py) never waits on a lock that no live process
holds, and says what it waits for:

- a build killed with SIGKILL mid-way, its compilers left running (what torchrun does to a rank), or
  killed with them (its whole process group, in the slow tier): the next process waits for the
  compilers, removes torch's stale ``lock``, builds and loads the kernels;
- a ``lock`` left with no process behind it is removed at the next load, which then only loads;
- a build directory held by a live process is waited for, with a line naming the holder and the path,
  and a process that gives up says which file to remove and runs torch's own kernels;
- a build's directory is named by the sources' contents and the flags, not by the checkout's path.

Each test builds in its own cache (TORCH_EXTENSIONS_DIR), never in the machine's.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megacispo.parallel.cpu import kernels

REPO = Path(__file__).resolve().parents[2]
# A build takes about 15 s on 2 idle cores; the bound leaves room for a loaded CI machine.
BUILD_TIMEOUT_S = 240
LOAD = "from megacispo.parallel.cpu import kernels; print(kernels.kernels_available())"
GIVE_UP_AFTER_1_S = "from megacispo.parallel.cpu import kernels; kernels.BUILD_WAIT_S = 1; print(kernels.kernels_available())"

pytestmark = pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
                                reason="the kernels need AVX2")


def _environment(cache: Path) -> dict[str, str]:
    return {**os.environ, "TORCH_EXTENSIONS_DIR": str(cache)}


def _load(cache: Path, script: str = LOAD, timeout_s: float = BUILD_TIMEOUT_S) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", script], cwd=REPO, env=_environment(cache), capture_output=True,
                          text=True, timeout=timeout_s)


def _directory(cache: Path) -> Path:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORCH_EXTENSIONS_DIR", str(cache))
        return kernels.build_directory()


def _wait_for(path: Path, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + BUILD_TIMEOUT_S
    while not path.exists():
        assert process.poll() is None, f"the build ended before {path} appeared"
        assert time.monotonic() < deadline, f"{path} did not appear within {BUILD_TIMEOUT_S} s"
        time.sleep(0.05)


def _kill_midway(cache: Path, directory: Path, whole_group: bool) -> None:
    """Start a build and SIGKILL it once its compilers run: the Python process alone (its ninja and
    compilers run on, orphaned), or its whole process group."""
    build = subprocess.Popen([sys.executable, "-c", LOAD], cwd=REPO, env=_environment(cache),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        _wait_for(directory / "lock", build)
        _wait_for(directory / "build.ninja", build)  # written just before ninja starts the compilers
        time.sleep(1.0)
    finally:
        if whole_group:
            with contextlib.suppress(ProcessLookupError):  # the assertion above says why it ended
                os.killpg(build.pid, signal.SIGKILL)
        else:
            build.kill()
        build.wait(timeout=30)
    assert (directory / "lock").exists()


@pytest.fixture(scope="module")
def built_cache(tmp_path_factory) -> tuple[Path, Path, subprocess.CompletedProcess]:
    """A cache whose first build was killed mid-way, its compilers left running, and the run after it."""
    cache = tmp_path_factory.mktemp("cache")
    directory = _directory(cache)
    _kill_midway(cache, directory, whole_group=False)
    return cache, directory, _load(cache)


def test_the_run_after_a_build_killed_midway_waits_for_its_compilers_and_loads(built_cache):
    _, directory, after = built_cache
    assert after.returncode == 0 and after.stdout.strip() == "True", after.stderr[-3000:]
    # The compilers take seconds longer than the next process takes to start.
    assert "megacispo's CPU kernels: waiting up to 600 s for the build processes [" in after.stderr
    assert f"that a killed build left running in {directory}\n" in after.stderr
    assert f"megacispo's CPU kernels: removed {directory / 'lock'}, left by a build that was killed mid-way" in after.stderr
    assert not (directory / "lock").exists()


# Slow tier: it builds the kernels anew (CI's killed-build test waits for the compilers it left running).
@pytest.mark.slow
def test_the_run_after_a_build_killed_with_its_compilers_rebuilds_and_loads(tmp_path):
    directory = _directory(tmp_path)
    _kill_midway(tmp_path, directory, whole_group=True)
    after = _load(tmp_path)
    assert after.returncode == 0 and after.stdout.strip() == "True", after.stderr[-3000:]
    assert f"removed {directory / 'lock'}" in after.stderr
    assert f"megacispo's CPU kernels: building them in {directory}" in after.stderr


def test_a_lock_with_no_process_behind_it_is_removed(built_cache):
    cache, directory, _ = built_cache
    (directory / "lock").touch()
    after = _load(cache, timeout_s=60)
    assert after.returncode == 0 and after.stdout.strip() == "True", after.stderr[-3000:]
    assert f"removed {directory / 'lock'}" in after.stderr and "building" not in after.stderr


def test_a_build_held_by_a_live_process_is_waited_for_and_named(built_cache, tmp_path):
    cache, directory, _ = built_cache
    stderr = tmp_path / "stderr"
    with kernels._build_flock(directory, wait_s=0), stderr.open("w") as stderr_file:
        waiter = subprocess.Popen([sys.executable, "-c", LOAD], cwd=REPO, env=_environment(cache), text=True,
                                  stdout=subprocess.PIPE, stderr=stderr_file)
        try:
            deadline = time.monotonic() + 60
            while "waiting up to" not in stderr.read_text():
                assert waiter.poll() is None, stderr.read_text()
                assert time.monotonic() < deadline, "the waiting process said nothing within 60 s"
                time.sleep(0.05)
        except BaseException:
            waiter.kill()
            raise
    stdout, _ = waiter.communicate(timeout=60)
    assert waiter.returncode == 0 and stdout.strip() == "True", stderr.read_text()[-3000:]
    assert (f"megacispo's CPU kernels: waiting up to 600 s for process {os.getpid()} on "
            in stderr.read_text())
    assert f"which is building them in {directory} (it holds {directory / 'build.flock'})" in stderr.read_text()


def test_a_process_that_gives_up_waiting_says_which_file_to_remove(built_cache):
    cache, directory, _ = built_cache
    with kernels._build_flock(directory, wait_s=0):
        after = _load(cache, GIVE_UP_AFTER_1_S, timeout_s=60)
    assert after.returncode == 0 and after.stdout.strip() == "False", after.stderr[-3000:]
    flock = directory / "build.flock"
    assert (f"megacispo's CPU kernels were not loaded: gave up after 1 s: {flock} is still held by process "
            f"{os.getpid()} on ") in after.stderr
    assert f"if no such process is running, remove {flock}; torch's own CPU kernels run instead" in after.stderr


def test_a_build_directory_is_named_by_the_sources_and_flags_not_their_path(tmp_path, monkeypatch):
    tmp_path = tmp_path.resolve()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "cache"))
    sources = {}
    for checkout, text in (("one", "int x;"), ("two", "int x;"), ("three", "int y;")):
        (tmp_path / checkout).mkdir()
        sources[checkout] = [tmp_path / checkout / "kernel.cpp"]
        sources[checkout][0].write_text(text)
    one = kernels.build_directory(sources["one"])
    assert one.parent == tmp_path / "cache" and one.name.startswith("megacispo_cpu_kernels-")
    assert kernels.build_directory(sources["two"]) == one
    assert kernels.build_directory(sources["three"]) != one
    assert kernels.build_directory(sources["one"], cflags=["-O2"]) != one
    assert kernels.build_directory(sources["one"], ldflags=[]) != one
