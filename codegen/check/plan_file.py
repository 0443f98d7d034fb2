"""A node-precision plan's files beside its graph: GRAPH.npi.yaml, QAIC's node-precision-info
(`FP32NodeInstanceNames:`, which compile.sh passes as `-node-precision-info`), and
GRAPH.npi.ref.json, the same nodes in `ref`'s terms (`ref.numerics.Record.key`s, paired by
`codegen.check.npi.RefPlan`), which `verify --precision` reads to keep them in float32 on
`ref`'s side too. A plan names values as the file compile.sh compiles holds them: with
`-sub-functions`, a node inside a layer function by its body name (`FUNCTION/value`, which
keeps it in every call of that function) and any other by its top-level name; `instances`
gives the values of a graph, or of one segment of it, that a plan keeps, as onnx's inliner
names them (what the device model runs)."""

import json
import os

from codegen.check.device_graph import inline
from codegen.folder.sessions import atomic_text

SUFFIX = ".npi.yaml"
REF_SUFFIX = ".npi.ref.json"


class PlanError(ValueError):
    """A graph cannot be planned, or a plan names a node the graph does not have."""


def npi_yaml(names):
    """The node-precision-info file's text: FP32NodeInstanceNames, one name a line."""
    lines = ["FP32NodeInstanceNames:"] + [f'  - "{n}"' for n in names]
    return "\n".join(lines) + "\n"


def read_npi(path, model):
    """The names of a node-precision-info file, each checked to be a name the compiled file
    holds (`_named`: a top-level node output, or a node output in a function body, the graph
    compiled with `-sub-functions` when it has functions) → list; PlanError naming the first
    unknown one and the graph."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise PlanError(f"{path}: {e}") from e
    if not lines or lines[0].strip() != "FP32NodeInstanceNames:":
        raise PlanError(f"{path}: expected 'FP32NodeInstanceNames:' on its first line")
    names = [line.strip()[1:].strip().strip('"') for line in lines[1:] if line.strip()]
    known = {name for _, name in _named(model)}
    for name in names:
        if name not in known:
            where = "at its top level or in a function body" if model.functions else ""
            raise PlanError(f"{path}: node output {name!r} is not in graph "
                            f"{model.graph.name!r} {where}".rstrip())  # fmt: skip
    return names


def write_plan(folder, graph, model, precision, found, parted):
    """GRAPH.npi.yaml (QAIC's) and GRAPH.npi.ref.json (each node with `ref`'s names for it,
    one per layer it is kept in, and where the two device models parted) for the rows
    `found`; neither when it is empty (old ones removed)."""
    path, ref_path = (os.path.join(folder, graph + suffix) for suffix in (SUFFIX, REF_SUFFIX))
    if not found:
        for old in (path, ref_path):
            if os.path.exists(old):
                os.remove(old)
        return
    nodes = [{"onnx": name, "op": op, "ref": keys} for _, name, op, keys in found]
    atomic_text(path, npi_yaml([n["onnx"] for n in nodes]))
    read_npi(path, model)
    text = json.dumps({"precision": precision, "nodes": nodes, "parted": parted}, indent=2)
    atomic_text(ref_path, text + "\n")


def folder_plan(folder, graph, model):
    """The plan in `folder` for `graph` (its ModelProto `model`) → (node names as the plan
    holds them (`instances` gives the values they keep), `ref` keys, note): empty with note
    None when the folder has none; the keys of the nodes the ref file pairs, and a note
    naming how many it does not (a hand-written file, or where the two device models
    parted)."""
    path, ref_path = (os.path.join(folder, graph + suffix) for suffix in (SUFFIX, REF_SUFFIX))
    if not os.path.exists(path):
        return [], [], None
    names = read_npi(path, model)
    paired = {}
    if os.path.exists(ref_path):
        with open(ref_path) as f:
            paired = {n["onnx"]: n["ref"] for n in json.load(f)["nodes"] if n["ref"]}
    keys = [k for n in names if n in paired for k in paired[n]]
    both = sum(n in paired for n in names)
    note = f"{graph + SUFFIX}: {len(names)} node(s) in float32, {both} of them in ref"
    return names, keys, note


def producers_of(segment):
    """{value name: the node making it} of the inlined `segment`."""
    return {o: n for n in inline(segment).graph.node for o in n.output}


def function_calls(model):
    """[(N, call node, its FunctionProto)]: the graph's function calls in node order, N the
    "__N" onnx's inliner gives the values of that call's body; PlanError for a body that calls
    a function (its values would be numbered otherwise)."""
    functions = {(f.domain, f.name): f for f in model.functions}
    calls = [(n, functions[n.domain, n.op_type]) for n in model.graph.node
             if (n.domain, n.op_type) in functions]  # fmt: skip
    for f in model.functions:
        if any((n.domain, n.op_type) in functions for n in f.node):
            raise PlanError(f"function {f.name!r} calls a function: expected flat layer bodies")
    return [(i, node, f) for i, (node, f) in enumerate(calls, start=1)]


def _named(model):
    """[(a value of `model` inlined, a name a plan keeps it by)]: a top-level node output by
    its name; a value a function call makes by its body name, which stands for that node in
    every call (`-sub-functions`: the compiler reads the body once); a function's result is
    also the call's output, a top-level name."""
    pairs = [(o, o) for n in model.graph.node for o in n.output if o]
    for i, call, f in function_calls(model):
        results = dict(zip(f.output, call.output, strict=True))
        pairs += [(results.get(b, f"{b}__{i}"), b) for n in f.node for b in n.output if b]
    return pairs


def plan_names(model):
    """{a value of `model` inlined: the name a plan gives it} (`_named`; a call's result by
    its top-level name). `model`: a whole graph or a segment of it (one call, numbered 1 in
    it): the plan's names are the same in both."""
    names = {}
    for value, name in _named(model):
        names.setdefault(value, name)
    return names


def instances(model, plan):
    """The values of `model` inlined that the names `plan` keep in float32, as the compiler
    reads them: a body name in every call of its function → frozenset."""
    plan = set(plan)
    return frozenset(value for value, name in _named(model) if name in plan)


def calls_of(model, name):
    """(function name, its calls) of the body name `name`, or None for a top-level name."""
    counts = {}
    for _, _, f in function_calls(model):
        counts[f.name] = counts.get(f.name, 0) + 1
    for f in model.functions:
        if any(name in n.output for n in f.node):
            return f.name, counts.get(f.name, 0)
    return None
