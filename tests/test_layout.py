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


def _codegen_modules(path):
    """The `codegen` modules a module imports anywhere in it ("codegen.x"), and its roots."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "codegen":
                found.update(f"codegen.{alias.name}" for alias in node.names)
            elif node.module.startswith("codegen."):
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("codegen."))
    return found, imported_roots(path)


def reachable(start):
    """(codegen modules, top-level packages) imported from the modules `start`, transitively
    through codegen's own modules."""
    seen, roots, todo = set(), set(), list(start)
    while todo:
        name = todo.pop()
        path = ROOT / (name.replace(".", "/") + ".py")
        if name in seen or not path.exists():
            continue
        seen.add(name)
        mods, found = _codegen_modules(path)
        roots |= found
        todo += sorted(mods - seen)
    return seen, roots


RUNNER = ("codegen.runtime", "codegen.inputs", "codegen.folder")


def test_the_runner_does_not_import_the_exporter():
    """`codegen run` and `serve` (and the folder's reader) load without jax2onnx: the runtime
    reads the manifest and opens sessions (`codegen.folder`), it never traces."""
    mods, roots = reachable(RUNNER)
    assert not roots & {"jax2onnx", "onnx_ir"}, sorted(mods)
    assert not mods & {"codegen.export", "codegen.trace", "codegen.verify", "codegen.graphs"}
    # the rule sees what verify pulls in
    mods, roots = reachable(("codegen.verify",))
    assert "jax2onnx" in roots and "codegen.folder" in mods


def test_the_manifest_imports_neither_onnx_nor_the_exporter():
    """`codegen.manifest` (the folder's contract) is plain Python: JSON and dataclasses."""
    mods, roots = reachable(("codegen.manifest",))
    assert mods == {"codegen.manifest"}
    assert not roots & {"jax2onnx", "onnx", "onnxruntime", "onnx_ir", "jax"}, sorted(roots)


KIT = ("codegen.vectors", "codegen.vector_cases", "codegen.vector_options", "codegen.plan")
KIT += ("codegen.plan_draw", "codegen.moe_plan")


def test_the_kit_imports_no_onnx():
    """The kernel kit (golden vectors, schedules and their pictures) is `ref` and numpy: it
    reaches no ONNX library and no exporter module."""
    mods, roots = reachable(KIT)
    assert not roots & {"onnx", "onnxruntime", "onnx_ir", "jax2onnx"}, sorted(roots)
    assert not mods & {"codegen.export", "codegen.trace", "codegen.graphs", "codegen.folder"}
