"""Reward functions that inject faults, for tests/multiprocess/test_faults.py, test_async_rollout.py,
test_reward_timeout.py and test_reward_deadline.py (loaded by the trainer as
``megacispo.testing.fault_rewards:name``)."""

import os
import signal
import time

import psutil

# Set for the run to preempt: the reward call of rank 0 at which it sends SIGTERM to its launcher
# (torchrun, the ranks' parent), as a cluster's scheduler would.
SIGTERM_AT_CALL = "MEGACISPO_TEST_SIGTERM_AT_CALL"
_calls = 0
_preempted = False


def alternating_until_preempted(response: str, record) -> float:
    """1.0 for every other sample, so that each group (of an even size) holds both rewards: dynamic
    sampling keeps every group, each step takes one rollout round, and each rank makes the same calls
    in every run. At the call SIGTERM_AT_CALL rank 0 sends SIGTERM to its launcher, and from then on
    every sample gets 0.0: dynamic sampling drops every group and draws round after round, up to
    rollout.max_sampling_rounds, so the step in flight outlasts any grace unless it is abandoned."""
    global _calls, _preempted
    _calls += 1
    if os.environ.get("RANK") == "0" and str(_calls) == os.environ.get(SIGTERM_AT_CALL):
        # The reward runs in the rank's reward worker (rl.reward_timeout_s): the launcher is the rank's parent.
        os.kill(psutil.Process(os.getppid()).ppid(), signal.SIGTERM)
        _preempted = True
    return 0.0 if _preempted else float(_calls % 2)


def exit_on_the_rollout_process(response: str, record) -> float:
    """A reward that kills the rollout process (rank 1) at its first call, as a crash would; the
    training process's evaluation scores 0. It runs in the rank's reward worker (rl.reward_timeout_s),
    whose parent is the rank."""
    if os.environ.get("RANK") == "1":
        os.kill(os.getppid(), signal.SIGKILL)
    return 0.0


# Set for a run whose reward never returns: the file its first call creates, so a test knows the run
# is stuck there.
REWARD_STARTED = "MEGACISPO_TEST_REWARD_STARTED"


def never_returns(response: str, record) -> float:
    """A reward stuck for good (as a verifier stuck in C code would be, no signal reaching it)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    if os.environ.get(REWARD_STARTED):
        open(os.environ[REWARD_STARTED], "a").close()
    while True:
        time.sleep(3600)


def late_when_asked(response: str, record) -> float:
    """Sleeps the record's ``sleep_s`` (an extra field) on a response "slow", then scores as exact_match
    does: a reward that is late on the calls a test picks."""
    if response == "slow":
        time.sleep(float(record.extra["sleep_s"]))
    return float(response.strip() == record.answer.strip())


def beyond_float32(response: str, record) -> float:
    """1e39: finite in float64, infinity in float32 (the advantages' dtype)."""
    return 1e39
