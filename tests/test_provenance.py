"""tomlens.provenance is a shared helper below the runs layer: it imports nothing above models, and
its plain conversion is the one `config_to_dict` uses."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import tomlens.provenance
from tomlens.provenance import plain_values, run_manifest
from tomlens.runs.base import ModelSpec, StimuliSpec, config_to_dict

pytestmark = pytest.mark.unit

# What a shared helper may import from tomlens: the package itself, its errors, and the models layer.
ALLOWED = ("tomlens", "tomlens.errors", "tomlens.models")


def _tomlens_imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "tomlens":
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names if a.name.split(".")[0] == "tomlens")
    return names


def test_provenance_imports_nothing_above_models():
    imported = _tomlens_imports(Path(tomlens.provenance.__file__))
    above = sorted(m for m in imported if not any(m == a or m.startswith(a + ".") for a in ALLOWED))
    assert not above, f"tomlens/provenance.py imports {above}"


def test_plain_values_of_a_config_are_its_config_dict(tmp_path):
    config = StimuliSpec(family="goal-encoding", n=2, options={"ks": (0, 6)})
    assert plain_values(config) == config_to_dict(config) == {
        "family": "goal-encoding", "n": 2, "seed": 0, "path": None, "options": {"ks": [0, 6]}}
    assert plain_values({"out": tmp_path, 1: (ModelSpec(name="tiny-llama"),)}) == {
        "out": str(tmp_path), "1": [config_to_dict(ModelSpec(name="tiny-llama"))]}
    manifest = run_manifest(None, ModelSpec(name="tiny-llama", seed=3))
    assert manifest["config"] == config_to_dict(ModelSpec(name="tiny-llama", seed=3)) and manifest["seed"] == 3
