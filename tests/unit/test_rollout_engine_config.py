"""rollout.engine = vllm at start-up (megacispo.startup.check_config), one line each, before any work: the M1
family (vLLM does not serve it), an option only megacispo's engine honours or whose log-probs vLLM gives with
another meaning, vLLM not installed (the install command) or at a release outside the tested range."""

from __future__ import annotations

import importlib.util

import pytest

from megacispo.rollout import vllm_install
from megacispo.startup import run_config

M2 = ["model.size=tiny-m2", "rollout.engine=vllm"]


def test_the_engine_is_one_of_the_two():
    with pytest.raises(ValueError, match=r"rollout.engine = 'sglang': use one of megacispo, vllm"):
        run_config(None, ["rollout.engine=sglang"])


def test_m1_on_vllm_is_refused_naming_the_engine_to_use():
    with pytest.raises(ValueError, match=r"^rollout.engine = vllm with model.family = minimax-m1: vLLM does not serve "
                                         r"MiniMax-M1 \(it removed MiniMaxText01 after 0.23\); set "
                                         r"rollout.engine=megacispo$"):
        run_config(None, ["rollout.engine=vllm"])


@pytest.mark.parametrize("override, message", [
    ("placement.rollout_ranks=1", r"placement.rollout_ranks = 1: vLLM runs in every training process; set "
                                  r"placement.rollout_ranks=0"),
    ("rl.routing_replay=true", r"rl.routing_replay = True: replay needs the experts the rollout routed each token "
                               r"to; vLLM 0.32 returns them only from its model runner V2 .*; set "
                               r"rl.routing_replay=false"),
    ("rollout.early_truncation_tokens=300", r"rollout.early_truncation_tokens = 300: vLLM has no early truncation; "
                                            r"set rollout.early_truncation_tokens=0"),
    ("rollout.top_k=20", r"rollout.top_k = 20: vLLM's log-probs of such a draw are of the truncated distribution, "
                         r"the trainer's of the tempered one; set rollout.top_k=0"),
    ("rollout.top_p=0.9", r"rollout.top_p = 0.9: .*; set rollout.top_p=1.0"),
    ("rollout.compile_decode=true", r"rollout.compile_decode = True: it compiles megacispo's decode step; .*; set "
                                    r"rollout.compile_decode=false"),
    ("rollout.max_cache_gib=2", r"rollout.max_cache_gib = 2.0: it caps megacispo's cache; vLLM's is "
                                r"rollout.vllm_cache_gib; set rollout.max_cache_gib=0"),
])
def test_an_option_vllm_cannot_honour_is_refused(override, message):
    with pytest.raises(ValueError, match=rf"^rollout.engine = vllm with {message} or rollout.engine=megacispo$"):
        run_config(None, [*M2, override])


def test_without_vllm_the_error_says_how_to_install_it():
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    with pytest.raises(ValueError, match=r"^rollout.engine = vllm: vLLM is not installed: pip install "
                                         r"'megacispo\[vllm\]' on GPUs; on a CPU, bash tools/setup_env.sh --vllm"):
        run_config(None, M2)


def test_a_vllm_release_outside_the_tested_range_is_refused(monkeypatch):
    monkeypatch.setattr(vllm_install.importlib.metadata, "version", lambda distribution: "0.35.0")
    with pytest.raises(ValueError, match=r"^rollout.engine = vllm: vLLM 0.35.0 is installed: megacispo's vLLM "
                                         r"rollouts are tested with 0.32 <= vLLM < 0.34"):
        run_config(None, M2)


def test_the_sync_tolerance_follows_the_precision():
    config = run_config(None, ["rollout.dtype=bfloat16"]).rollout
    assert (config.sync_tolerance(on_gpu=True), run_config(None).rollout.sync_tolerance(on_gpu=False)) == (0.1, 1e-2)
    assert run_config(None, ["rollout.vllm_sync_tolerance=0.3"]).rollout.sync_tolerance(on_gpu=True) == 0.3


def test_a_vllm_engine_spans_a_divisor_of_the_world():
    from megacispo.config import load_config
    from megacispo.startup import _check_vllm_layout

    config = load_config(None, [*M2, "rollout.vllm_tensor_parallel=2"])
    _check_vllm_layout(config, 4)
    with pytest.raises(ValueError, match=r"^rollout.vllm_tensor_parallel = 2 does not divide the 3 processes: each "
                                         r"vLLM engine spans that many consecutive ones; use a divisor of 3$"):
        _check_vllm_layout(config, 3)
