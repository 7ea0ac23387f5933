"""Environment calls that never return cost their samples and their threads, not the pool (issue #56).

- A rollout whose environment hangs on every call fails all its samples within env.timeout_s of
  their calls, at 8 samples as at 512; the calls still waiting for a thread are never run.
- The threads stuck in those calls are replaced: the next rollout's calls run (before, every later
  call waited behind the stuck threads and timed out).
"""

from __future__ import annotations

import threading
import time

import pytest

from megacispo.data.chat import ReplyRenderer
from megacispo.data.prompts import PromptRecord
from megacispo.data.rewards import LATE
from megacispo.data.tokenizer import Tokenizer
from megacispo.envs.base import EnvStep
from megacispo.envs.config import EnvConfig
from megacispo.envs.turns import Conversations, EnvWorkers, combine_rewards
from megacispo.testing.tool_modules import load_tool

pytest.importorskip("transformers")
make_tiny_hf = load_tool("make_tiny_hf")
TIMEOUT_S = 0.5
WORKERS = 4


@pytest.fixture(scope="module")
def renderer(tmp_path_factory) -> ReplyRenderer:
    return ReplyRenderer(Tokenizer.load(make_tiny_hf.build_tokenizer(tmp_path_factory.mktemp("hf_tok"))),
                         chat_template=False)


class HangingEnv:
    """Hangs in reset or step (as the record's answer says) until the test releases it; counts its calls."""

    release = threading.Event()
    calls = 0
    lock = threading.Lock()

    def reset(self, record):
        self.hang = record.answer
        self._call("reset")
        return None

    def step(self, assistant_message):
        self._call("step")
        return EnvStep(reward=1.0, done=True)

    def _call(self, name: str) -> None:
        with HangingEnv.lock:
            HangingEnv.calls += 1
        if self.hang == name:
            HangingEnv.release.wait(timeout=60)


@pytest.fixture
def workers():
    HangingEnv.release.clear()
    HangingEnv.calls = 0
    pool = EnvWorkers(WORKERS)
    yield pool
    HangingEnv.release.set()
    pool.close()


def _rollout(renderer, workers, samples: int, hang: str) -> Conversations:
    """A rollout of ``samples`` conversations of one turn each, its environment hanging in ``hang`` (or not)."""
    conversations = Conversations(EnvConfig(name="hanging", timeout_s=TIMEOUT_S, max_turns=1), HangingEnv, renderer,
                                  [PromptRecord(prompt="p", answer=hang)] * samples, workers,
                                  max_prompt_tokens=4096)
    conversations.prompts(lambda record: [7])
    for sample in range(samples):
        if not conversations.conversations[sample].done:
            conversations.submit(sample, [renderer.tokenizer.eos_id])
    while conversations.pending:
        conversations.wait_any()
    return conversations


@pytest.mark.parametrize("samples", [8, 512])
@pytest.mark.parametrize("hang", ["reset", "step"])
def test_an_environment_that_hangs_on_every_call_fails_its_rollout_in_one_time_limit(renderer, workers, samples,
                                                                                      hang):
    started = time.monotonic()
    conversations = _rollout(renderer, workers, samples, hang)
    took = time.monotonic() - started
    expected_calls = WORKERS if hang == "reset" else samples + WORKERS
    assert took < 2 * TIMEOUT_S + 0.5, f"{samples} samples took {took:.1f} s"
    failures = conversations.failures()
    assert all(f"took over env.timeout_s = {TIMEOUT_S:g} s" in failure for failure in failures)
    scores = combine_rewards("env", conversations, None, failure_reward=-1.0)
    assert scores.rewards == [-1.0] * samples and scores.num_late == samples and scores.causes[0] == LATE
    time.sleep(0.2)
    assert HangingEnv.calls == expected_calls, "a call given up on before it started was run"

    healthy = _rollout(renderer, workers, samples, hang="")
    assert not any(healthy.failures()), healthy.failures()[0]
    assert healthy.rewards() == [1.0] * samples
