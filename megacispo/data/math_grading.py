"""Whether two math answers are equal, decided by math-verify in a worker process that can be killed.

math-verify (Hugging Face) parses LaTeX into sympy and compares mathematically: ``\\dfrac{1}{2}``,
``0.5`` and ``1/2`` are one answer; ``1,000`` is 1000; ``\\left(1, \\sqrt{2}\\right)`` is the open
interval (1, sqrt 2); ``30^\\circ``, ``5\\text{ cm}``, ``\\text{yes}`` lose their units and
wrappers; floats equal exact values to 6 decimal places. Its own time limits are ``signal.alarm``
calls, which cannot stop C code: comparing ``9^{9^{9}}`` with 3 makes sympy build a 370-million-digit
integer inside one bignum call, and no signal reaches Python until it returns (still running after
30 s here). So the comparison runs in a child process: the caller waits ``ANSWER_TIMEOUT_S`` for
its verdict and kills it when it is late (SIGKILL stops C code too); the answer counts as not equal
and a fresh worker starts at once.

The worker imports math-verify and of megacispo only megacispo.lifeline (no torch), so it starts in
about a second.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import resource
import select
import signal
import subprocess
import sys
import threading
from pathlib import Path

from megacispo.lifeline import die_with_parent

logger = logging.getLogger(__name__)

ANSWER_TIMEOUT_S = 2.0
"""The most one comparison may take. math-verify needs 1 to 500 ms for real answers (measured on a
loaded 2-core machine); the margin keeps a slow machine from scoring a right answer 0."""
STARTUP_TIMEOUT_S = 120.0
"""The most a worker may take to import math-verify and warm up."""
WORKER_CPU_LIMIT_S = 30
"""CPU seconds one comparison may use before the kernel stops the worker (SIGXCPU). The caller kills
it long before; this only stops an orphan whose caller died in the middle of a comparison."""

_READY = b"ready\n"
_EQUAL, _NOT_EQUAL = b"1\n", b"0\n"
_LOG_TRUNCATE_CHARS = 200


# ---------------------------------------------------------------------------------------------
# The worker
# ---------------------------------------------------------------------------------------------


def answers_match(predicted: str, reference: str) -> bool:
    """Whether ``predicted`` equals ``reference`` mathematically (both LaTeX, unboxed), with no time
    limit: call it only in the worker (``math_equal`` is the guarded way)."""
    from math_verify import LatexExtractionConfig, parse, verify

    # Each answer is boxed so math-verify reads the whole of it as one expression. Its own timeouts are
    # off (None): their SIGALRM could not stop C code, and this process is killed instead.
    extraction = [LatexExtractionConfig(boxed_match_priority=0)]
    gold, target = (
        # A full stop written inside the box ("\boxed{42.}") ends the sentence, not the number.
        parse(f"\\boxed{{{answer.strip().removesuffix('.')}}}", extraction, parsing_timeout=None)
        for answer in (reference, predicted)
    )
    return verify(gold, target, timeout_seconds=None)


def _limit_cpu() -> None:
    used = resource.getrusage(resource.RUSAGE_SELF)
    soft = int(used.ru_utime + used.ru_stime) + WORKER_CPU_LIMIT_S
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))


def serve() -> None:
    """The worker: one JSON line ``[predicted, reference]`` in on stdin, one verdict line out."""
    die_with_parent(int(sys.argv[1]))
    # math-verify warns once that its timeouts are off: they are, on purpose (see answers_match).
    for name in ("math_verify", "latex2sympy2_extended"):
        logging.getLogger(name).setLevel(logging.ERROR)
    # Ctrl-C and torchrun's SIGTERM reach the whole process group; the parent decides when this worker
    # ends (stdin closes, or it is killed), after its own orderly stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "wb", buffering=0)
    # Whatever a library prints goes to stderr, never into the replies.
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    # The first comparison of a kind imports sympy's solvers and sets (up to a second): paid here.
    answers_match("\\frac{1}{2}", "(1, \\sqrt{2}]")
    replies.write(_READY)
    for line in sys.stdin.buffer:
        predicted, reference = json.loads(line)
        _limit_cpu()
        replies.write(_EQUAL if answers_match(predicted, reference) else _NOT_EQUAL)


# ---------------------------------------------------------------------------------------------
# The caller's side
# ---------------------------------------------------------------------------------------------


def _truncate(text: str) -> str:
    if len(text) <= _LOG_TRUNCATE_CHARS:
        return repr(text)
    return repr(text[:_LOG_TRUNCATE_CHARS]) + f"... ({len(text)} chars)"


class MathGrader:
    """Verdicts of a math-verify worker process, each within ``timeout_s`` seconds.

    ``MathGrader().equal(predicted, reference)``; thread-safe (one comparison at a time). The worker
    starts on the first call, is replaced after a timeout or a crash, and ends with ``close()``.
    """

    def __init__(self, timeout_s: float = ANSWER_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self._process: subprocess.Popen | None = None
        self._ready = False
        self._lock = threading.Lock()

    def equal(self, predicted: str, reference: str) -> bool:
        """Whether the answers are mathematically equal; False when the worker took over
        ``timeout_s`` or died on them (logged as a warning)."""
        with self._lock:
            process = self._ready_worker()
            process.stdin.write(json.dumps([predicted, reference]).encode() + b"\n")
            process.stdin.flush()
            reply = self._read_line(process, self.timeout_s)
            if reply in (_EQUAL, _NOT_EQUAL):
                return reply == _EQUAL
            why = f"took over {self.timeout_s} s" if reply is None else "crashed (its error is above)"
            logger.warning("math-verify %s comparing %s with the reference %s; scored as not equal",
                           why, _truncate(predicted), _truncate(reference))
            self._stop()
            # Started now, so it imports while the caller does other work.
            self._start()
            return False

    def close(self) -> None:
        with self._lock:
            self._stop()

    def _start(self) -> None:
        package_root = str(Path(__file__).resolve().parents[1])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
        self._process = subprocess.Popen(
            [sys.executable, "-m", "megacispo.data.math_grading", str(os.getpid())], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
        )
        self._ready = False

    def _ready_worker(self) -> subprocess.Popen:
        if self._process is None or self._process.poll() is not None:
            self._start()
        if not self._ready:
            if self._read_line(self._process, STARTUP_TIMEOUT_S) != _READY:
                self._stop()
                raise RuntimeError(
                    f"the math-verify worker ({sys.executable} -m megacispo.data.math_grading) did not start within "
                    f"{STARTUP_TIMEOUT_S:.0f} s (its error is above); check that `pip install "
                    "'math-verify[antlr4_13_2]'` works in this environment"
                )
            self._ready = True
        return self._process

    @staticmethod
    def _read_line(process: subprocess.Popen, timeout_s: float) -> bytes | None:
        """The worker's next line, b"" if it died, None if it wrote none within ``timeout_s``."""
        readable, _, _ = select.select([process.stdout], [], [], timeout_s)
        return process.stdout.readline() if readable else None

    def _stop(self) -> None:
        if self._process is not None:
            stop_worker(self._process)
            self._process = None


def stop_worker(process: subprocess.Popen) -> None:
    """Kill a worker process that talks over its stdin and stdout, and close both."""
    process.kill()
    process.wait()
    process.stdin.close()
    process.stdout.close()


_grader = MathGrader()
atexit.register(_grader.close)


def math_equal(predicted: str, reference: str) -> bool:
    """Whether two answers (LaTeX or plain, unboxed) are mathematically equal, decided by math-verify
    within ``ANSWER_TIMEOUT_S``: one worker process serves the whole process."""
    return _grader.equal(predicted, reference)


if __name__ == "__main__":
    serve()
