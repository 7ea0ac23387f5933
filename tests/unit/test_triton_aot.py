"""Every Triton kernel of the project compiled ahead of time for sm_90 and sm_80 at MiniMax-M1's and
MiniMax-M2's shapes, on this CPU (megacispo.testing.triton_aot), and held to the GPUs' limits: no compile
error, no spill, at most 255 registers, shared memory within the architecture's, the occupancy each
kernel's design needs. Planted kernels (a huge block, a pipeline that asks for too much shared memory,
a product Triton cannot compile) fail the same check; docs/reports/benchmarks.md holds the table these
compiles give."""

from __future__ import annotations

import importlib
import pkgutil

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]'); the compiles need it")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from megacispo.models import lightning_triton  # noqa: E402
from megacispo.testing import triton_aot  # noqa: E402

pytestmark = pytest.mark.skipif(lightning_triton.INTERPRETED, reason="TRITON_INTERPRET is set: nothing compiles")


@pytest.fixture(scope="module")
def rows() -> list[triton_aot.Row]:
    """The whole check: about 12 s on 2 cores."""
    return triton_aot.check()


def test_every_kernel_compiles_for_sm90_and_sm80_within_the_bounds(rows):
    failed = [(row.case.label, row.kernel, row.arch.name, row.failures) for row in rows if not row.passed]
    assert not failed
    compiled = {(row.case.label, row.kernel, row.arch.name) for row in rows}
    for case in triton_aot.CASES:
        for kernel in (name for name in triton_aot.KERNELS if name.startswith(case.kernels + ".")):
            for arch in ("sm_90", "sm_80"):
                assert (case.label, kernel, arch) in compiled
    assert all(row.resources.spilled == 0 and row.resources.registers <= 255 for row in rows)


def test_the_cases_are_m1s_and_m2s_kernels_in_each_dtype_they_launch_with():
    names = {(case.name.split()[0], case.kernels, case.dtype) for case in triton_aot.CASES}
    for dtype in (torch.float32, torch.bfloat16):
        assert ("MiniMax-M1", triton_aot._LIGHTNING, dtype) in names
        assert ("MiniMax-M1", triton_aot._EXPERTS, dtype) in names
        assert ("MiniMax-M2", triton_aot._EXPERTS, dtype) in names


def test_every_triton_kernel_of_the_project_has_a_design_and_a_case():
    """Any @triton.jit function named *_kernel in the project's packages is checked: a new kernel
    without a design occupancy in triton_aot.KERNELS or a case that launches it fails here."""
    found = set()
    for package in ("megacispo", "megacispo.models", "megacispo.parallel"):  # models/ and parallel/ sit apart
        path = importlib.import_module(package).__path__
        for module in pkgutil.walk_packages(path, prefix=package + "."):
            loaded = importlib.import_module(module.name)
            found |= {triton_aot.kernel_name(value) for name, value in vars(loaded).items()
                      if isinstance(value, triton.runtime.JITFunction) and name.endswith("_kernel")}
    assert found == set(triton_aot.KERNELS)
    launched = {triton_aot.kernel_name(launch.kernel) for case in triton_aot.CASES
                for launch in triton_aot.case_launches(case)}
    assert launched == found


def test_the_docs_table_is_the_one_these_compiles_give(rows):
    """docs/reports/benchmarks.md's table is regenerated (benchmarks/triton_aot.py --write) when a kernel,
    its launcher or Triton changes: compared here where this Triton is the one it names."""
    text = triton_aot.DOCS.read_text()
    if f"Compiled with {triton_aot.versions()}." not in text:
        pytest.skip(f"the docs' table was compiled by another Triton than {triton.__version__}")
    assert triton_aot.docs_with_section(text, triton_aot.docs_section(rows)) == text


def test_occupancy_follows_cudas_occupancy_calculator():
    sm_90, sm_80 = triton_aot.ARCHS

    def occupancy(registers: int, warps: int, shared: int, arch=sm_90) -> float:
        return triton_aot.Resources(registers, 0, 0, shared, warps, 3, "").occupancy(arch)

    assert occupancy(255, 8, 0) == 8 / 64  # 8 KiB registers a warp: 8 warps fit
    assert occupancy(128, 8, 0) == 16 / 64  # two 8-warp blocks
    assert occupancy(32, 4, 0) == 1.0  # threads, not registers, bound it
    assert occupancy(40, 4, 0) == 48 / 64  # 1280 registers a warp round to 1536: 42 warps, 10 blocks
    assert occupancy(64, 4, 100 * 1024) == 8 / 64  # two blocks of 101 KiB in 228 KiB
    assert occupancy(64, 4, 100 * 1024, sm_80) == 4 / 64  # one in 164 KiB


# Planted kernels: each breaks one bound, and the check says which.


@triton.jit
def _pipelined_product_kernel(a_ptr, b_ptr, out_ptr, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                              BLOCK_K: tl.constexpr):
    rows, cols, inner = tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_K)
    acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
    for start in range(0, K, BLOCK_K):
        a = tl.load(a_ptr + rows[:, None] * K + start + inner[None, :])
        b = tl.load(b_ptr + (start + inner[:, None]) * BLOCK_N + cols[None, :])
        acc = tl.dot(a, b, acc)
    tl.store(out_ptr + rows[:, None] * BLOCK_N + cols[None, :], acc)


@triton.jit
def _tiny_product_kernel(a_ptr, out_ptr, BLOCK: tl.constexpr):
    tile = tl.arange(0, BLOCK)
    a = tl.load(a_ptr + tile[:, None] * BLOCK + tile[None, :])
    tl.store(out_ptr + tile[:, None] * BLOCK + tile[None, :], tl.dot(a, a))


def _product_launches(kernel, **sizes):
    meta = triton_aot.META

    def run(dtype: torch.dtype) -> None:
        a = torch.empty(4096, dtype=dtype, device=meta)
        if kernel is _pipelined_product_kernel:
            kernel[(1,)](a, a, a.float(), 1024, num_warps=8, **sizes)
        else:
            kernel[(1,)](a, a, **sizes)

    return run


def _planted(name: str, run) -> list[triton_aot.Row]:
    case = triton_aot.Case(name, "planted", torch.bfloat16, __name__, run)
    return triton_aot.check((case,), triton_aot.ARCHS[:1])


def test_a_block_too_large_for_the_registers_fails_on_its_spills():
    """Lightning attention's launcher with the CPU path's block of 256: a 256 x 256 score tile."""
    rows = [row for row in triton_aot.check((triton_aot.Case(
        "planted", "block 256", torch.bfloat16, triton_aot._LIGHTNING,
        triton_aot.lightning_launches(heads=8, head_dim=128, tokens=600, block_size=256)),), triton_aot.ARCHS[:1])
        if row.kernel.endswith("_block_output_kernel")]
    assert rows and all(not row.passed for row in rows)
    assert all(failure.endswith("bytes spilled per thread > 0") for row in rows for failure in row.failures)


def test_a_pipeline_asking_for_more_shared_memory_than_the_gpu_has_fails():
    (row,) = _planted("shared memory", _product_launches(_pipelined_product_kernel, BLOCK_M=128, BLOCK_N=256,
                                                         BLOCK_K=128, num_stages=4))
    assert row.resources.shared > 227 * 1024
    assert f"{row.resources.shared} B shared memory > {227 * 1024} B (sm_90)" in row.failures


def test_a_kernel_that_does_not_compile_fails_with_the_compilers_message():
    (row,) = _planted("compile error", _product_launches(_tiny_product_kernel, BLOCK=8))
    assert row.resources is None
    (failure,) = row.failures
    assert failure.startswith("compile error: ") and "16" in failure


def test_a_kernel_under_its_design_occupancy_fails(monkeypatch):
    name = f"{__name__}._pipelined_product_kernel"
    monkeypatch.setitem(triton_aot.KERNELS, name, triton_aot.KernelDesign(1.0, "planted: every warp slot"))
    (row,) = _planted("occupancy", _product_launches(_pipelined_product_kernel, BLOCK_M=64, BLOCK_N=64,
                                                     BLOCK_K=32, num_stages=2))
    occupancy = row.resources.occupancy(triton_aot.ARCHS[0])
    assert row.failures == [f"occupancy {occupancy:.3f} < 1.000"]


def test_a_grid_over_cudas_limits_fails():
    assert triton_aot.grid_failures((2**31, 8, 65536)) == ["grid dimension 0 is 2147483648 > 2147483647",
                                                           "grid dimension 2 is 65536 > 65535"]
    assert triton_aot.grid_failures((2**20, 65535)) == []
