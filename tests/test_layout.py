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


def module_path(name):
    """The file of the dotted module `name` ("codegen.check.verify"), or None."""
    base = ROOT / name.replace(".", "/")
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.exists():
            return path
    return None


def _with_parents(name):
    """`name` and the packages importing it runs first: codegen.a.b -> codegen.a, codegen.a.b."""
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(2, len(parts) + 1)}


def codegen_imports(path):
    """The `codegen` modules a module imports anywhere in it (lazy imports too), with the
    packages each import runs first: `from codegen.graphs import kinds` is the module
    codegen.graphs.kinds (and its package), `from codegen.graphs import GraphSpec` the package."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "codegen" or node.module.startswith("codegen."):
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    found |= _with_parents(sub if module_path(sub) else node.module)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("codegen."):
                    found |= _with_parents(alias.name)
    return {m for m in found if module_path(m) and m != "codegen"}


def reachable(start):
    """(codegen modules, top-level packages) imported from the modules `start`, transitively
    through codegen's own modules."""
    seen, roots, todo = set(), set(), sorted(set().union(*map(_with_parents, start)))
    while todo:
        name = todo.pop()
        path = module_path(name)
        if name in seen or path is None:
            continue
        seen.add(name)
        roots |= imported_roots(path)
        todo += sorted(codegen_imports(path) - seen)
    return seen, roots


CODEGEN = sorted(
    ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
    for p in (ROOT / "codegen").rglob("*.py")
    if p.parent != ROOT / "codegen"
)  # the modules of codegen's packages

# The packages of codegen and which of them each may import (itself always). The command line
# reaches everything; the export command runs the checks; the checks rebuild graphs (graphs,
# lower: the op allow-list), read folders and generate through the runner (`drift`); the
# runner opens folders and nothing else, so `run` and `serve` load without jax2onnx; the kit
# is `ref` and numpy.
MAY_IMPORT = {
    "cli": {"export", "check", "run", "kit"},
    "export": {"check", "graphs", "lower", "folder"},
    "check": {"run", "folder", "graphs", "lower"},
    "run": {"folder"},
    "lower": {"graphs"},
    "graphs": set(),
    "folder": set(),
    "kit": set(),
}


def package_of(name):
    """codegen.check.verify -> "check"; codegen.__main__ -> "__main__"."""
    return name.split(".")[1]


def test_codegen_holds_only_packages_and_its_entry_points():
    top = {p.name for p in (ROOT / "codegen").iterdir() if p.name != "__pycache__"}
    assert top == {"__init__.py", "__main__.py"} | set(MAY_IMPORT), sorted(top)


@pytest.mark.parametrize("name", [m for m in CODEGEN if package_of(m) in MAY_IMPORT])
def test_codegen_imports_go_one_way(name):
    """Each module imports only its own package and the packages below it (MAY_IMPORT)."""
    own = package_of(name)
    bad = {
        m for m in codegen_imports(module_path(name))
        if package_of(m) != own and package_of(m) not in MAY_IMPORT[own]
    }  # fmt: skip
    assert not bad, f"{name} ({own}) imports {sorted(bad)}"


def test_the_package_rules_have_no_circle():
    order, todo = [], dict(MAY_IMPORT)
    while todo:
        free = [p for p, deps in todo.items() if deps <= set(order)]
        assert free, f"a circle among {sorted(todo)}"
        order += free
        for p in free:
            del todo[p]


def _cycle(graph):
    """One circle in `graph` ({node: set of nodes}) as a list, or None."""
    state = {}

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt, path + [nxt])):
                return found
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node, [node])):
            return found
    return None


def test_codegen_modules_import_no_circle():
    """No module reaches itself through imports, lazy ones included."""
    names = [*CODEGEN, "codegen.__main__"]
    graph = {m: codegen_imports(module_path(m)) - {m} for m in names}
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_the_circle_finder_finds_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("path", sorted([*ROOT.glob("ref/**/*.py"), *ROOT.glob("codegen/**/*.py")]))
def test_no_module_over_400_lines(path):
    lines = len(path.read_text().splitlines())
    assert lines <= 400, f"{path.relative_to(ROOT)} has {lines} lines"


RUNNER = ("codegen.run.runtime", "codegen.run.commands", "codegen.folder.sessions")


def test_the_runner_does_not_import_the_exporter():
    """`codegen run` and `serve` (and the folder's reader) load without jax2onnx: the runtime
    reads the manifest and opens sessions (`codegen.folder.sessions`), it never traces."""
    mods, roots = reachable(RUNNER)
    assert not roots & {"jax2onnx", "onnx_ir"}, sorted(mods)
    assert not {package_of(m) for m in mods} & {"export", "lower", "check", "graphs"}, sorted(mods)
    # the rule sees what verify pulls in
    mods, roots = reachable(("codegen.check.verify",))
    assert "jax2onnx" in roots and "codegen.folder.sessions" in mods


def test_the_manifest_imports_neither_onnx_nor_the_exporter():
    """`codegen.folder.manifest` (the folder's contract) is plain Python: JSON and dataclasses."""
    mods, roots = reachable(("codegen.folder.manifest",))
    assert mods == {"codegen.folder", "codegen.folder.manifest"}
    assert not roots & {"jax2onnx", "onnx", "onnxruntime", "onnx_ir", "jax"}, sorted(roots)


def test_the_kit_imports_no_onnx():
    """The kernel kit (golden vectors, schedules and their pictures) is `ref` and numpy: it
    reaches no ONNX library and no module outside the kit."""
    mods, roots = reachable([m for m in CODEGEN if package_of(m) == "kit"])
    assert not roots & {"onnx", "onnxruntime", "onnx_ir", "jax2onnx"}, sorted(roots)
    assert {package_of(m) for m in mods} == {"kit"}, sorted(mods)
