"""A node-precision plan's files beside its graph: GRAPH.npi.yaml, QAIC's node-precision-info
(`FP32NodeInstanceNames:`, which compile.sh passes as `-node-precision-info`), and
GRAPH.npi.ref.json, the same nodes in `ref`'s terms (`ref.numerics.Record.key`s, paired by
`codegen.check.npi.RefPlan`), which `verify --precision` reads to keep them in float32 on
`ref`'s side too. A plan names values as the whole graph inlined names them; a layer-by-layer
run maps them to each segment's own names (`segment_keep`, `whole_names`)."""

import json
import os

import onnx

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
    """The names of a node-precision-info file, each checked to be a node output of `model`
    (inlined) → list; PlanError naming the first unknown one."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise PlanError(f"{path}: {e}") from e
    if not lines or lines[0].strip() != "FP32NodeInstanceNames:":
        raise PlanError(f"{path}: expected 'FP32NodeInstanceNames:' on its first line")
    names = [line.strip()[1:].strip().strip('"') for line in lines[1:] if line.strip()]
    made = {o for n in inline(model).graph.node for o in n.output}
    for name in names:
        if name not in made:
            raise PlanError(f"{path}: node output {name!r} is not in the graph")
    return names


def write_plan(folder, graph, model, precision, found, parted):
    """GRAPH.npi.yaml (QAIC's) and GRAPH.npi.ref.json (each node with `ref`'s name for it, and
    where the two device models parted) for the rows `found`; neither when it is empty (old
    ones removed)."""
    path, ref_path = (os.path.join(folder, graph + suffix) for suffix in (SUFFIX, REF_SUFFIX))
    if not found:
        for old in (path, ref_path):
            if os.path.exists(old):
                os.remove(old)
        return
    nodes = [{"onnx": name, "op": op, "ref": key} for _, name, op, key in found]
    atomic_text(path, npi_yaml([n["onnx"] for n in nodes]))
    read_npi(path, model)
    text = json.dumps({"precision": precision, "nodes": nodes, "parted": parted}, indent=2)
    atomic_text(ref_path, text + "\n")


def folder_plan(folder, graph, model):
    """The plan in `folder` for `graph` (its ModelProto `model`) → (node names, `ref` keys,
    note): empty with note None when the folder has none; the keys of the nodes the ref file
    pairs, and a note naming how many it does not (a hand-written file, or where the two
    device models parted)."""
    path, ref_path = (os.path.join(folder, graph + suffix) for suffix in (SUFFIX, REF_SUFFIX))
    if not os.path.exists(path):
        return [], [], None
    names = read_npi(path, model)
    paired = {}
    if os.path.exists(ref_path):
        with open(ref_path) as f:
            paired = {n["onnx"]: n["ref"] for n in json.load(f)["nodes"] if n["ref"]}
    keys = [paired[n] for n in names if n in paired]
    note = f"{graph + SUFFIX}: {len(names)} node(s) in float32, {len(keys)} of them in ref"
    return names, keys, note


def producers_of(segment):
    """{value name: the node making it} of the inlined `segment`."""
    return {o: n for n in inline(segment).graph.node for o in n.output}


def call_ordinals(model):
    """{function call node's name: its place (1, 2, …) among the graph's function calls}: the
    N of the "__N" suffix onnx's inliner gives the values of that call."""
    functions = {f.name for f in model.functions}
    calls = [n for n in model.graph.node if n.op_type in functions]
    return {n.name: i for i, n in enumerate(calls, start=1)}


def whole_names(segment, inlined, ordinals):
    """{a value's name in the inlined `segment` (`inlined`: its value names): its name in the
    whole graph inlined} for the values of the segment's layer call (named "…__1" there, as
    its graph's only call, and "…__N" in the whole graph, N = `ordinals[call]`); a glue
    segment's names are the whole graph's own (empty map)."""
    calls = [n for n in segment.graph.node if n.name in ordinals]
    if len(calls) != 1:
        return {}
    suffix = f"__{ordinals[calls[0].name]}"
    top = {o for n in segment.graph.node for o in n.output}
    return {o: o[: -len("__1")] + suffix for o in inlined if o.endswith("__1") and o not in top}


def segment_keep(segment, keep, ordinals):
    """The whole-graph names `keep` as `segment` names them: the plan names values as the whole
    graph inlined does; a segment names its call's "…__1" (and another call's "…__1" in the
    plan is not this one's) → frozenset."""
    if not keep:
        return frozenset()
    inlined = producers_of(onnx.ModelProto.FromString(segment.SerializeToString()))
    names = whole_names(segment, inlined, ordinals)
    mine = {a for a, b in names.items() if b in keep}
    return frozenset(mine | {n for n in keep if n not in names})
