"""What a sync of the trainer's weights to vLLM sends (megacispo.rollout.vllm_engine.send_weights, without
vLLM: its loading is tests/vllm's): a tiny M2 read from its Hugging Face directory at TP 2, EP 2, PP 2 and
TP 2 x EP 2 (expert TP 1), in 2 gloo processes, gathered onto rank 0 in buckets of 4 KiB (tensors cut
between buckets), gives every tensor of that directory under its name, bit for bit."""

from __future__ import annotations

import pytest
import torch

from megacispo.models.config import M2
from megacispo.testing.harness import run_distributed
from megacispo.testing.hf_models import write_hf_model

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

LAYOUTS = {"tp2": {"tensor_model_parallel_size": 2, "sequence_parallel": True},
           "ep2": {"expert_model_parallel_size": 2}, "pp2": {"pipeline_model_parallel_size": 2},
           "tp2_ep2": {"tensor_model_parallel_size": 2, "sequence_parallel": True, "expert_model_parallel_size": 2,
                       "expert_tensor_parallel_size": 1}}


def _gather(hf_dir: str) -> dict[str, dict[str, torch.Tensor]]:
    """Per layout, what rank 0 gathers (empty on rank 1)."""
    from megatron.core import parallel_state

    from megacispo.checkpoint.formats import hf_model_config
    from megacispo.checkpoint.hf import load_hf_weights
    from megacispo.parallel.layout import ParallelConfig, init_distributed
    from megacispo.rollout.vllm_engine import hf_weights
    from megacispo.rollout.weight_sync import full_tensors, weight_buckets
    from megacispo.training.engine import build_inference_model

    config = hf_model_config(hf_dir)
    gathered = {}
    for name, fields in LAYOUTS.items():
        parallel = ParallelConfig(**fields)
        init_distributed(parallel, seed=0)
        model = build_inference_model(config, torch.float32, parallel)
        load_hf_weights(model, hf_dir)
        header, buckets = weight_buckets(model, version=1, bucket_bytes=4096)
        if torch.distributed.get_rank() == 0:
            gathered[name] = {hf_name: tensor.clone() for hf_name, tensor in
                              hf_weights(config, full_tensors(header, buckets))}
        else:
            gathered[name] = {}
            for _ in buckets:
                pass
        parallel_state.destroy_model_parallel()
    return gathered


@pytest.fixture(scope="module")
def m2(tmp_path_factory):
    root = tmp_path_factory.mktemp("m2")
    write_hf_model(root, M2)
    rank_0, rank_1 = run_distributed(_gather, 2, str(root / "hf"), timeout_s=600)
    return root, rank_0, rank_1


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_rank_0_gathers_every_hf_tensor_bit_for_bit(m2, layout):
    from safetensors.torch import load_file

    root, rank_0, rank_1 = m2
    on_disk = load_file(str(root / "hf" / "model.safetensors"))
    assert rank_1[layout] == {}
    assert rank_0[layout].keys() == on_disk.keys()
    for name, tensor in rank_0[layout].items():
        assert tensor.dtype == on_disk[name].dtype and torch.equal(tensor, on_disk[name]), name
