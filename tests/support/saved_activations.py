"""tools/plan.py's activation estimate against the tensors the real model saves for backward
(tests/multiprocess/test_plan.py, and tests/slow/test_plan.py under tensor and sequence parallelism)."""

from __future__ import annotations

import pytest
import torch

from megacispo.models.config import model_config
from megacispo.parallel.layout import ParallelConfig
from megacispo.testing.harness import run_distributed
from megacispo.testing.tool_modules import load_tool


def saved_activation_bytes(layout: dict, micro_batch: int, seq_len: int) -> dict[str, int]:
    """Bytes of the tensors each layer kind of the tiny bf16 model saves for backward, on this rank
    (every storage counted once; parameters excluded). Runs in a worker process."""
    from megatron.core import parallel_state

    from megacispo.models.config import transformer_config
    from megacispo.models.model import HybridModel
    from megacispo.parallel.layout import init_distributed

    tiny = model_config("tiny")
    parallel = ParallelConfig(**layout)
    init_distributed(parallel, seed=1234)
    model = HybridModel(tiny, transformer_config(tiny, parallel, params_dtype=torch.bfloat16),
                        pre_process=parallel_state.is_pipeline_first_stage(),
                        post_process=parallel_state.is_pipeline_last_stage())
    tokens = torch.randint(0, tiny.vocab_size, (micro_batch, seq_len), generator=torch.Generator().manual_seed(0))
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    current_kind, saved = [None], {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if current_kind[0] is not None and storage.data_ptr() not in parameters:
            saved.setdefault(storage.data_ptr(), (current_kind[0], storage.nbytes()))
        return tensor

    for layer in model.decoder.layers:
        kind = tiny.layer_kind(layer.layer_number - 1)
        layer.register_forward_pre_hook(lambda module, args, kind=kind: current_kind.__setitem__(0, kind))
        layer.register_forward_hook(lambda module, args, output: current_kind.__setitem__(0, None))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(tokens)
    totals = {}
    for kind, num_bytes in saved.values():
        totals[kind] = totals.get(kind, 0) + num_bytes
    return totals


def compare_with_the_model(layout: dict, world_size: int) -> None:
    """tools/plan.py's activation estimate of each layer kind of the tiny model equals, to 1%, the bytes
    the model saves for backward at ``layout`` on every rank of ``world_size``."""
    plan = load_tool("plan")
    micro_batch, seq_len = 2, 64
    tiny = model_config("tiny")
    measured = run_distributed(saved_activation_bytes, world_size, layout, micro_batch, seq_len)
    stage = plan.stage_plans(tiny, ParallelConfig(**layout), world_size, micro_batch, seq_len)[0]
    for kind, items in stage.layer_items.items():
        estimate = tiny.layer_kinds.count(kind) * plan.activation_bytes(items, "none")
        if kind == "S":  # the RoPE tables are computed once per stage; the softmax layer saves them
            estimate += next(item.none for item in stage.stage_items if item.name.startswith("RoPE"))
        for rank_totals in measured:
            assert rank_totals[kind] == pytest.approx(estimate, rel=0.01), kind
