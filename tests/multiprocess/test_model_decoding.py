"""Incremental decoding equals the full forward: left-padded prompts of different lengths, prefill
then decode steps (teacher-forced tokens), against one unpadded forward per sequence, at TP = 1
and TP = 2 (a model built with sequence parallelism, which decoding switches off). Also padded
and packed batches against per-sequence forwards, and TP = 2 logits against TP = 1; the default
prefill (LM head on the last position only) against the last row of return_all_logits. In fp64: the
paths agree to ~1e-13, so any semantic difference (a decay step, a mask, a position) would show.
"""

from __future__ import annotations

import pytest
import torch

from megacispo.testing.harness import run_distributed

# The tiny model's lightning block is 16: prompts within one block and across two. Whole sequences
# have even lengths, so that TP = 2 with sequence parallelism can run them in one forward.
PROMPT_LENGTHS = (6, 20, 12)
NUM_STEPS = 6
KEEP_AFTER = 3  # after this many steps, keep sequences [2, 0] only (cache.select)
TOLERANCE = 1e-10
CHECKS = ["prefill", "prefill_last", "decode", "padded_forward", "packed_forward", "hidden_states"]


def _sequences(vocab_size: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(11)
    return [torch.randint(0, vocab_size, (length + NUM_STEPS,), generator=generator) for length in PROMPT_LENGTHS]


def _left_pad(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    input_ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = prompt
        mask[row, width - len(prompt) :] = True
    return input_ids, mask


def _gather_vocab(logits: torch.Tensor) -> torch.Tensor:
    from megatron.core import tensor_parallel

    return tensor_parallel.gather_from_tensor_model_parallel_region(logits)


def _build_model(layout: dict, load_dir: str | None, save_dir: str | None):
    from megatron.core import dist_checkpointing

    from megacispo.models.config import model_config, transformer_config
    from megacispo.models.model import HybridModel
    from megacispo.parallel.layout import ParallelConfig, init_distributed

    model_cfg = model_config("tiny")
    parallel = ParallelConfig(**layout)
    init_distributed(parallel, seed=99)
    # A large init std, so that logits are O(1) and routing and attention are far from uniform.
    model = HybridModel(model_cfg, transformer_config(model_cfg, parallel, init_method_std=0.3))
    if load_dir is not None:
        model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), load_dir))
    if save_dir is not None:
        dist_checkpointing.save(model.sharded_state_dict(), save_dir)
    # fp64, so that any difference between the decoding and the full-forward paths shows (fp32
    # round-off, amplified through the layers, would be ~1e-5 of the logits).
    model.double().eval()
    model.config.moe_router_dtype = "fp64"
    return model


def _decode(model, sequences: list[torch.Tensor], references: list[torch.Tensor], record) -> None:
    """Prefill the left-padded prompts, then teacher-forced steps; two sequences continue after
    KEEP_AFTER steps (cache.select)."""
    prompt_lengths = [len(seq) - NUM_STEPS for seq in sequences]
    input_ids, mask = _left_pad([seq[:length] for seq, length in zip(sequences, prompt_lengths)])
    logits, cache = model.prefill(input_ids, mask, return_all_logits=True)
    for row, length in enumerate(prompt_lengths):
        record("prefill", logits[row, -length:], references[row][:length])
    # The default prefill runs the LM head on the last position only; it must give that row.
    last_logits, _ = model.prefill(input_ids, mask)
    assert last_logits.shape == logits[:, -1].shape
    record("prefill_last", last_logits, logits[:, -1])
    active = list(range(len(sequences)))
    for step in range(NUM_STEPS):
        if step == KEEP_AFTER:
            active = [2, 0]
            cache = cache.select(torch.tensor(active))
        tokens = torch.stack([sequences[row][prompt_lengths[row] + step] for row in active])
        step_logits, cache = model.decode_step(tokens, cache)
        for slot, row in enumerate(active):
            record("decode", step_logits[slot], references[row][prompt_lengths[row] + step])


def _batched_forwards(model, sequences: list[torch.Tensor], references: list[torch.Tensor], record) -> None:
    """The plain forward of a left-padded batch and of documents packed in one row."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from megacispo.parallel.vocab_parallel import lm_head_input

    padded_ids, padded_mask = _left_pad(sequences)
    positions = (padded_mask.long().cumsum(-1) - 1).clamp(min=0)
    padded = model(padded_ids, positions, padded_mask)
    for row, seq in enumerate(sequences):
        record("padded_forward", _gather_vocab(padded[row, -len(seq) :]), references[row])

    lengths = torch.tensor([len(seq) for seq in sequences])
    cu_seqlens = torch.cat((torch.zeros(1, dtype=torch.long), lengths.cumsum(0))).int()
    packed_seq_params = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
        max_seqlen_q=int(lengths.max()), max_seqlen_kv=int(lengths.max()),
    )
    packed = _gather_vocab(model(torch.cat(sequences)[None], packed_seq_params=packed_seq_params)[0])
    for row, piece in enumerate(packed.split(lengths.tolist())):
        record("packed_forward", piece, references[row])

    # The final hidden states, mapped for the fused LM head, times this rank's LM-head shard are
    # this rank's logits.
    hidden = model(sequences[1][None], return_hidden_states=True)  # [s(/TP), 1, H]
    head_input = lm_head_input(hidden, model.pg_collection.tp, model.config.sequence_parallel)
    record("hidden_states", (head_input @ model.lm_head_weight.T).transpose(0, 1), model(sequences[1][None]))


def _decode_checks(layout: dict, load_dir: str | None = None, save_dir: str | None = None) -> dict:
    """Max abs error of each check in this rank, and the full-forward logits (one unpadded forward
    per sequence, the reference of every check)."""
    model = _build_model(layout, load_dir, save_dir)
    sequences = _sequences(model.vocab_size)
    errors: dict[str, float] = {}

    def record(name: str, actual: torch.Tensor, expected: torch.Tensor) -> None:
        errors[name] = max(errors.get(name, 0.0), (actual - expected).abs().max().item())

    with torch.no_grad():
        references = [_gather_vocab(model(seq[None])[0]) for seq in sequences]
        _decode(model, sequences, references, record)
        _batched_forwards(model, sequences, references, record)
    return {"errors": errors, "references": references, "scale": max(r.abs().max().item() for r in references)}


@pytest.fixture(scope="module")
def tp1(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("decode_ckpt")
    (result,) = run_distributed(_decode_checks, 1, {}, save_dir=str(ckpt))
    return result, str(ckpt)


@pytest.fixture(scope="module")
def tp2(tp1):
    _, ckpt = tp1
    # Built as training builds it (MoE with TP needs sequence parallelism): full forwards run with
    # sequence parallelism, prefill and decode_step without.
    layout = {"tensor_model_parallel_size": 2, "sequence_parallel": True}
    return run_distributed(_decode_checks, 2, layout, load_dir=ckpt)


@pytest.mark.parametrize("check", CHECKS)
def test_tp1(tp1, check):
    result, _ = tp1
    assert result["scale"] > 1.0, "the test model must produce non-trivial logits"
    assert result["errors"][check] <= TOLERANCE, f"{check}: max abs error {result['errors'][check]:.2e}"


@pytest.mark.parametrize("check", CHECKS)
def test_tp2(tp2, check):
    for rank, result in enumerate(tp2):
        assert result["errors"][check] <= TOLERANCE, f"rank {rank} {check}: max abs error {result['errors'][check]:.2e}"


def test_tp2_inference_equals_tp1(tp1, tp2):
    expected, _ = tp1
    for result in tp2:
        for actual, reference in zip(result["references"], expected["references"]):
            torch.testing.assert_close(actual, reference, rtol=0, atol=TOLERANCE)


def test_prefill_rejects_right_padding():
    from megacispo.models.model import _check_left_padded

    with pytest.raises(ValueError, match="left-padded"):
        _check_left_padded(torch.tensor([[1, 1, 0]], dtype=torch.bool))
    with pytest.raises(ValueError, match="at least one token"):
        _check_left_padded(torch.tensor([[0, 0, 0], [0, 1, 1]], dtype=torch.bool))
    _check_left_padded(torch.tensor([[0, 1, 1], [1, 1, 1]], dtype=torch.bool))
