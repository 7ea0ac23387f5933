"""Every branch of models/ on a device (``.is_cuda``, ``.device.type``, ``device.type``) runs its GPU arm in a
CPU test, on fake CUDA tensors (megacispo.testing.fake_cuda: torch's shape functions with the CUDA
kernels' argument checks) or on meta tensors, so that a wrong argument order, dtype, shape or stride
fails here and not on the first GPU. ``ARMS`` lists each branch and the tests that run its arms; a
branch added to models/ without a line there fails ``test_every_device_branch_in_models_is_listed``.

What these tensors cannot show: which SDPA kernel CUDA picks (a CPU build's fake CUDA tensors take the
math path), and numbers (the CPU paths' numbers are tested elsewhere against references)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from megacispo.testing.fake_cuda import fake_cuda

ROOT = Path(__file__).resolve().parents[2]
HERE = "tests/unit/test_gpu_arms.py"
# (file, function with the branch) -> the tests that run its GPU arm (and, where elsewhere, its CPU arm).
ARMS = {
    ("models/lightning.py", "lightning_attention"): [
        f"{HERE}::test_lightning_attention_on_cuda_launches_the_triton_kernels",
        "tests/unit/test_lightning.py::test_blockwise_matches_recurrence"],
    ("models/lightning_checks.py", "check_decay"): [
        f"{HERE}::test_lightning_attention_on_cuda_launches_the_triton_kernels",
        "tests/unit/test_lightning.py::test_bad_inputs_raise_value_error_naming_the_argument"],
    ("models/lightning_triton.py", "_check_runtime"): [
        "tests/unit/test_triton_aot.py::test_every_kernel_compiles_for_sm90_and_sm80_within_the_bounds",
        "tests/unit/test_lightning_triton.py::test_cpu_without_interpreter_raises_clear_error"],
    ("models/experts_triton.py", "_check_runtime"): [
        "tests/unit/test_triton_aot.py::test_every_kernel_compiles_for_sm90_and_sm80_within_the_bounds",
        "tests/unit/test_experts_triton.py::test_cpu_without_interpreter_raises_clear_error"],
    ("models/softmax_attention.py", "attend_documents"): [
        f"{HERE}::test_packed_rows_on_cuda_take_torchs_varlen_flash_attention_in_bf16",
        f"{HERE}::test_packed_rows_on_cuda_in_fp32_take_the_masked_kernel",
        "tests/unit/test_softmax_packed.py::test_packed_attention_matches_each_document_alone"],
    ("models/softmax_cp.py", "masked_attention"): [f"{HERE}::test_masked_attention_on_cuda_repeats_kv_heads"],
    ("models/softmax_cp.py", "_block_forward"): [
        "tests/unit/test_ring_kernels.py::test_the_gpu_block_kernels_are_called_as_their_schemas_say"],
    ("models/softmax_cp.py", "_block_backward"): [
        "tests/unit/test_ring_kernels.py::test_the_gpu_block_kernels_are_called_as_their_schemas_say"],
    ("models/experts.py", "grouped_products_take"): [
        f"{HERE}::test_decode_experts_on_cuda_take_grouped_products_in_bf16_only"],
    ("models/model.py", "lean_compile_options"): [
        f"{HERE}::test_the_compiled_decode_step_runs_as_cuda_graphs_on_cuda"],
}


def device_branches(path: Path) -> set[tuple[str, str]]:
    """(path, innermost function) of each ``x.is_cuda``, ``x.device.type`` and ``device.type`` in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = set()

    def visit(node: ast.AST, function: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function = node.name
        if isinstance(node, ast.Attribute) and (node.attr == "is_cuda" or node.attr == "type" and (
                isinstance(node.value, ast.Attribute) and node.value.attr == "device"
                or isinstance(node.value, ast.Name) and node.value.id == "device")):
            found.add((path.as_posix(), function))
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(tree, "<module>")
    return found


def test_every_device_branch_in_models_is_listed(monkeypatch):
    monkeypatch.chdir(ROOT)
    branches = set().union(*(device_branches(path) for path in sorted(Path("models").glob("*.py"))))
    assert branches == set(ARMS)
    for tests in ARMS.values():
        for test in tests:
            path, name = test.split("::")
            assert f"def {name}(" in Path(path).read_text(), test


class _Calls(TorchFunctionMode):
    """The torch functions called within it, with their arguments."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls.append((func, args, kwargs or {}))
        return func(*args, **(kwargs or {}))


class _Ops(TorchDispatchMode):
    """The names of the ops dispatched within it."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.name())
        return func(*args, **(kwargs or {}))


def test_lightning_attention_on_cuda_launches_the_triton_kernels():
    """A forward on CUDA goes to the Triton kernels: one state scan and one block-output launch,
    recorded instead of run, and the decay's values are not read on the host (a fake tensor's would
    raise)."""
    pytest.importorskip("triton", reason="the Triton kernels need triton")
    from megacispo.models.lightning import lightning_attention
    from megacispo.testing import triton_aot

    kernels = triton_aot.project_kernels(triton_aot._LIGHTNING)
    with triton_aot.recorded_launches(kernels) as launches, fake_cuda():
        q, k, v = (torch.empty(1, 70, 2, 32, device="cuda") for _ in range(3))
        out, state = lightning_attention(q, k, v, torch.empty(2, device="cuda"))
    assert out.is_cuda and out.shape == q.shape and state.shape == (1, 2, 32, 32)
    assert [triton_aot.kernel_name(launch.kernel).rsplit(".", 1)[1] for launch in launches] == [
        "_state_scan_kernel", "_block_output_kernel"]


@pytest.mark.parametrize("kv_heads", [8, 2], ids=["mha", "gqa"])
def test_packed_rows_on_cuda_take_torchs_varlen_flash_attention_in_bf16(kv_heads):
    from megacispo.models.softmax_attention import attend_documents

    with fake_cuda(), _Ops() as ops:
        q = torch.empty(1, 8, 100, 128, dtype=torch.bfloat16, device="cuda")
        k, v = (torch.empty(1, kv_heads, 100, 128, dtype=torch.bfloat16, device="cuda") for _ in range(2))
        cu_seqlens = torch.tensor([0, 30, 31, 100], dtype=torch.int32, device="cuda")
        out = attend_documents(q, k, v, cu_seqlens, 69, 128**-0.5)
    assert out.is_cuda and out.shape == q.shape and out.dtype == torch.bfloat16
    assert "torch_attn::_varlen_attn" in ops.names


def test_packed_rows_on_cuda_in_fp32_take_the_masked_kernel(monkeypatch):
    """fp32 has no flash kernel: the arm is the block-diagonal mask (``_documents_masked``, whose numbers
    tests/unit/test_softmax_packed.py checks), called with the CUDA tensors, and run here on meta ones
    (a fake CUDA tensor cannot go through Python indexing on a CPU build of torch)."""
    from megacispo.models import softmax_attention

    chosen = []
    monkeypatch.setattr(softmax_attention, "_documents_masked", lambda q, *args: chosen.append(q.device) or q)
    with fake_cuda():
        q = torch.empty(1, 8, 20, 16, device="cuda")
        k = torch.empty(1, 2, 20, 16, device="cuda")
        softmax_attention.attend_documents(q, k, k, torch.tensor([0, 7, 20], device="cuda"), 13, 0.25)
    assert chosen == [torch.device("cuda", 0)]
    monkeypatch.undo()
    q, k = torch.empty(1, 8, 20, 16, device="meta"), torch.empty(1, 2, 20, 16, device="meta")
    out = softmax_attention._documents_masked(q, k, k, torch.tensor([0, 7, 20], device="meta"), 0.25)
    assert out.shape == q.shape and out.device.type == "meta"


def test_masked_attention_on_cuda_repeats_kv_heads():
    """A mask and GQA together would send CUDA's SDPA to its math kernel ([b, heads, s, T] scores): on
    CUDA, K and V reach SDPA with every query head's copy, and no enable_gqa; on the CPU, GQA."""
    from megacispo.models.softmax_cp import masked_attention

    def sdpa_call(device: str) -> tuple[int, bool]:
        with fake_cuda() if device == "cuda" else torch.no_grad(), _Calls() as calls:
            q = torch.empty(1, 8, 5, 16, device=device)
            k, v = (torch.empty(1, 2, 9, 16, device=device) for _ in range(2))
            mask = torch.ones(1, 1, 5, 9, dtype=torch.bool, device=device)
            out = masked_attention(q, k, v, mask, 0.25)
        assert out.shape == q.shape
        ((_, args, kwargs),) = [call for call in calls.calls if call[0] is F.scaled_dot_product_attention]
        return args[1].shape[1], kwargs["enable_gqa"]

    assert sdpa_call("cuda") == (8, False)
    assert sdpa_call("cpu") == (2, True)


def test_prefill_and_extend_on_cuda_pass_no_mask_with_gqa_to_sdpa():
    """The softmax layer's prefill and extend attend under a padding mask: on CUDA, SDPA gets the mask
    with K and V repeated to every query head (its memory-efficient kernel), never a mask with GQA
    (its math kernel: [b, heads, s, T] fp32 scores); an unmasked causal call keeps GQA (flash)."""
    from types import SimpleNamespace

    from megacispo.models.softmax_attention import SoftmaxAttention

    layer = SimpleNamespace(head_dim=16)  # all that _attend reads of its layer
    with fake_cuda(), _Calls() as calls:
        q = torch.empty(3, 8, 5, 16, dtype=torch.bfloat16, device="cuda")
        k, v = (torch.empty(3, 2, 9, 16, dtype=torch.bfloat16, device="cuda") for _ in range(2))
        SoftmaxAttention._attend(layer, q, k, v, torch.ones(3, 1, 5, 9, dtype=torch.bool, device="cuda"))
        SoftmaxAttention._attend(layer, q, k.narrow(2, 0, 5), v.narrow(2, 0, 5), None)
    masked, causal = [(args, kwargs) for func, args, kwargs in calls.calls if func is F.scaled_dot_product_attention]
    assert masked[1]["attn_mask"] is not None and masked[0][1].shape[1] == 8 and not masked[1]["enable_gqa"]
    assert causal[1].get("attn_mask") is None and causal[1]["is_causal"] and causal[1]["enable_gqa"]


def test_decode_experts_on_cuda_take_grouped_products_in_bf16_only():
    """CUDA's grouped GEMM takes bf16 with rows of a multiple of 16 bytes (its shape function says so
    on fake CUDA tensors): bf16 steps go through it, fp32 and misaligned ones take the dense form."""
    from megacispo.models.experts import decode_experts, grouped_products_take

    def tensors(dtype: torch.dtype, hidden: int = 64, ffn: int = 32):
        return (torch.empty(5, hidden, dtype=dtype, device="cuda"), torch.empty(5, 2, device="cuda"),
                torch.zeros(5, 2, dtype=torch.int64, device="cuda"),
                torch.empty(4, 2 * ffn, hidden, dtype=dtype, device="cuda"),
                torch.empty(4, hidden, ffn, dtype=dtype, device="cuda"))

    with fake_cuda():
        tokens, probs, top_experts, fc1, fc2 = tensors(torch.bfloat16)
        assert grouped_products_take(tokens, fc1, fc2)
        with _Ops() as ops:
            out = decode_experts(tokens, probs, top_experts, fc1, fc2, 1.0, 1.0)
        assert out.is_cuda and out.shape == tokens.shape and out.dtype == torch.bfloat16
        assert ops.names.count("aten::_grouped_mm") == 2
        with pytest.raises(RuntimeError, match="Expected inputs of BF16 type"):
            fp32 = tensors(torch.float32)
            torch._grouped_mm(fp32[0], fp32[3].transpose(1, 2), offs=torch.empty(4, dtype=torch.int32, device="cuda"))
        assert not grouped_products_take(*(tensors(torch.float32)[i] for i in (0, 3, 4)))
        assert not grouped_products_take(*(tensors(torch.bfloat16, hidden=60)[i] for i in (0, 3, 4)))


def test_the_compiled_decode_step_runs_as_cuda_graphs_on_cuda():
    from megacispo.models.model import lean_compile_options

    assert lean_compile_options(torch.device("cuda", 0))["triton.cudagraphs"] is True
    assert "triton.cudagraphs" not in lean_compile_options(torch.device("cpu"))
