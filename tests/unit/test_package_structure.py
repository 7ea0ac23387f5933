"""The package's shape: megacispo's modules import each other without a cycle (function-local imports
counted) and at the top of the file only (the deferred imports listed aside), a run config loads
without importing any subsystem's code or the user's modules, and production code never imports the
test support package."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Where each installed package's files live (setup.py's package_dir).
PACKAGE_ROOTS = {"megacispo": REPO / "megacispo", "megacispo.models": REPO / "models",
                 "megacispo.parallel": REPO / "parallel"}
# The function-local imports of project code there are, each with its reason.
DEFERRED_IMPORTS = {
    # The entry points import their run after the dry run, which builds nothing and imports no
    # Megatron-Core (tests/multiprocess/test_examples.py).
    ("megacispo.train", "megacispo.rl.run"),
    ("megacispo.sft", "megacispo.training.sft"),
    ("megacispo.eval", "megacispo.evaluation.run"),
    ("megacispo.score", "megacispo.evaluation.scoring"),
    # Triton, an optional package, is imported only when its kernels are asked for.
    ("megacispo.models.lightning", "megacispo.models.lightning_triton"),
    ("megacispo.models.experts", "megacispo.models.experts_triton"),
    # The CPU layer's one switch (parallel/cpu), turned on only on a CPU run.
    ("megacispo.parallel.layout", "megacispo.parallel.cpu"),
    # vLLM's CPU shims, applied only to a vLLM engine started without a CUDA device.
    ("megacispo.rollout.vllm_engine", "megacispo.parallel.cpu.vllm"),
    # Megatron-Core's load strategies, imported at the first load (the dry runs import no Megatron-Core).
    ("megacispo.checkpoint.distributed", "megacispo.checkpoint.dcp_load"),
}


def _modules() -> dict[str, Path]:
    """Every module of the installed package by dotted name (the test support package aside)."""
    modules = {}
    for package, root in PACKAGE_ROOTS.items():
        for path in root.rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[0] in ("models", "parallel") and package == "megacispo":
                continue
            name = ".".join((package, *parts))
            modules[name.removesuffix(".__init__")] = path
    return modules


def _imports(tree: ast.Module, modules: dict[str, Path]) -> list[tuple[ast.AST, str, bool]]:
    """(node, imported project module, whether the import is at the module's top level) of a file."""
    top_level = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            targets = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module
                       for alias in node.names]
        elif isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            continue
        found += [(node, target, id(node) in top_level) for target in targets if target in modules]
    return found


def test_no_function_local_imports_of_project_code():
    modules = _modules()
    local = set()
    for name, path in modules.items():
        for node, target, at_top in _imports(ast.parse(path.read_text()), modules):
            if not at_top:
                local.add((name, target))
    assert local <= DEFERRED_IMPORTS, f"function-local imports of project code: {sorted(local - DEFERRED_IMPORTS)}"


def _import_graph(sources: dict[str, str]) -> dict[str, set[str]]:
    """Module -> the project modules it imports, at its top or within a function (a deferred import
    closes a cycle as surely when it runs), from each module's source."""
    graph = {name: set() for name in sources}
    for name, source in sources.items():
        for _, target, _ in _imports(ast.parse(source), graph):
            if target != name:
                graph[name].add(target)
                # Importing a.b.c runs a/__init__ and a/b/__init__ first.
                parent = target.rpartition(".")[0]
                while parent in graph and parent != name:
                    graph[name].add(parent)
                    parent = parent.rpartition(".")[0]
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    return [component for component in _strongly_connected(graph) if len(component) > 1]


def test_no_import_cycle():
    sources = {name: path.read_text() for name, path in _modules().items()}
    assert not (cycles := _cycles(_import_graph(sources))), f"import cycles: {cycles}"


def test_a_cycle_closed_by_a_function_local_import_is_one():
    sources = {"megacispo.a": "from megacispo.b import value\n",
               "megacispo.b": "value = 1\n\ndef late():\n    from megacispo.a import value\n",
               "megacispo.c": "from megacispo.a import value\n"}
    assert _cycles(_import_graph(sources)) == [["megacispo.a", "megacispo.b"]]


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components of ``graph``."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph[node]):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def test_loading_a_config_imports_no_subsystem_and_no_user_module(tmp_path):
    """A config naming a user reward and a user metric hook loads without importing either, or the
    loss registry, the rollout engine, the trainer or Megatron-Core; the start-up check imports them."""
    (tmp_path / "planted_reward.py").write_text("raise RuntimeError('imported at config load')\n")
    script = (
        "import sys\n"
        "from megacispo.config import load_config\n"
        "load_config(None, ['rl.reward=planted_reward:score', 'logging.metric_hooks.planted_reward:Hook={}'])\n"
        "heavy = ('megacispo.rl.losses', 'megacispo.rl.trainer', 'megacispo.rollout.generate', 'megacispo.data.rewards',"
        " 'megatron', 'planted_reward')\n"
        "print(sorted(name for name in sys.modules if name.startswith(heavy)))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                            env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"


def test_production_code_never_imports_the_test_support_package():
    modules = _modules()
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.startswith("megacispo.testing"), f"{name} imports {node.module}"
