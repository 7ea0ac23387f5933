"""Run a function in N real processes on one machine, the way torchrun would, and collect the results.

A test harness: the tests compare every parallel feature with the single-process result in real gloo
processes, and the CPU benchmarks measure in fresh processes with it (both import it as
megacispo.testing.harness). Each worker sees torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT), so the function under test starts distributed exactly as an entry point
does. A worker that raises fails the whole run with that rank's traceback; a run
that does not finish in time is killed, never left hanging.

Workers are forked from a server process (multiprocessing's forkserver) that has imported
Megatron-Core and megacispo once: a freshly spawned worker spends about 10 s of CPU on those
imports alone, so a test suite of many short parallel runs spent most of its time importing. The
server never computes, so no thread pool is forked; each worker gets the caller's environment,
sys.path and main module as they are at the call, as a spawned one would.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import time
import traceback
from typing import Any, Callable

import torch
import torch.multiprocessing as mp

from megacispo.parallel.layout import find_free_port

# What the forkserver imports before forking the first worker; a module missing here is imported by
# the workers that need it, as before.
_PRELOAD = ["megatron.core", "megacispo.rl.trainer"]
_CONTEXT = mp.get_context("forkserver")
_CONTEXT.set_forkserver_preload(_PRELOAD)


def _worker(rank: int, world_size: int, port: int, environment: dict[str, str], fn: Callable, args: tuple,
            kwargs: dict, results) -> None:
    # The forkserver's environment is the caller's when the server started, not now.
    os.environ.clear()
    os.environ.update(environment)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    # N processes share the machine's cores: without this each one starts a thread per core.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    try:
        # Serialized here because a tensor sent through the queue as shared memory is lost when
        # this process exits before the parent has read it.
        buffer = io.BytesIO()
        torch.save(fn(*args, **kwargs), buffer)
        results.put((rank, True, buffer.getvalue()))
    except BaseException:  # noqa: BLE001 - the traceback travels to the parent, which re-raises
        results.put((rank, False, traceback.format_exc()))
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout_s: float = 300.0, **kwargs: Any) -> list:
    """Run ``fn(*args, **kwargs)`` in ``world_size`` new processes; return the results by rank.

    ``fn`` must be importable by name (a module-level function) and its result picklable. The
    process group is not initialized here: ``fn`` does that as an entry point would.
    """
    results = _CONTEXT.SimpleQueue()
    port = find_free_port()
    environment = dict(os.environ)
    procs = [
        _CONTEXT.Process(target=_worker, args=(rank, world_size, port, environment, fn, args, kwargs, results))
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    outputs: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(outputs) < world_size:
            if not results.empty():
                rank, ok, value = results.get()
                if not ok:
                    raise RuntimeError(f"rank {rank} of {world_size} failed:\n{value}")
                outputs[rank] = torch.load(io.BytesIO(value), weights_only=False)
                continue
            dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in outputs]
            if dead:
                raise RuntimeError(f"rank {dead[0]} of {world_size} died with exit code {procs[dead[0]].exitcode}")
            if time.monotonic() > deadline:
                missing = sorted(set(range(world_size)) - set(outputs))
                raise TimeoutError(f"ranks {missing} of {world_size} did not finish within {timeout_s:.0f} s")
            time.sleep(0.05)
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
    return [outputs[rank] for rank in range(world_size)]


def run_entry_point(module: str, argv: list[str]) -> dict:
    """The entry point ``module``'s main(argv) in this process (a worker): its exit code and what it
    printed, as {"code", "out", "err"}."""
    return run_main(importlib.import_module(module).main, argv)


def run_main(main: Callable[[list[str]], int | None], argv: list[str]) -> dict:
    """``main(argv)`` in this process with its output captured: its exit code (a SystemExit's too)
    and what it printed, as {"code", "out", "err"}."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exit_:
            code = exit_.code
    return {"code": code, "out": out.getvalue(), "err": err.getvalue()}
