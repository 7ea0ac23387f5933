"""Layout validation: every impossible split is refused with the numbers and the fix."""

import re

import pytest

from megacispo.parallel.layout import ModelShape, ParallelConfig, validate_layout

SHAPE = ModelShape(num_layers=8, num_attention_heads=4, num_query_groups=2, num_experts=4, moe_ffn_hidden_size=64)


@pytest.mark.parametrize(
    "world_size, layout, message",
    [
        (3, dict(tensor_model_parallel_size=2), "world size 3 is not divisible by tensor_model_parallel_size"),
        (4, dict(expert_model_parallel_size=8), "world size 4 is not divisible by expert_tensor_parallel_size"),
        (4, dict(pipeline_model_parallel_size=3), "world size 4 is not divisible"),
        (3, dict(pipeline_model_parallel_size=3), "model.num_layers = 8 is not divisible by pipeline_model_parallel_size = 3"),
        (8, dict(tensor_model_parallel_size=8), "model.num_attention_heads = 4 is not divisible by tensor_model_parallel_size = 8"),
        (4, dict(tensor_model_parallel_size=4), "model.num_query_groups = 2 (KV heads) is not divisible"),
        (3, dict(expert_model_parallel_size=3), "model.num_experts = 4 is not divisible by expert_model_parallel_size = 3"),
        (2, dict(sequence_parallel=True), "sequence_parallel = true needs tensor_model_parallel_size > 1"),
        (2, dict(tensor_model_parallel_size=2), "with 4 experts needs parallel.sequence_parallel = true"),
        (2, dict(tensor_model_parallel_size=0), "parallel.tensor_model_parallel_size = 0"),
        # Expert TP follows TP when unset: TP 2 x EP 2 needs 4 processes, or expert TP 1.
        (2, dict(tensor_model_parallel_size=2, expert_model_parallel_size=2, sequence_parallel=True),
         "= 2 * 2 * 1 = 4 (expert_tensor_parallel_size is unset, so it is tensor_model_parallel_size = 2): "
         "the experts of each pipeline stage sit on a grid of their own"),
        (2, dict(tensor_model_parallel_size=2, expert_model_parallel_size=2, sequence_parallel=True),
         "or set parallel.expert_tensor_parallel_size = 1"),
        (3, dict(expert_tensor_parallel_size=3), "model.moe_ffn_hidden_size = 64 is not divisible by "
         "expert_tensor_parallel_size = 3: each expert's FFN is split"),
        (4, dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2),
         "virtual_pipeline_model_parallel_size = 2: interleaved pipeline stages are not supported"),
    ],
)
def test_bad_layout_names_the_numbers(world_size, layout, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        validate_layout(ParallelConfig(**layout), world_size, SHAPE)


def test_experts_parallel_without_experts():
    with pytest.raises(ValueError, match="has no experts"):
        validate_layout(ParallelConfig(expert_model_parallel_size=2), 2,
                        ModelShape(num_layers=2, num_attention_heads=4, num_query_groups=4, num_experts=None,
                                   moe_ffn_hidden_size=None))


@pytest.mark.parametrize(
    "world_size, layout, data_parallel",
    [
        (1, dict(), 1),
        (2, dict(tensor_model_parallel_size=2, sequence_parallel=True), 1),
        (4, dict(tensor_model_parallel_size=2, sequence_parallel=True), 2),
        (8, dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, expert_model_parallel_size=2,
                 sequence_parallel=True), 2),
        (2, dict(tensor_model_parallel_size=2, expert_model_parallel_size=2, expert_tensor_parallel_size=1,
                 sequence_parallel=True), 1),
    ],
)
def test_good_layouts(world_size, layout, data_parallel):
    parallel = ParallelConfig(**layout)
    validate_layout(parallel, world_size, SHAPE)
    assert parallel.data_parallel_size(world_size) == data_parallel
