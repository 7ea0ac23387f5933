"""Failing well, catalog 3, environments and tools (issue #56, section 4): a user's own environment
(``env.name: module:Class``) and the python tool's sandbox met with bad behaviour. Every probe ends
its sample cleanly (a failure counted with the reward failures, its cause in one line), or the run at
start-up with one error line (config and data); none a traceback, a hang, a wrong success or a process
left behind. Each row: the probe; what main did when this catalog started -> what it does now.

- reset raises, returns an int, a dict, a list of str, an assistant message: sample failure -> same
- step raises, returns a tuple, a dict, None, a message of role assistant, of bytes or int content:
  sample failure -> same
- step raises SystemExit or KeyboardInterrupt: its worker thread ended silently, the sample failed only
  at env.timeout_s and the pool stayed a thread short for good -> sample failure at once, pool whole
- reward nan, inf, text: sample failure -> same
- reward 1e39 (beyond float32, the advantages' dtype): wrong success, 1e39 -> sample failure
- turn rewards of 2e38 each: wrong success, 6e38 (inf in float32) -> sample failure at turn 2
- env.reward sum of 3e38 (env) and 3e38 (rl.reward): wrong success, 6e38 -> sample failure
- reward np.float32 or a one-element tensor: sample failure "not a finite number" -> the number
- done = "no": wrong success, taken as done -> sample failure
- metric nan: wrong success, NaN in env/<name> -> sample failure
- never done: ends at env.max_turns (and at rollout.max_new_tokens) -> same
- a 10 MiB message from step: tokenized in the rollout's thread (10 s, 2.5 GB), then dropped as too
  long -> sample failure in its worker, never tokenized (MAX_MESSAGES_CHARS)
- a 10 MiB message from reset: a 10M-token prompt -> sample failure
- a reset prompt of 6,000 tokens for a context of 4,096: wrong success, trained past the context (a real
  run) -> sample failure naming its tokens and the prompt limit (data.max_prompt_tokens, or what the
  context leaves)
- reset returns [] (chat template), or a prompt that renders to no ids (no template, no BOS): a
  traceback through the rollout (transformers' ValueError; the model's "every prompt needs at least one
  token") -> sample failure; reset messages the template raises on: traceback -> sample failure
- a step reply the chat template raises on: sample failure -> same
- an environment failing every sample: one warning line a sample (8,192 a step at 512 x 16) -> the
  first 3 and a count, as rl.reward's failures
- step that never returns: sample failure at env.timeout_s -> same (tests/unit/test_env_deadline.py)
- a factory that raises, env.params with an unknown keyword, a class without step, an unknown
  env.name: one start-up error line -> same
- a record with a field "env" (registered or not): ignored, env.name served it -> start-up error
  naming the file and line
- sandbox: fork, multiprocessing, subprocess, os.kill(ppid, 9), socket connect/bind (inet, unix),
  writing /tmp/x, ../x or through a symlink, 2 GiB: refused or "memory", nothing left -> same
- sandbox: random bytes, invalid UTF-8, NUL, 100 MB on stdout: "ok", decoded with U+FFFD and capped,
  the reply renders -> same
- sandbox: sleeps forever, a thread left running: "timeout" at wall_s, its group killed -> same
- sandbox: the run exits (or is killed) while a call sleeps: the call's process outlived it, reparented
  to init, for as long as its sleep -> ends within 0.2 s of its parent
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import shutil
import time
from pathlib import Path

import pytest

from megacispo.data.chat import ReplyRenderer
from megacispo.data.prompts import PromptRecord, load_prompts
from megacispo.data.rewards import RewardScores
from megacispo.data.tokenizer import Tokenizer
from megacispo.envs.base import MAX_MESSAGES_CHARS, EnvStep, get_environment_factory, make_environment
from megacispo.envs.builtin import PythonTool
from megacispo.envs.config import EnvConfig
from megacispo.envs.sandbox import SandboxLimits
from megacispo.envs.turns import Conversations, EnvWorkers, combine_rewards, sum_metrics
from megacispo.testing.tool_modules import load_tool
from tests.unit.test_sandbox import HOSTILE, _hostile

pytest.importorskip("transformers")
make_tiny_hf = load_tool("make_tiny_hf")
TIMEOUT_S = 5.0
"""env.timeout_s of the probes: a failure that waits for it took too long (they come at once)."""
FAILURE_REWARD = -1.0
TOOL = [{"role": "tool", "content": "408"}]
FLOOD = "x" * (10 << 20)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    return make_tiny_hf.build_tokenizer(tmp_path_factory.mktemp("hf_tok"))


@pytest.fixture(scope="module")
def renderer(tokenizer_dir) -> ReplyRenderer:
    return ReplyRenderer(Tokenizer.load(tokenizer_dir), chat_template=True)


class ProbeEnv:
    """reset and step behave as ``reset`` and ``step`` say: a value returned, or an exception raised."""

    def __init__(self, reset=None, step=EnvStep(TOOL)):
        self._reset, self._step = reset, step

    def reset(self, record):
        return self._answer(self._reset)

    def step(self, assistant_message):
        return self._answer(self._step)

    @staticmethod
    def _answer(what):
        if isinstance(what, BaseException):
            raise what
        return what() if callable(what) else what


def _converse(renderer, workers, params: dict, max_turns: int = 3, mode: str = "env",
              scores: RewardScores | None = None, max_prompt_tokens: int = 4096,
              ) -> tuple[Conversations, RewardScores, float]:
    """One conversation with ProbeEnv(**params) driven as a rollout drives it: (it, its scores, seconds)."""
    config = EnvConfig(name="probe", params=params, max_turns=max_turns, timeout_s=TIMEOUT_S, reward=mode)
    conversations = Conversations(config, ProbeEnv, renderer, [PromptRecord(prompt="p", answer="1")], workers,
                                  max_prompt_tokens)
    started = time.monotonic()
    conversations.prompts(lambda record: [7])
    turn = renderer.tokenizer.encode("hi") + [renderer.end_of_turn]
    while not conversations.conversations[0].done:
        conversations.submit(0, turn)
        while conversations.pending:
            conversations.wait_any()
    took = time.monotonic() - started
    return conversations, combine_rewards(mode, conversations, scores, FAILURE_REWARD), took


@pytest.fixture
def workers():
    pool = EnvWorkers(1)
    yield pool
    pool.close()


@pytest.mark.parametrize("params, failure", [
    pytest.param({"reset": RuntimeError("no such task")}, "raised RuntimeError: no such task", id="reset-raises"),
    pytest.param({"reset": 3}, "reset() returned messages of type int", id="reset-int"),
    pytest.param({"reset": {"role": "user", "content": "x"}}, "reset() returned messages of type dict",
                 id="reset-dict"),
    pytest.param({"reset": ["hello"]}, "reset() returned message 0 = 'hello'", id="reset-list-of-str"),
    pytest.param({"reset": [{"role": "assistant", "content": "x"}]}, "message 0 = {'role': 'assistant'",
                 id="reset-assistant"),
    pytest.param({"reset": lambda: [{"role": "user", "content": FLOOD}]},
                 "reset() returned messages of 10485760 characters, over the 4194304", id="reset-10MiB"),
    pytest.param({"step": ValueError("tool broke")}, "raised ValueError: tool broke", id="step-raises"),
    pytest.param({"step": (TOOL, 1.0, False)}, "step() returned tuple", id="step-tuple"),
    pytest.param({"step": {"messages": TOOL}}, "step() returned dict", id="step-dict"),
    pytest.param({"step": None}, "step() returned NoneType None, not an EnvStep", id="step-None"),
    pytest.param({"step": EnvStep([{"role": "assistant", "content": "x"}])}, "message 0 = {'role': 'assistant'",
                 id="step-assistant"),
    pytest.param({"step": EnvStep([{"role": "tool", "content": b"x"}])}, "{'role': 'tool', 'content': b'x'}",
                 id="step-bytes-content"),
    pytest.param({"step": EnvStep([{"role": "tool", "content": 5}])}, "{'role': 'tool', 'content': 5}",
                 id="step-int-content"),
    pytest.param({"step": lambda: EnvStep([{"role": "tool", "content": FLOOD}])},
                 "step() returned messages of 10485760 characters, over the 4194304", id="step-10MiB"),
    pytest.param({"step": EnvStep(TOOL, float("nan"))}, "step()'s reward = nan is not a finite number within float32",
                 id="reward-nan"),
    pytest.param({"step": EnvStep(TOOL, float("inf"))}, "step()'s reward = inf is not a finite number",
                 id="reward-inf"),
    pytest.param({"step": EnvStep(TOOL, 1e39)}, "step()'s reward = 1e+39 is not a finite number within float32",
                 id="reward-1e39"),
    pytest.param({"step": EnvStep(TOOL, "1.0")}, "step()'s reward = '1.0' is text, not a number", id="reward-text"),
    pytest.param({"step": EnvStep(TOOL, 1.0, "no")}, "step()'s done = 'no' is not a bool", id="done-text"),
    pytest.param({"step": EnvStep(TOOL, metrics={"calls": float("nan")})},
                 "step()'s metric 'calls' = nan is not a finite number", id="metric-nan"),
    pytest.param({"step": SystemExit(3)}, "raised SystemExit: 3", id="step-SystemExit"),
    pytest.param({"step": KeyboardInterrupt()}, "raised KeyboardInterrupt", id="step-KeyboardInterrupt"),
])
def test_a_bad_environment_call_fails_its_sample_at_once(renderer, workers, params, failure):
    conversations, scores, took = _converse(renderer, workers, params)
    assert failure in scores.failures[0] and "environment 'probe' " in scores.failures[0], scores.failures[0]
    assert scores.rewards == [FAILURE_REWARD] and scores.num_failures == 1
    assert took < TIMEOUT_S / 2, f"the failure took {took:.1f} s: it waited for env.timeout_s"
    assert sum_metrics(conversations.sample_metrics())["env/failures"] == 1
    # The one worker thread survives the call (a SystemExit ended it, and every later call timed out).
    healthy, scores, took = _converse(renderer, workers, {"step": EnvStep(reward=1.0, done=True)})
    assert scores.rewards == [1.0] and took < TIMEOUT_S / 2


def test_a_flood_fails_before_it_is_tokenized(renderer, workers):
    _, scores, took = _converse(renderer, workers, {"step": lambda: EnvStep([{"role": "tool", "content": FLOOD}])})
    assert "MAX_MESSAGES_CHARS" in scores.failures[0] and took < 1.0, took  # tokenizing it took 10 s
    at_limit = EnvStep([{"role": "tool", "content": "x" * MAX_MESSAGES_CHARS}], done=True)
    assert _converse(renderer, workers, {"step": at_limit})[1].rewards == [0.0]


@pytest.mark.parametrize("reward", ["float32", "tensor", True])
def test_numpy_torch_and_bool_rewards_are_numbers(renderer, workers, reward):
    import numpy
    import torch

    value = {"float32": numpy.float32(0.5), "tensor": torch.tensor(0.5, dtype=torch.float64)}.get(reward, reward)
    _, scores, _ = _converse(renderer, workers, {"step": EnvStep(reward=value, done=numpy.bool_(True))})
    assert scores.rewards == [float(value)] and not scores.failures[0]


def test_an_environment_that_never_ends_stops_at_max_turns(renderer, workers):
    conversations, scores, took = _converse(renderer, workers, {"step": EnvStep(TOOL, 0.25)}, max_turns=3)
    assert conversations.conversations[0].turns == 3 and scores.rewards == [0.75] and not scores.failures[0]


def test_rewards_that_add_up_past_float32_fail_their_sample(renderer, workers):
    conversations, scores, _ = _converse(renderer, workers, {"step": EnvStep(TOOL, 2e38)}, max_turns=3)
    assert "turn rewards sum to 4e+38, beyond float32" in scores.failures[0] and scores.rewards == [FAILURE_REWARD]
    assert conversations.conversations[0].turns == 2, "the conversation went on after its reward overflowed"
    verified = RewardScores([3e38], ("",))
    _, scores, _ = _converse(renderer, workers, {"step": EnvStep(reward=3e38, done=True)}, mode="sum",
                             scores=verified)
    assert "add up to 6e+38, beyond float32" in scores.failures[0] and scores.rewards == [FAILURE_REWARD]


class Unmakeable:
    def __init__(self, **params):
        raise RuntimeError("no licence for the tool")


class StepLess:
    def reset(self, record):
        return None


@pytest.mark.parametrize("factory, params, error", [
    pytest.param(Unmakeable, {}, "env.name = 'probe' with env.params = {} could not be made: RuntimeError: no licence",
                 id="factory-raises"),
    pytest.param(ProbeEnv, {"retries": 3}, "could not be made: TypeError: .*unexpected keyword argument 'retries'; "
                 "fix env.params", id="unknown-keyword"),
    pytest.param(StepLess, {}, r"makes a StepLess without step\(\); an environment needs reset\(record\) and step",
                 id="no-step"),
])
def test_an_environment_that_cannot_be_made_is_one_error_line(factory, params, error):
    with pytest.raises(ValueError, match=error):
        make_environment(factory, params, "probe")


def test_an_unknown_environment_name_lists_the_registered_ones():
    with pytest.raises(ValueError, match=r"env.name = 'sandbox' is not a built-in environment \(guess_number, "
                                         r"python\); give one of them or your own as 'module:Class'"):
        get_environment_factory("sandbox")


@pytest.mark.parametrize("env", ["python", "calculator"])
def test_a_record_cannot_choose_its_environment(tmp_path, env):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n" +
                    json.dumps({"prompt": "2+2=", "answer": "4", "env": env}) + "\n")
    with pytest.raises(ValueError, match=f"{path}:2: field 'env' = '{env}': a record cannot choose its environment"):
        load_prompts(path)


@pytest.mark.parametrize("code", [
    pytest.param("import sys\nsys.stdout.buffer.write(os.urandom(5000))", id="random-bytes"),
    pytest.param("import sys\nsys.stdout.buffer.write(b'ab\\xff\\xfe\\xc3(cd\\x00')", id="invalid-utf8-and-nul"),
    pytest.param("import sys\nfor _ in range(1526):\n    sys.stdout.write('y' * 65536)", id="100MB"),
])
def test_binary_or_huge_tool_output_is_text_the_model_can_read(renderer, code):
    result = _hostile(code, "ok")
    assert len(result.stdout) < 2 * HOSTILE.max_output_chars + 100
    tool = PythonTool(limits={"wall_s": HOSTILE.wall_s})
    tool.reset(PromptRecord(prompt="p", answer="1"))
    reply = tool.step(tool.tool_call("import os\n" + code)).messages
    assert reply[0]["content"] and renderer.reply_ids(reply, renderer.end_of_turn)


@pytest.mark.parametrize("code", [
    pytest.param("import multiprocessing\nmultiprocessing.Process(target=print).start()", id="multiprocessing-fork"),
    pytest.param("import subprocess\nsubprocess.run(['sleep', '100'])", id="subprocess-run"),
    pytest.param("import socket\nsocket.socket(socket.AF_UNIX).bind('listener')", id="bind-unix"),
    pytest.param("import socket\nsocket.socket().bind(('127.0.0.1', 0))", id="bind-port"),
    pytest.param("open('/tmp/megacispo-catalog-probe', 'w')", id="write-tmp"),
])
def test_forks_sockets_and_writes_outside_are_refused(code):
    assert "is not allowed in the sandbox" in _hostile(code, "refused").stderr
    assert not os.path.exists("/tmp/megacispo-catalog-probe")


def test_a_thread_left_running_is_killed_with_its_process():
    limits = SandboxLimits(wall_s=1)
    result = _hostile("import threading, time\nthreading.Thread(target=time.sleep, args=(100,)).start()", "timeout",
                      within_s=limits.wall_s + 2.0, limits=limits)
    assert result.returncode == -9


def test_the_tool_cannot_sigkill_the_process_that_runs_it():
    parent = subprocess.run(
        [sys.executable, "-c", "from megacispo.envs.sandbox import run_python\n"
         "print(run_python('import os\\nos.kill(os.getppid(), 9)').status)"],
        capture_output=True, text=True, timeout=60)
    assert (parent.returncode, parent.stdout) == (0, "refused\n"), parent.stderr


def test_a_broken_environment_logs_three_failures_and_a_count(renderer, workers, caplog):
    config = EnvConfig(name="probe", params={"reset": RuntimeError("no such task")}, timeout_s=TIMEOUT_S)
    conversations = Conversations(config, ProbeEnv, renderer, [PromptRecord(prompt="p", answer="1")] * 64, workers,
                                  max_prompt_tokens=4096)
    with caplog.at_level("WARNING", logger="megacispo.envs.turns"):
        conversations.prompts(lambda record: [7])
        scores = combine_rewards("env", conversations, None, FAILURE_REWARD)
    assert scores.num_failures == 64  # before: 64 lines, one a sample
    assert [record.getMessage()[:9] for record in caplog.records] == ["sample 0:", "sample 1:", "sample 2:",
                                                                      "environme"]
    assert caplog.records[-1].getMessage() == "environment 'probe' failed 64 of 64 samples (the first 3 logged above)"


def test_a_tool_call_does_not_outlive_the_run_that_made_it(tmp_path):
    """A run that exits while a tool call sleeps (a late call's thread is a daemon): before, the call's
    process stayed, its parent init, for as long as its sleep; now it ends within a poll of its watch."""
    parent = subprocess.Popen(
        [sys.executable, "-c", "import threading, time\nfrom megacispo.envs.sandbox import SandboxLimits, run_python\n"
         "code = 'import os, time\\nopen(\"pid\", \"w\").write(str(os.getpid()))\\ntime.sleep(1000)'\n"
         "threading.Thread(target=run_python, args=(code, SandboxLimits(wall_s=600)), daemon=True).start()\n"
         "time.sleep(60)"],
        env={**os.environ, "TMPDIR": str(tmp_path)})
    try:
        deadline = time.monotonic() + 30
        while not list(tmp_path.glob("megacispo-sandbox-*/pid")) or not list(tmp_path.glob("*/pid"))[0].read_text():
            assert time.monotonic() < deadline, "the tool call did not start"
            time.sleep(0.05)
    finally:
        parent.kill()
        parent.wait(timeout=30)
    child = int(list(tmp_path.glob("*/pid"))[0].read_text())
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child), f"the tool call's process {child} outlived its run"


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie has ended: a container's init may be slow to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            stat = file.read()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def test_a_first_prompt_past_the_context_fails_its_sample(renderer, workers):
    """reset's messages are the sample's prompt: longer than what the context leaves for one (here 8
    tokens), they fail the sample before it is generated, as an overlong prompt file is refused."""
    _, scores, _ = _converse(renderer, workers, {"reset": [{"role": "user", "content": "1 + 2 = 3. " * 4}]},
                             max_prompt_tokens=8)
    assert "reset()'s messages render to" in scores.failures[0] and "more than the 8 a prompt may have" in \
        scores.failures[0], scores.failures[0]
    _, scores, _ = _converse(renderer, workers, {"reset": [{"role": "user", "content": "1"}]}, max_prompt_tokens=4096)
    assert scores.num_failures == 0


def test_messages_the_renderer_refuses_fail_their_sample(renderer, tokenizer_dir, tmp_path, workers):
    """Rendered on the rollout's thread, outside the workers: before, reset's raised through the rollout, or
    (no chat template, no BOS) made an empty prompt, which the model refuses with a traceback."""
    _, scores, _ = _converse(renderer, workers, {"reset": []})
    assert "reset()'s messages could not be rendered: Cannot apply chat template to an empty" in scores.failures[0]
    plain = ReplyRenderer(renderer.tokenizer, chat_template=False)  # the tiny tokenizer has no BOS
    _, scores, _ = _converse(plain, workers, {"reset": [{"role": "user", "content": ""}]})
    assert "reset()'s messages render to no tokens" in scores.failures[0]
    strict = shutil.copytree(tokenizer_dir, tmp_path / "strict")
    template = strict / "chat_template.jinja"
    template.write_text("{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tool turns') }}"
                        "{% endif %}{% endfor %}" + template.read_text())
    strict_renderer = ReplyRenderer(Tokenizer.load(strict), chat_template=True)
    _, scores, _ = _converse(strict_renderer, workers, {})
    assert "fails on these messages: no tool turns" in scores.failures[0]
    _, scores, _ = _converse(strict_renderer, workers, {"reset": TOOL})
    assert "reset()'s messages could not be rendered: the chat template of" in scores.failures[0]
