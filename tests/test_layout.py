"""The layout rule: `ref` imports neither `weights` nor `codegen`, and never torch or onnx."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN_IN_REF = {"weights", "codegen", "torch", "onnx", "onnxruntime", "onnx_ir", "jax2onnx"}


def imported_roots(path):
    """Top-level package names a module imports."""
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


@pytest.mark.parametrize("path", sorted((ROOT / "ref").rglob("*.py")), ids=str)
def test_ref_stays_pure(path):
    bad = imported_roots(path) & FORBIDDEN_IN_REF
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


@pytest.mark.parametrize("path", sorted((ROOT / "weights").rglob("*.py")), ids=str)
def test_weights_does_not_import_codegen(path):
    assert "codegen" not in imported_roots(path)


def test_the_rule_catches_a_violation(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\nfrom weights.checkpoint import open_checkpoint\n")
    assert imported_roots(bad) & FORBIDDEN_IN_REF == {"torch", "weights"}
