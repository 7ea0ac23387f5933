"""Incremental decoding equals the full forward: left-padded prompts of different lengths, prefill
then decode steps (teacher-forced tokens), against one unpadded forward per sequence, at TP = 1
and TP = 2 (inference: no sequence parallelism). Also padded and packed batches against
per-sequence forwards, and TP = 2 inference logits against TP = 1. fp32.
"""

from __future__ import annotations

import pytest
import torch

from megacispo.parallel.multiprocess import run_distributed

PROMPT_LENGTHS = (5, 20, 11)  # the tiny model's lightning block is 16: prompts within one and across two
NUM_STEPS = 6
KEEP_AFTER = 3  # after this many steps, keep sequences [2, 0] only (cache.select)
TOLERANCE = 2e-5


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


def _full_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary logits [n, V] of one unpadded sequence."""
    from megatron.core import tensor_parallel

    logits = model(tokens[None])[0]
    return tensor_parallel.gather_from_tensor_model_parallel_region(logits)


def _decode_checks(layout: dict, load_dir: str | None = None, save_dir: str | None = None) -> dict:
    from megatron.core import dist_checkpointing
    from megatron.core.packed_seq_params import PackedSeqParams

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
    sequences = _sequences(model_cfg.vocab_size)
    errors: dict[str, float] = {}

    def record(name: str, actual: torch.Tensor, expected: torch.Tensor) -> None:
        errors[name] = max(errors.get(name, 0.0), (actual - expected).abs().max().item())

    with torch.no_grad():
        references = [_full_logits(model, seq) for seq in sequences]
        # Prefill of left-padded prompts, then decode steps; sequences dropped half-way.
        input_ids, mask = _left_pad([seq[: len(seq) - NUM_STEPS] for seq in sequences])
        logits, cache = model.prefill(input_ids, mask, return_all_logits=True)
        for row, seq in enumerate(sequences):
            prompt_len = len(seq) - NUM_STEPS
            record("prefill", logits[row, -prompt_len:], references[row][:prompt_len])
        active = list(range(len(sequences)))
        for step in range(NUM_STEPS):
            if step == KEEP_AFTER:
                active = [2, 0]
                cache = cache.select(torch.tensor(active))
            tokens = torch.stack([sequences[row][len(sequences[row]) - NUM_STEPS + step] for row in active])
            step_logits, cache = model.decode_step(tokens, cache)
            for slot, row in enumerate(active):
                record("decode", step_logits[slot], references[row][len(sequences[row]) - NUM_STEPS + step])
        # The plain forward with a padding mask.
        padded_ids, padded_mask = _left_pad(sequences)
        positions = (padded_mask.long().cumsum(-1) - 1).clamp(min=0)
        padded = model(padded_ids, positions, padded_mask)
        for row, seq in enumerate(sequences):
            from megatron.core import tensor_parallel

            full = tensor_parallel.gather_from_tensor_model_parallel_region(padded[row, -len(seq) :])
            record("padded_forward", full, references[row])
        # Packed documents in one row.
        lengths = torch.tensor([len(seq) for seq in sequences])
        cu_seqlens = torch.cat((torch.zeros(1, dtype=torch.long), lengths.cumsum(0))).int()
        packed = model(torch.cat(sequences)[None], packed_seq_params=PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
            max_seqlen_q=int(lengths.max()), max_seqlen_kv=int(lengths.max()),
        ))
        from megatron.core import tensor_parallel

        packed = tensor_parallel.gather_from_tensor_model_parallel_region(packed[0])
        for row, piece in enumerate(packed.split(lengths.tolist())):
            record("packed_forward", piece, references[row])
    return {"errors": errors, "references": references, "scale": max(r.abs().max().item() for r in references)}


@pytest.fixture(scope="module")
def tp1(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("decode_ckpt")
    (result,) = run_distributed(_decode_checks, 1, {}, save_dir=str(ckpt))
    return result, str(ckpt)


@pytest.fixture(scope="module")
def tp2(tp1):
    _, ckpt = tp1
    return run_distributed(_decode_checks, 2, {"tensor_model_parallel_size": 2}, load_dir=ckpt)


@pytest.mark.parametrize("check", ["prefill", "decode", "padded_forward", "packed_forward"])
def test_tp1(tp1, check):
    result, _ = tp1
    assert result["scale"] > 1.0, "the test model must produce non-trivial logits"
    assert result["errors"][check] <= TOLERANCE, f"{check}: max abs error {result['errors'][check]:.2e}"


@pytest.mark.parametrize("check", ["prefill", "decode", "padded_forward", "packed_forward"])
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
