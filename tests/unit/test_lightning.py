"""Block-wise lightning attention against the token-by-token recurrence (fp64, small block size)."""

import pytest
import torch

from megacispo.models import lightning
from megacispo.models.lightning import (
    lightning_attention,
    lightning_attention_reference,
    lightning_decay_rates,
    lightning_decode_step,
)

BLOCK = 16
HEADS = 3
HEAD_DIM = 8
# A slow, a medium and a fast decay: exp(-0.02 * 16) keeps most of the state across a block.
DECAY = torch.tensor([0.02, 0.3, 1.7], dtype=torch.float64)
EXACT = dict(rtol=0, atol=1e-10)


def random_qkv(batch: int, seq_len: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(batch, seq_len, HEADS, HEAD_DIM, dtype=torch.float64, generator=gen) for _ in range(3))


def random_state(num: int, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num, HEADS, HEAD_DIM, HEAD_DIM, dtype=torch.float64, generator=gen)


def leaf(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.clone().requires_grad_(True) for t in tensors]


def weighted_loss(out: torch.Tensor, final_state: torch.Tensor, seed: int = 2) -> torch.Tensor:
    """Random weights so every output element and final-state entry gets its own gradient."""
    gen = torch.Generator().manual_seed(seed)
    out_weights = torch.randn(out.shape, dtype=out.dtype, generator=gen)
    state_weights = torch.randn(final_state.shape, dtype=out.dtype, generator=gen)
    return (out * out_weights).sum() + (final_state * state_weights).sum()


LENGTHS = [1, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 7]


@pytest.fixture(params=[2, None], ids=["chunk=2blocks", "chunk=default"])
def chunk_blocks(request, monkeypatch) -> None:
    """Blocks are processed in chunks; small chunks make the state cross chunk boundaries."""
    if request.param is not None:
        monkeypatch.setattr(lightning, "CHUNK_TOKENS", request.param * BLOCK)


@pytest.mark.parametrize("with_initial_state", [False, True])
@pytest.mark.parametrize("seq_len", LENGTHS)
def test_blockwise_matches_recurrence(seq_len: int, with_initial_state: bool, chunk_blocks) -> None:
    q, k, v = random_qkv(2, seq_len)
    initial_state = random_state(2) if with_initial_state else None
    expected_out, expected_state = lightning_attention_reference(q, k, v, DECAY, initial_state)
    out, final_state = lightning_attention(q, k, v, DECAY, initial_state, block_size=BLOCK)
    torch.testing.assert_close(out, expected_out, **EXACT)
    torch.testing.assert_close(final_state, expected_state, **EXACT)


def test_model_decay_rates_and_default_block_size() -> None:
    # The real rates (down to 2^-8 at the last head) with the default block of 256 and a tail.
    q, k, v = random_qkv(1, 300)
    decay = lightning_decay_rates(HEADS, layer_idx=2, num_layers=8, dtype=torch.float64)
    expected_out, expected_state = lightning_attention_reference(q, k, v, decay)
    out, final_state = lightning_attention(q, k, v, decay)
    torch.testing.assert_close(out, expected_out, rtol=1e-12, atol=1e-10)
    torch.testing.assert_close(final_state, expected_state, rtol=1e-12, atol=1e-10)


def test_fp32_stays_fp32_and_close_to_fp64() -> None:
    q, k, v = random_qkv(1, 3 * BLOCK + 7)
    expected_out, _ = lightning_attention_reference(q, k, v, DECAY)
    out, final_state = lightning_attention(q.float(), k.float(), v.float(), DECAY.float(), block_size=BLOCK)
    assert out.dtype == final_state.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected_out, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("with_initial_state", [False, True])
@pytest.mark.parametrize("seq_len", [1, BLOCK, BLOCK + 1, 3 * BLOCK + 7])
def test_gradients_match_autograd_through_recurrence(seq_len: int, with_initial_state: bool, chunk_blocks) -> None:
    q, k, v = random_qkv(2, seq_len)
    inputs = [q, k, v] + ([random_state(2)] if with_initial_state else [])

    ref_inputs = leaf(*inputs)
    weighted_loss(*lightning_attention_reference(*ref_inputs[:3], DECAY, *ref_inputs[3:])).backward()
    test_inputs = leaf(*inputs)
    weighted_loss(*lightning_attention(*test_inputs[:3], DECAY, *test_inputs[3:], block_size=BLOCK)).backward()

    for name, ref, got in zip(["q", "k", "v", "initial_state"], ref_inputs, test_inputs):
        torch.testing.assert_close(got.grad, ref.grad, **EXACT, msg=f"gradient of {name}")


def test_chunks_without_padding_are_moved_without_an_index() -> None:
    # Front padding to whole blocks sits in the first chunk of each document; the others are dense.
    chunks = lightning._BlockLayout.build((3 * BLOCK + 7, 2 * BLOCK), BLOCK, 2, torch.device("cpu")).chunks
    assert [chunk.dense for chunk in chunks] == [False, True, True]
    q, k, v = random_qkv(2, 4 * BLOCK)
    blocks = lightning._gather_chunk(q, chunks[1], BLOCK)  # [b, h, G, B, d]
    assert blocks.is_contiguous() and blocks.untyped_storage().data_ptr() != q.untyped_storage().data_ptr()
    tokens = slice(chunks[1].token_start, chunks[1].token_end)
    torch.testing.assert_close(blocks.flatten(2, 3), q[:, tokens].transpose(1, 2), **EXACT)
    out = torch.zeros_like(q)
    lightning._scatter_chunk(out, blocks, chunks[1])
    torch.testing.assert_close(out[:, tokens], q[:, tokens], **EXACT)


def test_strided_views_of_one_qkv_tensor() -> None:
    # The model splits one projection [b, n, h, 3d] into q, k, v views: no copies needed.
    q, k, v = random_qkv(1, 2 * BLOCK + 3)
    qkv = torch.cat([q, k, v], dim=-1).requires_grad_(True)
    out, final_state = lightning_attention(*qkv.split(HEAD_DIM, dim=-1), DECAY, block_size=BLOCK)
    weighted_loss(out, final_state).backward()

    ref_inputs = leaf(q, k, v)
    weighted_loss(*lightning_attention_reference(*ref_inputs, DECAY)).backward()
    torch.testing.assert_close(qkv.grad, torch.cat([x.grad for x in ref_inputs], dim=-1), **EXACT)


@pytest.mark.parametrize("chunk_tokens", [3, None])
def test_gradcheck_tiny(chunk_tokens: int | None, monkeypatch) -> None:
    if chunk_tokens is not None:
        monkeypatch.setattr(lightning, "CHUNK_TOKENS", chunk_tokens)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 7, 2, 2, dtype=torch.float64, generator=gen, requires_grad=True) for _ in range(3))
    initial_state = torch.randn(1, 2, 2, 2, dtype=torch.float64, generator=gen, requires_grad=True)
    decay = torch.tensor([0.1, 0.9], dtype=torch.float64)

    def blockwise(q, k, v, initial_state):
        return lightning_attention(q, k, v, decay, initial_state, block_size=3)

    def packed(q, k, v, initial_state):
        cu_seqlens = torch.tensor([0, 1, 5, 7])
        return lightning_attention(q, k, v, decay, initial_state.expand(3, -1, -1, -1), cu_seqlens, block_size=3)

    assert torch.autograd.gradcheck(blockwise, (q, k, v, initial_state))
    assert torch.autograd.gradcheck(packed, (q, k, v, initial_state))


# Length 1, a document ending exactly on a block, ones crossing one and several block boundaries.
DOC_LENGTHS = [1, 5, BLOCK, BLOCK + 3, 2, 2 * BLOCK + 9, 1]


@pytest.mark.parametrize("with_initial_state", [False, True])
def test_packed_equals_separate_documents(with_initial_state: bool, chunk_blocks) -> None:
    cu_seqlens = torch.tensor([0] + DOC_LENGTHS).cumsum(0).to(torch.int32)
    q, k, v = random_qkv(1, sum(DOC_LENGTHS))
    inputs = [q, k, v] + ([random_state(len(DOC_LENGTHS))] if with_initial_state else [])

    packed_inputs = leaf(*inputs)
    out, final_states = lightning_attention(
        *packed_inputs[:3], DECAY, *packed_inputs[3:], cu_seqlens=cu_seqlens, block_size=BLOCK
    )
    weighted_loss(out, final_states).backward()

    separate_inputs = leaf(*inputs)
    separate_outs, separate_states = [], []
    for doc, (start, end) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())):
        doc_qkv = [x[:, start:end] for x in separate_inputs[:3]]
        doc_state = [separate_inputs[3][doc : doc + 1]] if with_initial_state else []
        doc_out, doc_final = lightning_attention_reference(*doc_qkv, DECAY, *doc_state)
        separate_outs.append(doc_out)
        separate_states.append(doc_final)
    expected_out, expected_states = torch.cat(separate_outs, dim=1), torch.cat(separate_states)
    weighted_loss(expected_out, expected_states).backward()

    torch.testing.assert_close(out, expected_out, **EXACT)
    torch.testing.assert_close(final_states, expected_states, **EXACT)
    for name, ref, got in zip(["q", "k", "v", "initial_state"], separate_inputs, packed_inputs):
        torch.testing.assert_close(got.grad, ref.grad, **EXACT, msg=f"gradient of {name}")


@pytest.mark.parametrize("prefill_len", [1, BLOCK + 5])
def test_prefill_then_decode_equals_full_pass(prefill_len: int) -> None:
    q, k, v = random_qkv(2, prefill_len + 6)
    full_out, full_state = lightning_attention(q, k, v, DECAY, block_size=BLOCK)

    out, state = lightning_attention(
        q[:, :prefill_len], k[:, :prefill_len], v[:, :prefill_len], DECAY, block_size=BLOCK
    )
    decoded = [out]
    for t in range(prefill_len, q.shape[1]):
        step_out, state = lightning_decode_step(q[:, t], k[:, t], v[:, t], DECAY, state)
        decoded.append(step_out.unsqueeze(1))
    torch.testing.assert_close(torch.cat(decoded, dim=1), full_out, **EXACT)
    torch.testing.assert_close(state, full_state, **EXACT)


@pytest.mark.parametrize(
    "num_heads, num_layers, layer_indices",
    [(4, 8, range(8)), (64, 80, [0, 1, 7, 40, 78, 79]), (3, 1, [0]), (5, 2, [0, 1])],
)
def test_decay_rates_match_hf_buffers(num_heads: int, num_layers: int, layer_indices) -> None:
    minimax = pytest.importorskip("transformers.models.minimax.modeling_minimax")
    config = minimax.MiniMaxConfig(
        hidden_size=8,
        num_attention_heads=num_heads,
        num_key_value_heads=1,
        head_dim=2,
        num_hidden_layers=num_layers,
        layer_types=["linear_attention"] * num_layers,
        block_size=4,
    )
    for layer_idx in layer_indices:
        hf_rates = minimax.MiniMaxLightningAttention(config, layer_idx).slope_rate.flatten()
        rates = lightning_decay_rates(num_heads, layer_idx, num_layers)
        assert hf_rates.dtype == rates.dtype == torch.float32
        assert torch.equal(rates, hf_rates), (layer_idx, rates, hf_rates)
        rates64 = lightning_decay_rates(num_heads, layer_idx, num_layers, dtype=torch.float64)
        torch.testing.assert_close(rates64.float(), hf_rates, rtol=1e-6, atol=0)


def test_decay_rates_formula() -> None:
    # MODEL.md: s_h = 2^(-8 (h+1) / nh) * (1 - l / (L - 1 + 1e-5) + 1e-5).
    rates = lightning_decay_rates(8, layer_idx=3, num_layers=10, dtype=torch.float64)
    heads = torch.arange(8, dtype=torch.float64)
    expected = 2 ** (-8 * (heads + 1) / 8) * (1 - 3 / (9 + 1e-5) + 1e-5)
    torch.testing.assert_close(rates, expected, rtol=1e-14, atol=0)
    assert bool((lightning_decay_rates(8, 79, 80) > 0).all())
    with pytest.raises(ValueError, match="layer_idx"):
        lightning_decay_rates(8, 10, 10)


def test_bad_inputs_raise_value_error_naming_the_argument() -> None:
    q, k, v = random_qkv(2, 5)
    with pytest.raises(ValueError, match="^k must"):
        lightning_attention(q, k[:, :4], v, DECAY)
    with pytest.raises(ValueError, match="^v must"):
        lightning_attention(q, k, v[..., :4], DECAY)
    with pytest.raises(ValueError, match="^q must"):
        lightning_attention(q[0], k[0], v[0], DECAY)
    for bad_decay in (torch.tensor([0.1, 0.0, 0.2]), torch.tensor([0.1, -1.0, 0.2]), DECAY[:2]):
        with pytest.raises(ValueError, match="^decay"):
            lightning_attention(q, k, v, bad_decay)
    with pytest.raises(ValueError, match="^cu_seqlens.*batch 1"):
        lightning_attention(q, k, v, DECAY, cu_seqlens=torch.tensor([0, 2, 5]))
    with pytest.raises(ValueError, match="^cu_seqlens"):
        lightning_attention(q[:1], k[:1], v[:1], DECAY, cu_seqlens=torch.tensor([0, 2, 4]))
    with pytest.raises(ValueError, match="^cu_seqlens"):
        lightning_attention(q[:1], k[:1], v[:1], DECAY, cu_seqlens=torch.tensor([0, 2, 2, 5]))
    with pytest.raises(ValueError, match="^initial_state"):
        lightning_attention(q, k, v, DECAY, initial_state=random_state(3))
    with pytest.raises(ValueError, match="^block_size"):
        lightning_attention(q, k, v, DECAY, block_size=0)
    with pytest.raises(ValueError, match="^state"):
        lightning_decode_step(q[:, 0], k[:, 0], v[:, 0], DECAY, random_state(1))
