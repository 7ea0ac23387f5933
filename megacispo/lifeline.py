"""No process outlives the rank that started it, however the rank ends (kill -9 included).

Two kinds of children, two ties, both Linux's (elsewhere nothing is tied):

- The workers megacispo starts (rewards, math-verify) call ``die_with_parent`` first: the kernel
  SIGKILLs them when their parent dies (PR_SET_PDEATHSIG).
- Libraries start others that cannot be changed: Megatron-Core's checkpoint writer starts a
  ``multiprocessing.Manager()`` process at the first save (``filesystem_async._get_write_results_queue``),
  with multiprocessing's resource tracker. ``start_group_reaper`` starts a small process that SIGKILLs
  the rank's whole process group once the rank has died. It does so only for a rank that leads its
  own session (torchrun starts every rank so, ``start_new_session``): then the group holds nothing but
  the rank's own descendants. A rank started from a shell shares the shell's session and group (a
  ``| tee`` beside it), which the reaper leaves alone.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys

_PR_SET_PDEATHSIG = 1

# The reaper: SIGTERM is for the rank (torchrun signals the whole group, and the rank saves before
# it exits), so the reaper ignores it; the kernel tells it of the rank's death with SIGUSR1.
_REAPER = """
import ctypes, os, signal, sys
rank = int(sys.argv[1])
signal.signal(signal.SIGTERM, signal.SIG_IGN)
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGUSR1, lambda signum, frame: os.killpg(rank, signal.SIGKILL))
ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGUSR1)
if os.getppid() != rank:  # the rank died before the tie was made
    os.killpg(rank, signal.SIGKILL)
while True:
    signal.pause()
"""


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when ``parent_pid``, its parent, dies; at once if it already has."""
    if sys.platform != "linux":
        return
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), signal.SIGKILL)


def start_group_reaper() -> subprocess.Popen | None:
    """The process that SIGKILLs this rank's process group when the rank dies, for a rank that leads
    its own session (None otherwise, and off Linux). Call it once per process, early."""
    if sys.platform != "linux" or os.getsid(0) != os.getpid():
        return None
    return subprocess.Popen([sys.executable, "-I", "-S", "-c", _REAPER, str(os.getpid())],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
