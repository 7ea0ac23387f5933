"""The host side of multi-turn rollouts: replies rendered with the chat template as ids appended to the
sampled stream, multi-turn SFT demonstrations laid out and masked as a rollout of them would be, the
environment calls' failures (a raise, a hang past env.timeout_s, garbage) kept to their sample, and
env.reward's three ways of making a sample's reward."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from megacispo.data.chat import ReplyRenderer
from megacispo.data.prompts import PromptLimit, PromptRecord, build_sft_example, collate_sft
from megacispo.data.rewards import RewardScores
from megacispo.data.tokenizer import Tokenizer
from megacispo.envs.base import EnvStep
from megacispo.envs.config import EnvConfig
from megacispo.envs.turns import Conversations, EnvWorkers, combine_rewards, sum_metrics, turn_stop_ids
from megacispo.testing.tool_modules import load_tool

pytest.importorskip("transformers")
make_tiny_hf = load_tool("make_tiny_hf")
TOOL_MESSAGE = [{"role": "tool", "content": "408"}]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    return Tokenizer.load(make_tiny_hf.build_tokenizer(tmp_path_factory.mktemp("hf_tok")))


@pytest.fixture(scope="module")
def reference(tokenizer):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer.path)


def _template(reference, messages, add_generation_prompt):
    return reference.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                         return_dict=True)["input_ids"]


def test_a_reply_extends_the_sampled_stream_as_the_template_renders_the_conversation(tokenizer, reference):
    renderer = ReplyRenderer(tokenizer, chat_template=True)
    user = [{"role": "user", "content": "What is 12 * 34?"}]
    prompt = renderer.prompt_ids(user)
    turn = tokenizer.encode("call it") + [renderer.end_of_turn]  # as sampled: the turn ends at <|im_end|>
    stream = prompt + turn + renderer.reply_ids(TOOL_MESSAGE, turn[-1])
    conversation = user + [{"role": "assistant", "content": "call it"}] + TOOL_MESSAGE
    assert stream == _template(reference, conversation, add_generation_prompt=True)
    assert renderer.end_of_turn == reference.convert_tokens_to_ids("<|im_end|>")


def test_a_turn_that_stops_at_a_tool_tag_gets_its_end_of_turn_from_the_reply(tokenizer, reference):
    tag = tokenizer.encode("!")[-1]
    renderer = ReplyRenderer(tokenizer, chat_template=True, tool_stop_ids=[tag])
    after_tag = renderer.reply_ids(TOOL_MESSAGE, tag)
    after_end = renderer.reply_ids(TOOL_MESSAGE, renderer.end_of_turn)
    assert after_tag == [renderer.end_of_turn] + after_end
    assert tag in renderer.turn_stop_ids


def test_without_a_template_a_reply_is_its_content(tokenizer):
    renderer = ReplyRenderer(tokenizer, chat_template=False)
    assert renderer.reply_ids(TOOL_MESSAGE + [{"role": "user", "content": " go"}], tokenizer.eos_id) == \
        tokenizer.encode("408") + tokenizer.encode(" go")


def test_env_stop_tokens_must_be_single_tokens(tokenizer):
    with pytest.raises(ValueError, match=r"env.stop_tokens: .*encodes to \d+ tokens"):
        turn_stop_ids(EnvConfig(name="x", stop_tokens=["a long tag"]), tokenizer)
    assert turn_stop_ids(EnvConfig(name="x", stop_tokens=["!"]), tokenizer)[-1] == tokenizer.encode("!")[0]


def test_multi_turn_sft_masks_exactly_the_model_turns(tokenizer, reference):
    renderer = ReplyRenderer(tokenizer, chat_template=True)
    turns = [{"role": "assistant", "content": "call it"}, *TOOL_MESSAGE, {"role": "assistant", "content": "408"}]
    record = PromptRecord(prompt="What is 12 * 34?", answer="408", extra={"turns": turns})
    limit = PromptLimit(tokenizer, 4096, "the context", with_answer=True, render_turns=renderer.turn_ids)
    example = build_sft_example(tokenizer, limit.fit(record, "row 1", chat_template=True), chat_template=True)
    full = _template(reference, [{"role": "user", "content": record.prompt}] + turns, add_generation_prompt=False)
    # The template ends the last turn with "<|im_end|>\n"; training stops at the end of turn.
    assert example.token_ids == full[:len(example.token_ids)] and example.token_ids[-1] == renderer.end_of_turn
    batch = collate_sft([example], tokenizer.pad_id)
    trained = [label for label, m in zip(batch.labels[0].tolist(), batch.loss_mask[0].tolist()) if m]
    expected = tokenizer.encode("call it") + [renderer.end_of_turn] + tokenizer.encode("408") + [renderer.end_of_turn]
    assert trained == expected


def test_sft_turns_need_an_environment_and_end_with_the_model(tokenizer):
    record = PromptRecord(prompt="q", answer="a", extra={"turns": [{"role": "assistant", "content": "a"}]})
    with pytest.raises(ValueError, match="row 3: field 'turns' .* needs env.name"):
        PromptLimit(tokenizer, 64, "the context", with_answer=True).fit(record, "row 3")
    bad = PromptRecord(prompt="q", answer="a", extra={"turns": [*TOOL_MESSAGE]})
    renderer = ReplyRenderer(tokenizer, chat_template=False)
    with pytest.raises(ValueError, match="the last turn is the model's"):
        PromptLimit(tokenizer, 64, "the context", with_answer=True, render_turns=renderer.turn_ids).fit(bad, "row 4")


class FlakyEnv:
    """Sample 0 answers, 1 raises, 2 hangs past the timeout, 3 returns garbage, 4 is done at once."""

    def reset(self, record):
        self.kind = int(record.answer)
        return None

    def step(self, assistant_message):
        if self.kind == 1:
            raise RuntimeError("the tool broke")
        if self.kind == 2:
            time.sleep(3)
        if self.kind == 3:
            return {"reply": "not an EnvStep"}
        return EnvStep(messages=[] if self.kind == 4 else TOOL_MESSAGE, reward=1.0, done=self.kind == 4,
                       metrics={"tool_calls": 1})


def test_environment_failures_stay_with_their_samples(tokenizer):
    config = EnvConfig(name="flaky", timeout_s=0.5, max_turns=3)
    workers = EnvWorkers(4)
    conversations = Conversations(config, FlakyEnv, ReplyRenderer(tokenizer, chat_template=False),
                                  [PromptRecord(prompt="p", answer=str(i)) for i in range(5)], workers,
                                  max_prompt_tokens=4096)
    assert conversations.prompts(lambda record: [7]) == [[7]] * 5
    started = time.monotonic()
    for sample in range(5):
        conversations.submit(sample, tokenizer.encode("hi") + [tokenizer.eos_id])
    answered = {}
    while conversations.pending:
        answered.update(conversations.wait_any())
    assert time.monotonic() - started < 2.0, "the hung call was waited for past env.timeout_s"
    assert answered[0] == tokenizer.encode("408") and answered[4] is None
    assert all(answered[sample] is None for sample in (1, 2, 3))
    failures = conversations.failures()
    assert "raised RuntimeError: the tool broke" in failures[1]
    assert "took over env.timeout_s = 0.5 s" in failures[2]
    assert "not an EnvStep" in failures[3]
    assert not failures[0] and not failures[4]
    sums = sum_metrics(conversations.sample_metrics())
    assert (sums["env/failures"], sums["env/timeouts"], sums["env/tool_calls"], sums["env/turns"]) == (3, 1, 2, 5)
    assert conversations.rewards() == [1.0, None, None, None, 1.0]
    workers.close()


@pytest.mark.parametrize("mode, expected", [("env", [1.0, -1.0]), ("reward", [0.5, -1.0]), ("sum", [1.5, -1.0])])
def test_env_reward_modes(tokenizer, mode, expected):
    workers = EnvWorkers(1)
    conversations = Conversations(EnvConfig(name="flaky"), FlakyEnv, ReplyRenderer(tokenizer, chat_template=False),
                                  [PromptRecord(prompt="p", answer=str(i)) for i in (4, 1)], workers,
                                  max_prompt_tokens=4096)
    conversations.prompts(lambda record: [7])
    for sample in range(2):
        conversations.submit(sample, [tokenizer.eos_id])
    while conversations.pending:
        conversations.wait_any()
    scores = RewardScores([0.5, 0.5], ("", ""))
    combined = combine_rewards(mode, conversations, None if mode == "env" else scores, failure_reward=-1.0)
    assert combined.rewards == expected and combined.num_failures == 1 and "the tool broke" in combined.first_failure
    workers.close()


def test_tokenizer_symbols_are_single_tokens(tmp_path: Path):
    from megacispo.data.tokenizer import train_sentencepiece

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("12*34=<python>12*34</python>408\n" * 20)
    tokenizer = Tokenizer.load(train_sentencepiece([corpus], 300, tmp_path, symbols=["<python>", "</python>"]))
    assert len(tokenizer.encode("</python>")) == 1 and len(tokenizer.encode("<python>")) == 1
    assert tokenizer.decode(tokenizer.encode("1<python>2</python>")) == "1<python>2</python>"


def test_the_readme_environment_runs_as_written(tokenizer):
    """The README's environment of your own, executed from its text, gives hints, then the reward."""
    import re
    import types

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme[readme.index("## Multi-turn rollouts and tools"):]
    code = re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)
    assert len(code.strip().splitlines()) < 20, "the README promises an environment in under 20 lines"
    module = types.ModuleType("my_envs")
    exec(compile(code, "README.md", "exec"), module.__dict__)
    workers = EnvWorkers(1)
    conversations = Conversations(EnvConfig(name="my_envs:Countdown", max_turns=4), module.Countdown,
                                  ReplyRenderer(tokenizer, chat_template=False),
                                  [PromptRecord(prompt="say 42", answer="42")], workers, max_prompt_tokens=4096)
    conversations.prompts(lambda record: [7])
    conversations.submit(0, tokenizer.encode("41") + [tokenizer.eos_id])
    assert conversations.wait_any() == [(0, tokenizer.encode("try again"))]
    conversations.submit(0, tokenizer.encode("it is 42") + [tokenizer.eos_id])
    assert conversations.wait_any() == [(0, None)]
    assert conversations.rewards() == [1.0] and sum_metrics(conversations.sample_metrics())["env/hints"] == 1
    workers.close()
