"""The device rule of SYSTEM.md, checked on the source: every tensor the code creates is made on the
run's device (the local GPU under NCCL, the CPU under gloo), so every torch tensor factory and
torch.Generator names its ``device=``; a factory that leaves it out makes a CPU tensor, which is
right on a laptop and wrong on the first GPU step. ``*_like`` and ``tensor.new_*`` inherit their
device and are not checked."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHECKED_FOLDERS = ("megacispo", "models", "parallel")
FACTORIES = frozenset({
    "zeros", "ones", "empty", "full", "arange", "tensor", "as_tensor", "rand", "randn", "randint", "randperm",
    "linspace", "logspace", "eye", "Generator",
})


def misplaced_factory_calls(path: Path) -> list[str]:
    """``path:line: torch.name`` for each call of a torch factory in ``path`` without ``device=``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    calls = [node for node in ast.walk(tree) if _is_torch_factory_call(node)]
    return [
        f"{path}:{call.lineno}: torch.{call.func.attr}"
        for call in sorted(calls, key=lambda call: (call.lineno, call.col_offset))
        if not any(keyword.arg == "device" for keyword in call.keywords)
    ]


def _is_torch_factory_call(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in FACTORIES
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "torch"
    )


def test_every_tensor_factory_names_its_device(monkeypatch):
    monkeypatch.chdir(ROOT)  # the sites read as repository paths
    sites = [
        site
        for folder in CHECKED_FOLDERS
        for path in sorted(Path(folder).rglob("*.py"))
        for site in misplaced_factory_calls(path)
    ]
    assert not sites, (
        "tensor factories without device= (the run's device; device='cpu' for data that stays on the host):\n"
        + "\n".join(sites)
    )


def test_checker_flags_only_the_factory_without_a_device(tmp_path):
    source = tmp_path / "planted.py"
    source.write_text(
        "import torch\n"
        "x = torch.zeros(3)\n"
        "y = torch.zeros(3, device=x.device)\n"
        "z = torch.zeros_like(x) + x.new_zeros(3)\n"
    )
    assert misplaced_factory_calls(source) == [f"{source}:2: torch.zeros"]
