"""Multi-turn rollouts on vLLM (rollout.engine = vllm; ``bash tests/run.sh --vllm``) keep megacispo's protocol: a
turn that ends at a stop id goes to the sample's environment, its reply is appended to the sequence outside the
loss mask, and the next turn is generated after it, in one process and with one vLLM engine over two
(rollout.vllm_tensor_parallel = 2: the processes' conversations gathered into each round). A tiny M2
(head_dim 32) greedy in fp32, given megacispo's weights by a sync, talks to an environment that replies late
to some samples and ends after three turns
(megacispo.testing.conversations.CountingEnv):

- vLLM's samples equal megacispo's engine's, token for token (every turn and every reply), with the same
  loss mask, and its log-probs of the sampled tokens equal megacispo's;
- the loss mask is 0 on exactly the replies, which are the environment's rendered ids.
"""

from __future__ import annotations

import datetime
import functools
import os

import pytest
import torch

from megacispo.data.prompts import PromptRecord
from megacispo.testing.conversations import PAD, CharTokenizer, CountingEnv
from megacispo.testing.harness import run_distributed

pytest.importorskip("vllm")

PROMPT_LENGTHS = (3, 9, 20, 5, 11, 2)
MAX_NEW = 48
REPLY_ID = CharTokenizer().encode("x")[0]


def _conversations_on_both_engines(vllm_tensor_parallel: int) -> dict:
    """Each engine's samples of this rank's conversations (each rank's prompts its own):
    {engine: (tokens, rollout log-probs, loss mask, fed tokens)}."""
    from megacispo.data.chat import ReplyRenderer
    from megacispo.envs.config import EnvConfig
    from megacispo.envs.turns import Conversations, EnvWorkers
    from megacispo.models.config import model_config, transformer_config
    from megacispo.models.model import HybridModel
    from megacispo.parallel.layout import ParallelConfig, init_distributed
    from megacispo.rollout.config import RolloutConfig
    from megacispo.rollout.generate import generate, sample_keys
    from megacispo.rollout.vllm_engine import VllmRollouts

    import torch.distributed as dist

    config = model_config("tiny-m2", head_dim=32, rotary_dim=16, num_layers=4)
    init_distributed(ParallelConfig(), seed=7)
    model = HybridModel(config, transformer_config(config, ParallelConfig(), init_method_std=0.3)).eval()
    generator = torch.Generator().manual_seed(5 + dist.get_rank())
    prompts = [torch.randint(43, 512, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]
    rollout = RolloutConfig(max_new_tokens=MAX_NEW, temperature=0.0, vllm_cache_gib=0.25,
                            vllm_tensor_parallel=vllm_tensor_parallel)
    # The probe is the same on every rank, as the trainer's is: an engine of several processes scores it together.
    vllm = VllmRollouts.start(config, rollout, max_model_len=128, seed=0, probe=[list(range(43, 60)), [7, 300] * 9],
                              timeout=datetime.timedelta(minutes=5))
    with torch.no_grad():
        expected = [torch.log_softmax(model(torch.tensor([sequence])).double(), dim=-1)[0, :-1]
                    .gather(-1, torch.tensor(sequence[1:])[:, None])[:, 0] for sequence in vllm.probe]
    vllm.sync(model, 0, expected)
    shared_memory = _shared_memory_names() if vllm_tensor_parallel > 1 else None
    tokenizer = CharTokenizer()
    workers = EnvWorkers(4)
    results = {}
    for name, engine in {"megacispo": functools.partial(generate, model), "vllm": vllm.generate}.items():
        env = EnvConfig(name="counting", params={"delay_s": 0.05}, max_turns=4, timeout_s=30.0)
        records = [PromptRecord(prompt="", answer=str(row)) for row in range(len(prompts))]
        conversations = Conversations(env, CountingEnv, ReplyRenderer(tokenizer, chat_template=False), records,
                                      workers, max_prompt_tokens=64)
        samples = engine(conversations.prompts(lambda record: prompts[int(record.answer)]), rollout,
                         stop_ids=tokenizer.stop_ids, pad_id=PAD, keys=sample_keys((11, 0), range(len(prompts)), 1,
                                                                                   device="cpu"),
                         conversations=conversations)
        lengths = (samples.prompt_lengths + samples.response_lengths).tolist()
        results[name] = [(samples.tokens[i, :n], samples.rollout_logprobs[i, :n - 1], samples.loss_mask[i, :n - 1],
                          conversations.conversations[i].fed_tokens) for i, n in enumerate(lengths)]
    workers.close()
    return {**results, "shared memory": shared_memory}


def _shared_memory_names() -> tuple[str, str, bool]:
    """vLLM's CPU tensor parallelism's shared memory: its name for this run, the name vLLM would give it
    unshimmed (megacispo.parallel.cpu.vllm.private_shared_memory), and whether this process's file is left."""
    from types import SimpleNamespace

    from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed
    from vllm.distributed.parallel_state import get_tp_group

    communicator = get_tp_group().device_communicator
    name = communicator.dist_module.group_name
    unshimmed = _CPUSHMDistributed.make_group_name.vllm_make_group_name(
        SimpleNamespace(unique_name=communicator.unique_name, ranks=communicator.ranks))
    return name, unshimmed, os.path.exists(f"/dev/shm/{name}_{communicator.rank}")


@pytest.fixture(scope="module", params=[1, 2], ids=["one process", "vLLM TP 2 over 2 processes"])
def ranks(request) -> list[dict]:
    return run_distributed(_conversations_on_both_engines, request.param, request.param, timeout_s=600)


def test_vllm_conversations_equal_megacispos(ranks):
    for engines in ranks:
        _assert_the_same(engines)


def _assert_the_same(engines: dict) -> None:
    for sample, (ours, theirs) in enumerate(zip(engines["megacispo"], engines["vllm"], strict=True)):
        assert torch.equal(theirs[0], ours[0]), f"sample {sample}: {theirs[0].tolist()} != {ours[0].tolist()}"
        assert torch.equal(theirs[2], ours[2]), f"sample {sample}: the loss masks differ"
        sampled = ours[2].bool()
        torch.testing.assert_close(theirs[1][sampled].double(), ours[1][sampled].double(), rtol=0, atol=1e-4)


def test_replies_are_fed_outside_the_loss_mask(ranks):
    replies = 0
    for tokens, _, loss_mask, fed_tokens in (sample for engines in ranks for sample in engines["vllm"]):
        fed = tokens[1:][loss_mask == 0][-fed_tokens:] if fed_tokens else tokens[:0]
        assert fed.tolist() == [REPLY_ID] * fed_tokens
        replies += fed_tokens
    assert replies > 0, "no reply was fed"


def test_tensor_parallel_shared_memory_is_the_runs_own_and_removed(ranks):
    """megacispo.parallel.cpu.vllm.private_shared_memory holds and is needed: vLLM names the shared memory of
    its CPU tensor parallelism alike for every run on the machine (a second run, or one after a crash, which
    leaves the files, fails to create it); the shim names it after the run, and no file is left once joined.
    When a vLLM release names it per run, this fails: remove the shim then."""
    if len(ranks) == 1:
        pytest.skip("one process: no tensor parallelism")
    for engines in ranks:
        name, unshimmed, left = engines["shared memory"]
        assert unshimmed.replace("/", "") == "-tp:0-[0-1]-cpushm", f"vLLM names it {unshimmed!r}: is the shim needed?"
        assert name.startswith("megacispo-") and name.endswith(unshimmed.replace("/", "")) and not left
