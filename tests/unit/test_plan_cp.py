"""tools/plan.py under context parallelism (--cp) and its search for the longest sequence a layout
fits (--longest): what CP divides and what it does not, the search's boundary, its growth with CP at
a fixed world size, and the bad input (tests/multiprocess/test_plan.py has the rest of the planner)."""

from __future__ import annotations

import dataclasses

import pytest

from megacispo.models.config import model_config
from megacispo.parallel.layout import ParallelConfig
from megacispo.testing.tool_modules import load_tool

plan = load_tool("plan")

# MiniMax-M1 at 512 GPUs, the layout: TP 8, EP 32, DP 512 / (8 x CP).
M1_512 = ParallelConfig(tensor_model_parallel_size=8, expert_model_parallel_size=32, sequence_parallel=True)
M1_OPTIONS = dict(recompute="full", distributed_optimizer=True, fused_lm_head=True)
# tiny: 4 heads x 16, 2 KV heads, lightning block 16 (64 blocks a 1024-token kernel chunk).
STATE = 4 * 16 * 16 * 4  # one [heads, d, d] fp32 state


def _m1_512(cp: int) -> ParallelConfig:
    return dataclasses.replace(M1_512, context_parallel_size=cp)


def _items(stage_plan, kind: str) -> dict[str, float]:
    return {item.name: item.none for item in stage_plan.layer_items[kind]}


def test_cp_divides_the_per_token_activations_of_a_lightning_stack():
    lightning_only = model_config("tiny", layer_pattern="L")
    # Stage 0 of PP 2: 4 layers and the stage output, no LM head. 4 GPUs: DP 2 at CP 1, DP 1 at CP 2.
    layouts = (ParallelConfig(pipeline_model_parallel_size=2, context_parallel_size=cp) for cp in (1, 2))
    one, two = (plan.stage_plans(lightning_only, layout, 4, 1, 4096)[0] for layout in layouts)
    assert (one.data_parallel_size, two.data_parallel_size) == (2, 1)
    assert 0.5 < two.activations / one.activations < 0.55
    items_one, items_two = _items(one, "L"), _items(two, "L")
    for name, size in items_one.items():
        # Chunk states too: 4 kernel chunks of 1024 tokens at CP 1, the rank's 2 zigzag chunks of 1024 at CP 2.
        assert items_two[name] == size / 2, name
    added = {name: size for name, size in items_two.items() if name not in items_one}
    assert added == {
        "CP: entering states of the 2 chunks": 2 * STATE,
        "CP: decayed query of the carried tokens": 2048 * 4 * (64 + 4),  # fp32 q and decay factors, 2048 tokens
        "CP: all-gathered chunk states (2 CP = 4)": 4 * STATE,
    }
    assert (two.weights, two.gradients, two.optimizer_states) == (one.weights, one.gradients, one.optimizer_states)


def test_softmax_layers_keep_the_whole_sequences_keys_and_values():
    tiny = model_config("tiny")
    one, two = (plan.stage_plans(tiny, ParallelConfig(context_parallel_size=cp), cp, 1, 4096)[0] for cp in (1, 2))
    items_one, items_two = _items(one, "S"), _items(two, "S")
    whole_sequence = 4096 * 2 * 2 * 32  # tokens x bf16 x (k, v) x 2 KV heads of 16
    assert items_one["k, v after RoPE"] == whole_sequence
    assert items_two["CP: k, v of the whole sequence (all-gathered)"] == whole_sequence
    assert items_two["q after RoPE (attention input)"] == items_one["q after RoPE (attention input)"] / 2 == 2048 * 2 * 64
    assert items_two["o_proj input"] == items_one["o_proj input"] / 2


def test_a_sequence_is_padded_to_two_chunks_per_cp_rank():
    assert [plan.row_length(n, 4) for n in (1, 8, 9, 100)] == [8, 8, 16, 104]
    assert plan.row_length(9, 1) == 9
    padded, exact = (plan.memory_plan(model_config("tiny"), ParallelConfig(context_parallel_size=4), 4, 1, n)
                     for n in (1001, 1008))
    assert padded.activations == exact.activations


def test_the_longest_sequence_fits_and_one_chunk_more_does_not():
    m1 = model_config("minimax-m1")
    layout = _m1_512(4)
    longest = plan.longest_sequence(m1, layout, 512, 1, **M1_OPTIONS)
    assert longest % (2 * 4) == 0
    assert plan.memory_plan(m1, layout, 512, 1, longest, **M1_OPTIONS).fits
    assert not plan.memory_plan(m1, layout, 512, 1, longest + 1, **M1_OPTIONS).fits


def test_the_longest_sequence_grows_with_cp_and_reaches_1m_tokens_on_512_gpus():
    m1 = model_config("minimax-m1")
    longest = [plan.longest_sequence(m1, _m1_512(cp), 512, 1, **M1_OPTIONS) for cp in (1, 2, 4, 8)]
    assert longest == sorted(longest) and longest[0] > 0
    assert longest[1] > 1.9 * longest[0] and longest[3] > 1.9 * longest[2]  # nearly linear: little is not divided
    assert longest[2] < 2**20 <= longest[3]


def test_the_search_looks_past_the_kept_logits():
    """The fused head keeps the logits of up to 2,683 tokens (256 MiB at V/TP = 25,008): a length just
    under that needs more memory than 3,000 tokens, and the search still finds 3,000."""
    m1 = model_config("minimax-m1")
    at_3000 = plan.memory_plan(m1, M1_512, 512, 1, 3000, **M1_OPTIONS).total
    options = M1_OPTIONS | dict(capacity_bytes=at_3000)
    assert not plan.memory_plan(m1, M1_512, 512, 1, 2683, **options).fits
    assert plan.memory_plan(m1, M1_512, 512, 1, 2684, **options).fits
    assert plan.longest_sequence(m1, M1_512, 512, 1, **options) == 3000


def test_nothing_fits_gives_zero_and_exit_status_1(capsys):
    assert plan.longest_sequence(model_config("tiny"), ParallelConfig(), 1, 1, capacity_bytes=0) == 0
    assert plan.main(["--model", "tiny", "--longest", "--gpu-memory-gb", "0"]) == 1
    assert capsys.readouterr().out.splitlines()[-1] == (
        "longest sequence that fits: none (not even 1 token; the plan above is for 1)")


def test_cli_longest_reports_the_layout_and_the_length(capsys):
    arguments = ["--model", "minimax-m1", "--tp", "8", "--ep", "32", "--cp", "8", "--dp", "8", "--sequence-parallel",
                 "--recompute", "full", "--distributed-optimizer", "--fused-lm-head", "--longest"]
    assert plan.main(arguments) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("minimax-m1 on 512 GPUs = TP 8 x PP 1 x CP 8 x DP 8; EP 32, expert TP 8, expert DP 2")
    assert "dense / DP x CP 64" in "\n".join(lines)
    longest = plan.longest_sequence(model_config("minimax-m1"), _m1_512(8), 512, 1, **M1_OPTIONS)
    assert lines[1].startswith(f"micro-batch 1 x {longest} tokens ({longest // 8} on each CP rank)")
    assert lines[-1] == (f"longest sequence that fits: {longest:,} tokens ({longest // 8:,} on each of the 8 CP "
                         f"ranks); searched up to model.max_position_embeddings = 10,240,000")


@pytest.mark.parametrize(
    "cp, world_size, message",
    [
        (0, 2, "parallel.context_parallel_size = 0: it must be at least 1."),
        (3, 4, "world size 4 is not divisible by tensor_model_parallel_size * pipeline_model_parallel_size * "
               "context_parallel_size = 1 * 1 * 3 = 3: launch a multiple of 3 processes or change TP/PP/CP."),
    ],
)
def test_bad_context_parallel_sizes_get_validate_layouts_error(cp, world_size, message):
    tiny, layout = model_config("tiny"), ParallelConfig(context_parallel_size=cp)
    with pytest.raises(ValueError) as planned:
        plan.memory_plan(tiny, layout, world_size, micro_batch=1, seq_len=32)
    # The search too, before its bound on the fused head's kept logits divides by CP.
    with pytest.raises(ValueError) as searched:
        plan.longest_sequence(tiny, layout, world_size, 1, fused_lm_head=True)
    assert str(planned.value) == str(searched.value) == message


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--cp", "0"], "error: parallel.context_parallel_size = 0: it must be at least 1."),
        (["--cp", "-2"], "error: parallel.context_parallel_size = -2: it must be at least 1."),
        (["--cp", "0", "--longest", "--fused-lm-head"],
         "error: parallel.context_parallel_size = 0: it must be at least 1."),
        (["--cp", "two"], "error: argument --cp: invalid int value: 'two'"),
        (["--longest", "--seq-len", "64"], "error: argument --seq-len: not allowed with argument --longest"),
        # The experts' grid, expert TP 1 x EP 4, does not fit in TP 1 x CP 2 x DP 1 = 2 GPUs.
        (["--ep", "4", "--cp", "2"], "error: world size 2 is not divisible by expert_tensor_parallel_size * "
                                     "expert_model_parallel_size * pipeline_model_parallel_size = 1 * 4 * 1 = 4"),
    ],
)
def test_cli_bad_cp_input_exits_2_with_one_error_line(arguments, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        plan.main(["--model", "tiny", *arguments])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    error_lines = [line for line in captured.err.splitlines() if "error:" in line]
    assert captured.out == "" and len(error_lines) == 1 and message in error_lines[0]
