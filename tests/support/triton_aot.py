"""Every Triton kernel of the project compiled ahead of time for the GPUs it targets, on a machine
without one, and held to what those GPUs allow.

Triton's NVIDIA backend compiles a kernel to PTX and, with the ptxas it ships, to a cubin for any
target (``GPUTarget("cuda", 90, 32)``: H100, H800, H200; ``("cuda", 80, 32)``: A100); no GPU takes
part. ptxas's log says how many bytes of registers a kernel spills to local memory, and the cubin
(``cuobjdump --dump-resource-usage``) what each program asks of an SM: registers per thread, stack
and static shared memory; Triton's metadata adds the dynamic shared memory its pipelining takes.

The launches compiled are the real ones. The launchers (models/lightning_triton.py,
models/experts_triton.py) run on meta tensors (shapes without data; autograd runs on them too) at
MiniMax-M1's and MiniMax-M2's shapes, and each kernel launch is recorded instead of run: its grid, its arguments, its
block sizes, ``num_warps`` and ``num_stages`` as the launcher chose them. Each launch is then compiled
through Triton's own ``warmup``, which specializes the arguments as a launch does (an int equal to 1
becomes a constant, ints and pointers divisible by 16 are marked so; tensors are taken as
16-byte aligned, as torch's allocator makes them), while a driver of ours answers Triton's questions
about the device with the target's.

Bounds (``check``): no compile error, no spilled byte, at most 255 registers per thread, the shared
memory within what a program may take on the target, the grid within CUDA's limits, and the
theoretical occupancy (resident warps per SM over the SM's 64, as CUDA's occupancy calculator
computes it from registers, shared memory and warps) at least what the kernel's design needs
(``KERNELS``). tests/unit/test_triton_aot.py runs it in CI; ``python benchmarks/triton_aot.py`` prints
the table docs/reports/benchmarks.md holds.
"""

from __future__ import annotations

import contextlib
import io
import math
import re
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction


# CUDA's per-SM limits on compute capability 8.0 and 9.0 alike (the CUDA C++ Programming Guide's
# table of technical specifications, and its occupancy calculator's allocation rules).
REGISTERS_PER_SM = 65536
MAX_REGISTERS_PER_THREAD = 255
REGISTER_ALLOCATION_UNIT = 256  # registers, allocated per warp
MAX_WARPS_PER_SM = 64
MAX_PROGRAMS_PER_SM = 32
SHARED_RESERVED_PER_PROGRAM = 1024  # bytes the system takes per resident block
SHARED_ALLOCATION_UNIT = 128
MAX_GRID = (2**31 - 1, 65535, 65535)
SUBPROCESS_TIMEOUT_S = 120
# The launchers run on meta tensors: shapes, dtypes and strides without data (their launches are recorded).
META = torch.device("meta")


@dataclass(frozen=True)
class Arch:
    """A GPU architecture the kernels are compiled for."""

    name: str
    capability: int
    gpus: str
    shared_per_program: int  # bytes one block may take (the opt-in maximum)
    shared_per_sm: int  # bytes

    @property
    def target(self) -> GPUTarget:
        return GPUTarget("cuda", self.capability, 32)


ARCHS = (
    Arch("sm_90", 90, "H100, H800, H200", shared_per_program=227 * 1024, shared_per_sm=228 * 1024),
    Arch("sm_80", 80, "A100", shared_per_program=163 * 1024, shared_per_sm=164 * 1024),
)


@dataclass(frozen=True)
class KernelDesign:
    """What a kernel's design needs of an SM: the smallest occupancy that keeps it fed, and why."""

    min_occupancy: float
    why: str


_LIGHTNING = "megacispo.models.lightning_triton"
_EXPERTS = "megacispo.models.experts_triton"
# Every Triton kernel of the project (a @triton.jit function named *_kernel; other @triton.jit
# functions are helpers that kernels call): tests/unit/test_triton_aot.py fails on one missing here.
KERNELS = {
    f"{_LIGHTNING}._state_scan_kernel": KernelDesign(
        1 / 8, "one 8-warp program per SM: a program walks its document's blocks in sequence, on a grid of "
               "documents x heads x state tiles, so the grid, not the occupancy, fills the GPU"),
    f"{_LIGHTNING}._block_output_kernel": KernelDesign(
        1 / 8, "one 8-warp program per SM: tensor-core products on tiles held in registers, whose latency the "
               "products' own independence hides, as in flash attention's kernels"),
    f"{_EXPERTS}._permute_pairs_kernel": KernelDesign(
        1 / 2, "half the SM's warps: a memory-bound row copy needs many loads in flight"),
    f"{_EXPERTS}._swiglu_kernel": KernelDesign(1 / 2, "half the SM's warps: memory-bound, as above"),
    f"{_EXPERTS}._combine_pairs_kernel": KernelDesign(1 / 2, "half the SM's warps: memory-bound, as above"),
}


def kernel_name(kernel: JITFunction) -> str:
    return f"{kernel.fn.__module__}.{kernel.fn.__name__}"


@dataclass(frozen=True)
class Launch:
    """One kernel launch as the launcher made it, tensors replaced by their dtypes (what a compile reads)."""

    kernel: JITFunction
    grid: tuple[int, ...]
    args: tuple
    options: dict  # constexprs by name, num_warps, num_stages


@contextlib.contextmanager
def recorded_launches(kernels: list[JITFunction]) -> Iterator[list[Launch]]:
    """Within it, launches of ``kernels`` are recorded, not run."""
    launches: list[Launch] = []

    def record(kernel: JITFunction) -> Callable:
        def run(*args, grid, warmup, **options):
            launches.append(Launch(kernel, tuple(grid), tuple(
                arg.dtype if isinstance(arg, torch.Tensor) else arg for arg in args), options))

        return run

    with contextlib.ExitStack() as stack:
        for kernel in kernels:
            stack.enter_context(_attribute(kernel, "run", record(kernel)))
        yield launches


@contextlib.contextmanager
def _attribute(owner, name: str, value) -> Iterator[None]:
    setattr(owner, name, value)
    try:
        yield
    finally:
        delattr(owner, name)


@dataclass(frozen=True)
class Case:
    """The launches of one model's kernels at its real shapes: ``run`` calls the launchers (on meta
    tensors) as the model does, in ``dtype``."""

    name: str  # the model, the part, the layout
    shapes: str
    dtype: torch.dtype
    kernels: str  # the kernels' module
    run: Callable[[torch.dtype], None]

    @property
    def label(self) -> str:
        return f"{self.name}, {str(self.dtype).removeprefix('torch.')}"


def lightning_launches(heads: int, head_dim: int, tokens: int, block_size: int | None = None
                       ) -> Callable[[torch.dtype], None]:
    """A training pass (forward and backward) of ``tokens`` tokens, and an extend's forward from a
    state, through lightning_attention_triton (``block_size`` None: the launcher's own)."""
    from megacispo.models.lightning_triton import lightning_attention_triton

    sizes = {} if block_size is None else {"block_size": block_size}

    def run(dtype: torch.dtype) -> None:
        q, k, v = (torch.empty(1, tokens, heads, head_dim, dtype=dtype, device=META, requires_grad=True)
                   for _ in range(3))
        decay = torch.empty(heads, device=META)
        out, final_state = lightning_attention_triton(q, k, v, decay, **sizes)
        torch.autograd.backward((out, final_state), (torch.empty_like(out), torch.empty_like(final_state)))
        with torch.no_grad():
            state = torch.empty(1, heads, head_dim, head_dim, dtype=dtype, device=META)
            lightning_attention_triton(q, k, v, decay, initial_state=state, **sizes)

    return run


def expert_launches(tokens: int, topk: int, local_experts: int, hidden: int, ffn: int
                    ) -> Callable[[torch.dtype], None]:
    """A decode step's expert bookkeeping on an EP rank (grouped_expert_products' three ops):
    ``tokens`` gathered tokens, their top-``topk`` pairs, ``local_experts`` experts of FFN width ``ffn``
    on this rank."""
    from megacispo.models.experts_triton import combine_pairs_triton, permute_pairs_triton, swiglu_triton

    pairs = tokens * topk

    def run(dtype: torch.dtype) -> None:
        token_rows = torch.empty(tokens, hidden, dtype=dtype, device=META)
        sorted_experts, order = (torch.empty(pairs, dtype=torch.int64, device=META) for _ in range(2))
        rows, positions = permute_pairs_triton(token_rows, sorted_experts, order, local_experts)
        ends = torch.empty(local_experts, dtype=torch.int32, device=META)
        swiglu_triton(torch.empty(pairs, 2 * ffn, dtype=dtype, device=META), ends)
        probs = torch.empty(tokens, topk, device=META)
        combine_pairs_triton(token_rows, probs, torch.empty_like(rows), positions, 1.0, 1.0)

    return run


# MiniMax-M1 (models.config's minimax-m1) at examples/configs/minimax_m1_512gpu.yaml's layout: TP 8,
# EP 32, expert TP 8. MiniMax-M2 (transformers' MiniMaxM2Config, its released config.json) at EP 8.
M1_LIGHTNING = {"heads": 64 // 8, "head_dim": 128, "tokens": 4133}
M1_DECODE_EXPERTS = {"tokens": 64 * 32, "topk": 2, "local_experts": 32 // 32, "hidden": 6144, "ffn": 9216 // 8}
M2_DECODE_EXPERTS = {"tokens": 64 * 8, "topk": 8, "local_experts": 256 // 8, "hidden": 3072, "ffn": 1536}

M1_LIGHTNING_CASE = ("MiniMax-M1 lightning attention, TP 8",
                     "8 heads x 128 per rank, 4133 tokens: forward and backward, and a forward from a state (extend)")
CASES = tuple(
    case
    for dtype in (torch.float32, torch.bfloat16)
    for case in (
        Case(*M1_LIGHTNING_CASE, dtype, _LIGHTNING, lightning_launches(**M1_LIGHTNING)),
        Case("MiniMax-M1 decode experts, EP 32 + expert TP 8",
             "2048 gathered tokens, top-2, 1 local expert, hidden 6144, FFN 1152", dtype, _EXPERTS,
             expert_launches(**M1_DECODE_EXPERTS)),
        Case("MiniMax-M2 decode experts, EP 8", "512 gathered tokens, top-8, 32 local experts, hidden 3072, FFN 1536",
             dtype, _EXPERTS, expert_launches(**M2_DECODE_EXPERTS)),
    )
)


def project_kernels(module: str) -> list[JITFunction]:
    """The kernels (@triton.jit functions named *_kernel) of one of the project's modules."""
    import importlib

    loaded = importlib.import_module(module)
    return [value for name, value in vars(loaded).items()
            if isinstance(value, JITFunction) and name.endswith("_kernel") and value.fn.__module__ == module]


def case_launches(case: Case) -> list[Launch]:
    with recorded_launches(project_kernels(case.kernels)) as launches:
        case.run(case.dtype)
    return launches


@dataclass(frozen=True)
class Resources:
    """What one compiled kernel asks of the GPU, per program (a CUDA block)."""

    registers: int  # per thread
    spilled: int  # bytes of spill stores and loads, per thread
    stack: int  # bytes per thread
    shared: int  # bytes: static and dynamic
    num_warps: int
    num_stages: int
    variant: str  # the compile-time constants, as Triton specialized them

    def occupancy(self, arch: Arch) -> float:
        """Resident warps per SM over the SM's maximum, from registers, shared memory and warps."""
        registers_per_warp = math.ceil(self.registers * 32 / REGISTER_ALLOCATION_UNIT) * REGISTER_ALLOCATION_UNIT
        by_registers = REGISTERS_PER_SM // registers_per_warp // self.num_warps
        shared = math.ceil((self.shared + SHARED_RESERVED_PER_PROGRAM) / SHARED_ALLOCATION_UNIT) \
            * SHARED_ALLOCATION_UNIT
        by_shared = arch.shared_per_sm // shared
        programs = min(by_registers, by_shared, MAX_WARPS_PER_SM // self.num_warps, MAX_PROGRAMS_PER_SM)
        return programs * self.num_warps / MAX_WARPS_PER_SM


class _TargetDriver:
    """What Triton asks of its active driver to compile a launch (the target, a device and a stream),
    answered for ``arch``; the device names a kernel cache of this compile alone."""

    def __init__(self, arch: Arch, device: str):
        self.target, self.device = arch.target, device

    def get_current_device(self) -> str:
        return self.device

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return self.target


SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
RESOURCE_USAGE = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


class Compiler:
    """Compiles launches for one architecture; each kernel variant once (Triton's cache of it is
    this compiler's, and is dropped with it)."""

    def __init__(self, arch: Arch):
        self.arch = arch
        self.device = f"ahead-of-time {arch.name} {id(self)}"
        self.resources: dict[str, Resources] = {}  # by the compiled kernel's hash
        self.kernels: set[JITFunction] = set()

    def __enter__(self) -> Compiler:
        return self

    def __exit__(self, *exc) -> None:
        for kernel in self.kernels:
            kernel.device_caches.pop(self.device, None)

    def compile(self, launch: Launch) -> Resources:
        """The launch's kernel compiled for the architecture, as ``kernel[grid](...)`` would compile it there.
        Raises what the compile raises."""
        self.kernels.add(launch.kernel)
        log = io.StringIO()
        previous = driver._active  # not driver.active, which would look for a GPU's driver
        driver.set_active(_TargetDriver(self.arch, self.device))
        try:
            with knobs.nvidia.scope(), knobs.compilation.scope(), contextlib.redirect_stdout(log):
                knobs.nvidia.dump_ptxas_log = True  # ptxas's log, which counts the spills, printed
                knobs.compilation.always_compile = True  # past Triton's cache on disk, so ptxas runs
                compiled = launch.kernel.warmup(*launch.args, grid=launch.grid, **launch.options)
        finally:
            driver._active = previous
        if compiled.hash not in self.resources:
            self.resources[compiled.hash] = _resources(compiled, log.getvalue())
        return self.resources[compiled.hash]


def _resources(compiled, ptxas_log: str) -> Resources:
    spills = SPILLS.findall(ptxas_log)
    if not spills:
        raise RuntimeError(f"ptxas printed no spill counts for {compiled.name}; its log:\n{ptxas_log}")
    usage = RESOURCE_USAGE.search(_cuobjdump_resource_usage(compiled.asm["cubin"]))
    registers, stack, static_shared, _ = map(int, usage.groups())
    names = compiled.src.fn.arg_names
    constants = {names[index[0]]: value for index, value in compiled.src.constants.items() if len(index) == 1}
    return Resources(
        registers=registers,
        spilled=sum(int(stores) + int(loads) for stores, loads in spills),
        stack=stack,
        shared=static_shared + compiled.metadata.shared,
        num_warps=compiled.metadata.num_warps,
        num_stages=compiled.metadata.num_stages,
        variant=" ".join(f"{name}={value}" for name, value in constants.items()),
    )


def _cuobjdump_resource_usage(cubin: bytes) -> str:
    tool = knobs.nvidia.cuobjdump.path
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "kernel.cubin"
        path.write_bytes(cubin)
        try:
            result = subprocess.run([tool, "--dump-resource-usage", str(path)], capture_output=True, text=True,
                                    timeout=SUBPROCESS_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{tool} did not read a cubin's resource usage in {SUBPROCESS_TIMEOUT_S} s") from None
    if result.returncode != 0 or not RESOURCE_USAGE.search(result.stdout):
        raise RuntimeError(f"{tool} --dump-resource-usage failed (exit {result.returncode}): {result.stderr.strip()}")
    return result.stdout


@dataclass
class Row:
    """One kernel variant of a case compiled for one architecture, and what it breaks."""

    case: Case
    kernel: str
    arch: Arch
    resources: Resources | None = None
    failures: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures


def check(cases: tuple[Case, ...] = CASES, archs: tuple[Arch, ...] = ARCHS) -> list[Row]:
    """Every kernel variant each case launches, compiled for each architecture and held to the bounds."""
    rows = []
    with contextlib.ExitStack() as stack:
        compilers = [stack.enter_context(Compiler(arch)) for arch in archs]
        for case in cases:
            seen: set[tuple[str, str, str]] = set()
            for launch in case_launches(case):
                for compiler in compilers:
                    row = Row(case, kernel_name(launch.kernel), compiler.arch)
                    try:
                        row.resources = compiler.compile(launch)
                    except Exception as error:  # noqa: BLE001 - a compile error is the row's failure
                        row.failures.append(f"compile error: {_first_cause(error)}")
                    else:
                        key = (row.kernel, row.resources.variant, compiler.arch.name)
                        if key in seen:
                            continue  # the same kernel variant launched again (the backward's recompute)
                        seen.add(key)
                        row.failures += bound_failures(row.resources, compiler.arch, KERNELS.get(row.kernel))
                    row.failures += grid_failures(launch.grid)
                    rows.append(row)
    return rows


def _first_cause(error: Exception) -> str:
    """What went wrong first, in one line: the innermost cause (Triton's CompilationError carries the
    kernel's source and chains the error that stopped it)."""
    while error.__cause__ is not None:
        error = error.__cause__
    message = getattr(error, "error_message", None) or str(error)
    return f"{type(error).__name__}: {' '.join(message.split())[:300]}"


def bound_failures(resources: Resources, arch: Arch, design: KernelDesign | None) -> list[str]:
    failures = []
    if resources.spilled:
        failures.append(f"{resources.spilled} bytes spilled per thread > 0")
    if resources.registers > MAX_REGISTERS_PER_THREAD:
        failures.append(f"{resources.registers} registers per thread > {MAX_REGISTERS_PER_THREAD}")
    if resources.shared > arch.shared_per_program:
        failures.append(f"{resources.shared} B shared memory > {arch.shared_per_program} B ({arch.name})")
    if design is None:
        failures.append("no design occupancy in megacispo.testing.triton_aot.KERNELS")
    elif resources.occupancy(arch) < design.min_occupancy:
        failures.append(f"occupancy {resources.occupancy(arch):.3f} < {design.min_occupancy:.3f}")
    return failures


def grid_failures(grid: tuple[int, ...]) -> list[str]:
    return [f"grid dimension {axis} is {size} > {limit}"
            for axis, (size, limit) in enumerate(zip(grid, MAX_GRID)) if size > limit]


def table(rows: list[Row]) -> str:
    """The rows as a markdown table, after a line per case saying its shapes."""
    cases = {row.case.name: row.case.shapes for row in rows}
    lines = [f"- {name}: {shapes}" for name, shapes in cases.items()] + [""]
    header = ("case", "kernel", "arch", "constants", "warps / stages", "registers", "spilled B", "stack B",
              "shared B", "occupancy (bound)", "status")
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        kernel = row.kernel.rsplit(".", 1)[1]
        design = KERNELS.get(row.kernel)
        bound = "-" if design is None else f"{design.min_occupancy:.3f}"
        status = "pass" if row.passed else "FAIL: " + "; ".join(row.failures)
        resources = row.resources
        if resources is None:
            measured = ("-",) * 7 + (f"- ({bound})",)
        else:
            measured = (resources.variant, f"{resources.num_warps} / {resources.num_stages}",
                        str(resources.registers), str(resources.spilled), str(resources.stack), str(resources.shared),
                        f"{resources.occupancy(row.arch):.3f} ({bound})")
        cells = (row.case.label, kernel, row.arch.name, *measured, status)
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(lines)


# docs/reports/benchmarks.md holds the table between these lines (benchmarks/triton_aot.py --write).
DOCS = Path(__file__).resolve().parents[2] / "docs" / "reports" / "benchmarks.md"
DOCS_BEGIN = "<!-- ahead-of-time table: benchmarks/triton_aot.py --write -->"
DOCS_END = "<!-- end of the ahead-of-time table -->"


def docs_section(rows: list[Row]) -> str:
    return f"{DOCS_BEGIN}\nCompiled with {versions()}.\n\n{table(rows)}\n{DOCS_END}"


def docs_with_section(text: str, section: str) -> str:
    """``text`` (docs/reports/benchmarks.md) with its ahead-of-time table replaced by ``section``."""
    if text.count(DOCS_BEGIN) != 1 or text.count(DOCS_END) != 1:
        raise ValueError(f"{DOCS} must hold the lines {DOCS_BEGIN!r} and {DOCS_END!r} once each")
    before, rest = text.split(DOCS_BEGIN)
    return before + section + rest.split(DOCS_END)[1]


def versions() -> str:
    return f"Triton {triton.__version__} (its ptxas and cuobjdump)"
