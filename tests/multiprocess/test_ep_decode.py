"""The lean decode step under EP across attention TP groups (MiniMax-M1's layout: TP 8 = expert TP 8, EP 32
over nodes) at its 4-process twin, TP 2 + expert TP 2, EP 2: where expert TP divides the rows, each
expert-TP rank sends its share of them over EP (``InProcessMoELayer._step_expert_parallel``), and its
collectives across nodes (TP groups) move what benchmarks/decode_ops.py's ``ep_bytes_per_step`` counts
for the lean step, half of what gathering all rows over EP moved. Its logits equal the Megatron path's
(the dispatcher's all-to-all) in fp64: a step at 16 slots (the shares) and at 3 (all rows over EP), and,
in the slow tier, 20 teacher-forced steps of a batch of 3 rows then 2 and of a single row
(tests/multiprocess/test_lean_decode.py's comparison)."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

from megacispo.testing.harness import run_distributed
from tests.multiprocess.test_lean_decode import NUM_STEPS, TOLERANCE, _compare_paths_parallel

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import decode_ops  # noqa: E402

M1_TWIN, PROCESSES = decode_ops.PARALLEL_LAYOUTS["M1's layout: TP 2 + expert TP 2, EP 2 across TP groups"]
ALL_GATHER = "all-gather + reduce-scatter of b rows"
LEAN = "shares over expert TP (the lean step)"


class _AcrossNodes(TorchFunctionMode):
    """Bytes this rank sends plus receives across nodes (TP groups) in the all-gathers and reduce-scatters
    over the EP group or the expert TP and EP group, as ``ep_bytes_per_step`` counts them: (EP - 1)
    blocks of a rank's rows each way."""

    def __init__(self, ep_size: int, groups: tuple) -> None:
        super().__init__()
        self.ep_size, self.groups, self.moved, self.calls = ep_size, groups, 0, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in ("all_gather_single", "reduce_scatter_single") and kwargs.get("group") in self.groups:
            output, tensor = args[:2]
            block = tensor if name == "all_gather_single" else output
            self.moved += 2 * (self.ep_size - 1) * block.numel() * block.element_size()
            self.calls.append((name, self.groups.index(kwargs["group"]), block.shape[0]))
        return func(*args, **kwargs)


def _ep_bytes_of_a_step(slots: int) -> dict:
    from megatron.core import parallel_state

    from megacispo.models.config import model_config, transformer_config
    from megacispo.models.model import HybridModel
    from megacispo.parallel.layout import ParallelConfig, init_distributed

    config = model_config("tiny")
    parallel = ParallelConfig(**M1_TWIN)
    init_distributed(parallel, seed=0)
    # A large init std: logits O(1), routing far from ties. fp64, the router's too: the paths' sums differ
    # in order only.
    model = HybridModel(config, transformer_config(config, parallel, init_method_std=0.3)).double().eval()
    model.config.moe_router_dtype = "fp64"
    input_ids, mask = decode_ops.prompts_for(slots, model.vocab_size)
    recorder = _AcrossNodes(parallel.expert_model_parallel_size,
                            (parallel_state.get_expert_model_parallel_group(),
                             parallel_state.get_expert_tensor_and_model_parallel_group()))
    logits = {}
    for lean in (False, True):  # the Megatron path (its dispatcher's all-to-all), then the lean step
        model.lean_decode = lean
        with model.generation_dtype(torch.float64):
            prefilled, cache = model.prefill(input_ids, mask)
            cache.rows_agree = True
            with recorder if lean else contextlib.nullcontext():
                logits[lean] = model.decode_step(prefilled.argmax(-1), cache)[0]
    counted = decode_ops.ep_bytes_per_step(
        config.hidden_size, slots, parallel.expert_model_parallel_size, parallel.expert_tp,
        config.moe_router_topk, config.num_experts, config.num_layers, torch.float64.itemsize,
    )
    return {"moved": recorder.moved, "calls": recorder.calls, "counted": counted,
            "error": (logits[True] - logits[False]).abs().max().item(), "scale": logits[False].abs().max().item()}


@pytest.mark.slow
def test_lean_step_at_m1s_layout_twin_equals_megatron_path():
    for rank, result in enumerate(run_distributed(_compare_paths_parallel, PROCESSES, M1_TWIN)):
        for case, outcome in result.items():
            assert outcome["scale"] > 1.0, "the test model must produce non-trivial logits"
            assert outcome["block_calls"] == {"lean": 0, "megatron": NUM_STEPS}, (rank, case, outcome["block_calls"])
            assert outcome["error"]["lean"] <= TOLERANCE["float64"] * outcome["scale"], (
                f"rank {rank} {case}: max abs difference {outcome['error']['lean']:.2e} "
                f"at logits up to {outcome['scale']:.1f}"
            )


def test_ep_collectives_of_a_decode_step_move_what_the_table_counts():
    """At 16 slots each expert-TP rank gives 8 rows to the gather and takes 8 from the reduce-scatter
    over the expert TP and EP group (index 1): half the bytes across nodes of gathering all 16 over EP.
    At 3 slots, which expert TP 2 does not divide, the 3 rows go over the EP group (index 0). Either way
    the step's logits are the Megatron path's."""
    for slots, group, rows in ((16, 1, 8), (3, 0, 3)):
        for rank, result in enumerate(run_distributed(_ep_bytes_of_a_step, PROCESSES, slots)):
            counted = result["counted"]
            expected = [("all_gather_single", group, rows), ("reduce_scatter_single", group, rows)] * 8
            assert result["calls"] == expected, (slots, rank, result["calls"])
            assert result["moved"] == counted[LEAN][0], (slots, rank, result)
            assert result["scale"] > 1.0 and result["error"] <= TOLERANCE["float64"] * result["scale"], result
            if slots == 16:
                assert 2 * result["moved"] == counted[ALL_GATHER][0], (rank, result)
