"""Vocab-parallel log-probs, entropy and the fused tiled LM head against fp64 torch.log_softmax.

In one process (tp_group=None) and in one real 2-rank gloo run that covers TP=2 for logits and
for the fused head, with and without sequence parallelism, through Megatron-Core's own mappings.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megacispo.parallel import vocab_parallel
from megacispo.parallel.vocab_parallel import (
    LOGITS_TILE_BYTES,
    MIN_VOCAB_CHUNK,
    default_tile,
    lm_head_input,
    lm_head_logprobs,
    vocab_parallel_entropy,
    vocab_parallel_logprobs,
    vocab_shard_range,
)
from megacispo.testing.harness import run_distributed

VOCAB = 1000
HIDDEN = 32
TOKENS = 37
TP = 2
# (tokens, vocabulary columns) per tile: single tokens and columns, tiles that divide nothing, whole rows.
TILES = ((TOKENS, 1), (7, 333), (1, VOCAB), (TOKENS + 5, VOCAB + 1))
# fp32 precision at these magnitudes: sums over 1000 vocabulary entries round at ~1e-6.
FP32_TOL = dict(atol=2e-6, rtol=1e-6)
# A gradient returned in bf16 is the fp32 one rounded: off by at most 2^-9 of its value.
BF16_GRAD_TOL = dict(atol=1e-7, rtol=4e-3)


def _inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    """Random fp32 inputs; the first targets sit on every shard boundary of the TP=2 split."""
    gen = torch.Generator().manual_seed(seed)
    width = VOCAB // TP
    boundaries = [i for rank in range(TP) for i in (rank * width, (rank + 1) * width - 1)]
    targets = torch.randint(0, VOCAB, (TOKENS,), generator=gen)
    targets[: len(boundaries)] = torch.tensor(boundaries)
    return {
        # Scale 4: a peaked distribution, log-probs from ~0 to ~-25.
        "logits": 4 * torch.randn(TOKENS, VOCAB, generator=gen),
        "hidden": torch.randn(TOKENS, HIDDEN, generator=gen),
        "weight": 0.3 * torch.randn(VOCAB, HIDDEN, generator=gen),
        "targets": targets,
        "grad_logprobs": torch.randn(TOKENS, generator=gen),
    }


def _reference(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64 (logprobs, entropy) of [..., V] logits."""
    log_probs = torch.log_softmax(logits.double(), dim=-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return log_probs.gather(-1, targets[..., None]).squeeze(-1), entropy


def _reference_grads(inputs: dict, *names: str) -> dict[str, torch.Tensor]:
    """fp64 logprobs, entropy and gradients of sum(grad_logprobs * logprobs) w.r.t. ``names``."""
    leaves = {name: inputs[name].double().requires_grad_(True) for name in names}
    logits = leaves["logits"] if "logits" in leaves else leaves["hidden"] @ leaves["weight"].T
    logprobs, entropy = _reference(logits, inputs["targets"])
    grads = torch.autograd.grad((logprobs * inputs["grad_logprobs"].double()).sum(), list(leaves.values()))
    return {"logprobs": logprobs.detach(), "entropy": entropy.detach(), **dict(zip(names, grads))}


def _close(actual: torch.Tensor, expected: torch.Tensor, **tol) -> None:
    torch.testing.assert_close(actual.double(), expected.double(), **(tol or FP32_TOL))


# ---------------------------------------------------------------------------------------------
# One process
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_entropy_and_grad_match_fp64(dtype):
    inputs = _inputs()
    inputs["logits"] = inputs["logits"].to(dtype)  # the reference sees the same rounded values
    expected = _reference_grads(inputs, "logits")
    logits = inputs["logits"].clone().requires_grad_(True)
    logprobs = vocab_parallel_logprobs(logits, inputs["targets"])
    (logprobs * inputs["grad_logprobs"]).sum().backward()
    entropy = vocab_parallel_entropy(logits)

    assert logprobs.dtype == entropy.dtype == torch.float32
    assert logits.grad.dtype == dtype
    _close(logprobs, expected["logprobs"])
    _close(entropy, expected["entropy"])
    grad_tol = FP32_TOL if dtype == torch.float32 else BF16_GRAD_TOL
    _close(logits.grad, expected["logits"], **grad_tol)


def test_logprobs_keep_leading_dims_and_survive_huge_logits():
    inputs = _inputs()
    logits = (inputs["logits"][:36] + 1e4).view(4, 9, VOCAB)  # exp(1e4) overflows even fp64
    targets = inputs["targets"][:36].view(4, 9)
    expected_logprobs, expected_entropy = _reference(logits, targets)
    logprobs = vocab_parallel_logprobs(logits, targets)
    assert logprobs.shape == (4, 9)
    _close(logprobs, expected_logprobs)
    _close(vocab_parallel_entropy(logits), expected_entropy)


def test_fp64_inputs_pass_gradcheck():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 11, dtype=torch.float64, generator=gen, requires_grad=True)
    hidden = torch.randn(5, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    weight = torch.randn(11, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    targets = torch.tensor([0, 10, 3, 3, 7])
    assert torch.autograd.gradcheck(lambda z: vocab_parallel_logprobs(z, targets), (logits,))
    head = lambda h, w: lm_head_logprobs(h, w, targets, chunk_size=2, vocab_chunk_size=3)[0]  # noqa: E731
    assert torch.autograd.gradcheck(head, (hidden, weight))


@pytest.mark.parametrize("keep_logits", [True, False], ids=["kept", "recomputed"])
@pytest.mark.parametrize("tile", TILES + ((None, None),))
def test_fused_head_matches_fp64_for_every_tile(tile, keep_logits, monkeypatch):
    if not keep_logits:
        monkeypatch.setattr(vocab_parallel, "LOGITS_KEEP_BYTES", 0)
    inputs = _inputs()
    expected = _reference_grads(inputs, "hidden", "weight")
    hidden = inputs["hidden"].clone().requires_grad_(True)
    weight = inputs["weight"].clone().requires_grad_(True)
    logprobs, entropy = lm_head_logprobs(
        hidden, weight, inputs["targets"], chunk_size=tile[0], vocab_chunk_size=tile[1], compute_entropy=True
    )
    (logprobs * inputs["grad_logprobs"]).sum().backward()

    assert logprobs.dtype == entropy.dtype == torch.float32
    assert not entropy.requires_grad
    _close(logprobs, expected["logprobs"])
    _close(entropy, expected["entropy"])
    _close(hidden.grad, expected["hidden"])
    _close(weight.grad, expected["weight"])


def test_fused_head_bf16_computes_in_fp32():
    inputs = _inputs()
    inputs["hidden"] = inputs["hidden"].bfloat16()
    inputs["weight"] = inputs["weight"].bfloat16()
    expected = _reference_grads(inputs, "hidden", "weight")
    hidden = inputs["hidden"].clone().requires_grad_(True)
    weight = inputs["weight"].clone().requires_grad_(True)
    logprobs, entropy = lm_head_logprobs(hidden, weight, inputs["targets"], chunk_size=7, vocab_chunk_size=300)
    (logprobs * inputs["grad_logprobs"]).sum().backward()

    assert entropy is None
    assert logprobs.dtype == torch.float32
    assert (hidden.grad.dtype, weight.grad.dtype) == (torch.bfloat16, torch.bfloat16)
    # Far tighter than bf16 (~4e-3): the matmul and everything after it ran in fp32.
    _close(logprobs, expected["logprobs"])
    _close(hidden.grad, expected["hidden"], **BF16_GRAD_TOL)
    _close(weight.grad, expected["weight"], **BF16_GRAD_TOL)


def test_fused_head_without_grad_keeps_no_graph():
    inputs = _inputs()
    with torch.no_grad():
        logprobs, _ = lm_head_logprobs(inputs["hidden"], inputs["weight"].requires_grad_(True), inputs["targets"])
    assert not logprobs.requires_grad
    _close(logprobs, _reference_grads(inputs, "hidden", "weight")["logprobs"])


def test_empty_batch_gives_empty_results_and_zero_grads():
    inputs = _inputs()
    hidden = inputs["hidden"][:0].clone().requires_grad_(True)
    weight = inputs["weight"].clone().requires_grad_(True)
    logprobs, entropy = lm_head_logprobs(hidden, weight, inputs["targets"][:0], compute_entropy=True)
    logprobs.sum().backward()
    assert logprobs.shape == entropy.shape == (0,)
    assert hidden.grad.shape == (0, HIDDEN) and not weight.grad.any()
    assert vocab_parallel_logprobs(inputs["logits"][:0], inputs["targets"][:0]).shape == (0,)


def test_vocab_shard_range_and_default_tile():
    assert [vocab_shard_range(VOCAB, rank, 4) for rank in range(4)] == [(0, 250), (250, 500), (500, 750), (750, 1000)]
    with pytest.raises(ValueError, match="vocab_size = 1001 .* pad the vocabulary"):
        vocab_shard_range(1001, 0, 2)
    with pytest.raises(ValueError, match="tp_rank = 2"):
        vocab_shard_range(VOCAB, 2, 2)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    # Few tokens: whole rows of the shard; many: narrower tiles, never under MIN_VOCAB_CHUNK columns.
    assert default_tile(10, 50_000, cpu) == (LOGITS_TILE_BYTES["cpu"] // (4 * 50_000), 50_000)
    tokens, columns = default_tile(100_000, 50_000, cuda)
    assert columns == MIN_VOCAB_CHUNK and tokens * columns * 4 <= LOGITS_TILE_BYTES["cuda"]
    tokens, columns = default_tile(1536, 16_384, cpu)
    assert tokens * columns * 4 <= LOGITS_TILE_BYTES["cpu"] < (tokens + 1) * columns * 4
    assert default_tile(1, 10**9, cpu) == (1, LOGITS_TILE_BYTES["cpu"] // 4)


def test_bad_inputs_raise_value_error_naming_the_argument():
    inputs = _inputs()
    logits, hidden, weight, targets = inputs["logits"], inputs["hidden"], inputs["weight"], inputs["targets"]
    cases = [
        (lambda: vocab_parallel_logprobs(logits, torch.full((TOKENS,), VOCAB)), r"targets .* outside .*\[0, 1000\)"),
        (lambda: vocab_parallel_logprobs(logits, torch.full((TOKENS,), -100)), r"targets .*\(e\.g\. -100\)"),
        (lambda: vocab_parallel_logprobs(logits, targets[:-1]), r"targets has shape \(36,\) but logits"),
        (lambda: vocab_parallel_logprobs(logits, targets.float()), "targets has dtype torch.float32"),
        (lambda: vocab_parallel_logprobs(logits, targets, vocab_start_index=500), "vocab_start_index = 500"),
        (lambda: vocab_parallel_entropy(logits[:, :0]), "logits has shape"),
        (lambda: lm_head_logprobs(hidden, weight, torch.full((TOKENS,), VOCAB)), "targets .* outside"),
        (lambda: lm_head_logprobs(hidden, weight, targets[None]), r"targets has shape \(1, 37\) but hidden"),
        (lambda: lm_head_logprobs(hidden[:, :-1], weight, targets), r"hidden has shape \(37, 31\) but weight"),
        (lambda: lm_head_logprobs(hidden, weight[None], targets), "weight has shape"),
        (lambda: lm_head_logprobs(hidden, weight, targets, chunk_size=0), "chunk_size = 0"),
        (lambda: lm_head_logprobs(hidden, weight, targets, vocab_chunk_size=-1), "vocab_chunk_size = -1"),
        (lambda: lm_head_input(hidden, None, sequence_parallel=True), "sequence_parallel"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()
    # Without the range check the call goes through (the caller vouches for the ids).
    vocab_parallel_logprobs(logits, torch.full((TOKENS,), VOCAB), check_targets=False)


# ---------------------------------------------------------------------------------------------
# TP = 2 in real gloo processes
# ---------------------------------------------------------------------------------------------


def _fused_head(hidden, weight, targets, grad_logprobs, group, tile=(None, None), sequence_parallel=None):
    """Fused head + backward; ``sequence_parallel`` None: no input mapping (the raw partial grad)."""
    hidden = hidden.clone().requires_grad_(True)
    weight = weight.clone().requires_grad_(True)
    head_input = hidden if sequence_parallel is None else lm_head_input(hidden, group, sequence_parallel)
    logprobs, entropy = lm_head_logprobs(head_input, weight, targets, group, *tile, compute_entropy=True)
    (logprobs * grad_logprobs).sum().backward()
    return {"logprobs": logprobs, "entropy": entropy, "hidden": hidden.grad, "weight": weight.grad}


def _fused_head_recomputed(hidden, weight, targets, grad_logprobs, group):
    """The fused head with its logits recomputed in the backward instead of kept."""
    keep_bytes = vocab_parallel.LOGITS_KEEP_BYTES
    vocab_parallel.LOGITS_KEEP_BYTES = 0
    try:
        return _fused_head(hidden, weight, targets, grad_logprobs, group, (7, 100), False)
    finally:
        vocab_parallel.LOGITS_KEEP_BYTES = keep_bytes


def _unfused_head(hidden, weight, targets, grad_logprobs, group):
    """mcore ColumnParallelLinear's forward (copy_to + linear, no bias) then vocab_parallel_logprobs."""
    from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

    hidden = hidden.clone().requires_grad_(True)
    weight = weight.clone().requires_grad_(True)
    logits = F.linear(copy_to_tensor_model_parallel_region(hidden, group=group), weight)
    logprobs = vocab_parallel_logprobs(logits, targets, group)
    (logprobs * grad_logprobs).sum().backward()
    return {"logprobs": logprobs, "hidden": hidden.grad, "weight": weight.grad}


def _logits_shard(logits, targets, grad_logprobs, group, **kwargs):
    logits = logits.clone().requires_grad_(True)
    logprobs = vocab_parallel_logprobs(logits, targets, group, **kwargs)
    (logprobs * grad_logprobs).sum().backward()
    return {"logprobs": logprobs, "entropy": vocab_parallel_entropy(logits, group), "logits": logits.grad}


def _expect_value_error(call) -> str:
    try:
        call()
    except ValueError as error:
        return str(error)
    return "no ValueError"


def _tp_worker(inputs: dict) -> dict:
    from megatron.core import parallel_state

    from megacispo.parallel.layout import ParallelConfig, init_distributed

    init_distributed(ParallelConfig(tensor_model_parallel_size=TP), seed=0)
    group = parallel_state.get_tensor_model_parallel_group()
    rank = torch.distributed.get_rank(group)
    start, end = vocab_shard_range(VOCAB, rank, TP)
    logits, targets, grad = inputs["logits"][:, start:end], inputs["targets"], inputs["grad_logprobs"]
    hidden, weight = inputs["hidden"], inputs["weight"][start:end]
    sp_tokens = TOKENS - TOKENS % TP
    sp_slice = slice(rank * sp_tokens // TP, (rank + 1) * sp_tokens // TP)
    return {
        "logits_fp32": _logits_shard(logits, targets, grad, group),
        "logits_explicit_start": _logits_shard(logits, targets, grad, group, vocab_start_index=start),
        "logits_bf16": _logits_shard(logits.bfloat16(), targets, grad, group),
        "fused": {tile: _fused_head(hidden, weight, targets, grad, group, tile, False) for tile in TILES},
        "fused_partial": _fused_head(hidden, weight, targets, grad, group, (7, 100)),
        "fused_recomputed": _fused_head_recomputed(hidden, weight, targets, grad, group),
        "fused_sp": _fused_head(
            hidden[sp_slice], weight, targets[:sp_tokens], grad[:sp_tokens], group, (7, 100), sequence_parallel=True
        ),
        "unfused": _unfused_head(hidden, weight, targets, grad, group),
        "error_target": _expect_value_error(
            lambda: vocab_parallel_logprobs(logits, torch.full_like(targets, VOCAB), group)
        ),
        "error_start": _expect_value_error(
            lambda: vocab_parallel_logprobs(logits, targets, group, vocab_start_index=7)
        ),
    }


@pytest.fixture(scope="module")
def tp_results():
    inputs = _inputs()
    return inputs, run_distributed(_tp_worker, TP, inputs, timeout_s=120)


def _shard(tensor: torch.Tensor, rank: int) -> torch.Tensor:
    start, end = vocab_shard_range(VOCAB, rank, TP)
    return tensor[..., start:end] if tensor.shape[-1] == VOCAB else tensor[start:end]


def test_tp2_logits_match_single_process_fp64(tp_results):
    inputs, results = tp_results
    expected = _reference_grads(inputs, "logits")
    for rank, result in enumerate(results):
        for key in ("logits_fp32", "logits_explicit_start"):
            _close(result[key]["logprobs"], expected["logprobs"])
            _close(result[key]["entropy"], expected["entropy"])
            _close(result[key]["logits"], _shard(expected["logits"], rank))
        assert result["logits_bf16"]["logprobs"].dtype == torch.float32
    bf16_inputs = {**inputs, "logits": inputs["logits"].bfloat16()}
    expected_bf16 = _reference_grads(bf16_inputs, "logits")
    for rank, result in enumerate(results):
        _close(result["logits_bf16"]["logprobs"], expected_bf16["logprobs"])
        _close(result["logits_bf16"]["logits"], _shard(expected_bf16["logits"], rank), **BF16_GRAD_TOL)


def test_tp2_fused_head_matches_single_process_fp64(tp_results):
    inputs, results = tp_results
    expected = _reference_grads(inputs, "hidden", "weight")
    for rank, result in enumerate(results):
        for fused in (*result["fused"].values(), result["fused_recomputed"]):
            _close(fused["logprobs"], expected["logprobs"])
            _close(fused["entropy"], expected["entropy"])
            # copy_to_tensor_model_parallel_region's backward all-reduced the per-shard partials.
            _close(fused["hidden"], expected["hidden"])
            _close(fused["weight"], _shard(expected["weight"], rank))
            _close(fused["logprobs"], result["unfused"]["logprobs"])
            _close(fused["hidden"], result["unfused"]["hidden"])
            _close(fused["weight"], result["unfused"]["weight"])


def test_tp2_fused_head_grad_hidden_is_the_per_shard_partial(tp_results):
    """Without the input mapping, grad_hidden is this rank's share: the sum over ranks is the full grad."""
    inputs, results = tp_results
    expected = _reference_grads(inputs, "hidden", "weight")["hidden"]
    partials = [result["fused_partial"]["hidden"] for result in results]
    _close(sum(partials), expected)
    assert (partials[0] - expected).abs().max() > 1e-2


def test_tp2_sequence_parallel_gather_reduce_scatters_grad_hidden(tp_results):
    inputs, results = tp_results
    sp_tokens = TOKENS - TOKENS % TP
    sp_inputs = {key: value[:sp_tokens] if key != "weight" else value for key, value in inputs.items()}
    expected = _reference_grads(sp_inputs, "hidden", "weight")
    for rank, result in enumerate(results):
        sp = result["fused_sp"]
        rows = slice(rank * sp_tokens // TP, (rank + 1) * sp_tokens // TP)
        _close(sp["logprobs"], expected["logprobs"])
        _close(sp["hidden"], expected["hidden"][rows])  # this rank's slice of the sequence, summed over ranks
        _close(sp["weight"], _shard(expected["weight"], rank))


def test_tp2_bad_inputs_raise_on_every_rank(tp_results):
    _, results = tp_results
    for result in results:
        assert "outside the vocabulary [0, 1000)" in result["error_target"]
        assert "vocab_start_index = 7" in result["error_start"]
