"""docs/reference/config.md is generated from the config dataclasses' field docstrings (tools/config_reference.py):
it is current, it documents every field of the config tree, and an undocumented field is refused."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from megacispo.config import Config
from megacispo.testing.tool_modules import load_tool

config_reference = load_tool("config_reference")


def test_docs_reference_config_md_is_current():
    expected = config_reference.render()
    actual = config_reference.OUTPUT.read_text() if config_reference.OUTPUT.is_file() else ""
    assert actual == expected, (
        f"docs/reference/config.md is out of date with the config's field docstrings: regenerate it with "
        f"`{config_reference.REGENERATE}` and commit the result"
    )


def _dotted_keys(config_class: type, prefix: str) -> list[str]:
    keys = []
    for field in dataclasses.fields(config_class):
        key = f"{prefix}.{field.name}" if prefix else field.name
        nested = field.default_factory() if field.default_factory is not dataclasses.MISSING else None
        keys += _dotted_keys(type(nested), key) if dataclasses.is_dataclass(nested) else [key]
    return keys


def test_every_field_of_the_config_has_a_row():
    text = config_reference.render()
    missing = [key for key in _dotted_keys(Config, "") if f"| `{key}` |" not in text]
    assert not missing, f"fields without a row in docs/reference/config.md: {missing}"
    assert "| `rl.loss.params` |" in text and "| `parallel.expert_tensor_parallel_size` |" in text


def test_a_field_without_docstring_is_refused(tmp_path: Path):
    for source in config_reference.SOURCES:
        (tmp_path / source).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / source).write_text((config_reference.REPO / source).read_text())
    layout = tmp_path / "parallel" / "layout.py"
    layout.write_text(layout.read_text().replace(
        '    """PP: the decoder layers are split into this many consecutive stages."""\n', ""))
    with pytest.raises(ValueError, match="field pipeline_model_parallel_size has no docstring"):
        config_reference.render(tmp_path)
