"""`drift OUT --plans`: does a node-precision plan hold? Greedy tokens of the exported graphs in
onnxruntime — float32 against the device model of the same graphs (`device_graph.device_graph`:
every float tensor rounded to the format but the plan's node outputs, a body name's in every
call of its function, as the compiler reads it) — under three plans side by side: none, the
measured one (`verify --precision --write-npi`: GRAPH.npi.yaml in the folder), and
QEfficient's rule (every float node output but the MatMuls' in float32, its
`generate_npi_file` applied to the whole graph), each with its count of node results kept.

It runs the graphs QAIC compiles, not `ref`: the plan names their node outputs.
"""

import os

import numpy as np
import onnx

from codegen.check.device_graph import device_graph, float_tensors, inline
from codegen.check.drift import random_prompt
from codegen.check.plan_file import SUFFIX, instances, plan_names, read_npi
from codegen.check.precision import table
from codegen.folder.sessions import session_at
from codegen.run.runtime import Runner


def _kinds(runner):
    """One runner kind per exported graph (a language program serves prefill and decode)."""
    return list({runner.entries[k].name: k for k in runner.programs}.values())


def _graph(runner, kind):
    entry = runner.entries[kind]
    return entry, onnx.load(os.path.join(runner.folder, entry.file), load_external_data=False)


def measured_plan(runner):
    """{graph kind: node names} from the folder's GRAPH.npi.yaml files (none: an empty plan)."""
    plan = {}
    for kind in _kinds(runner):
        entry, model = _graph(runner, kind)
        path = os.path.join(runner.folder, entry.name + SUFFIX)
        plan[kind] = read_npi(path, model) if os.path.exists(path) else []
    return plan


def rule_plan(runner):
    """{graph kind: every float node output but the MatMuls', as the compiled file names them
    (top level and function bodies)}: QEfficient's rule of float32 everywhere but the
    matmuls, its `generate_npi_file` applied to the whole graph."""
    plan = {}
    for kind in _kinds(runner):
        _, model = _graph(runner, kind)
        inlined, named = inline(model), plan_names(model)
        made = set(float_tensors(inlined)[1])
        kept = {named[o] for n in inlined.graph.node if n.op_type != "MatMul"
                for o in n.output if o in made}  # fmt: skip
        plan[kind] = sorted(kept)
    return plan


def device_runner(folder, precision, plan):
    """(a Runner over the folder (an opened `Export`, or a path) whose graphs run in the
    device model with `plan` kept float32, the number of node results it keeps: a body
    name's in every call)."""
    runner, count = Runner(folder, check_shards=False), 0
    for kind in _kinds(runner):
        entry, model = _graph(runner, kind)
        kept = instances(model, plan.get(kind, ()))
        device, _, _ = device_graph(model, precision, kept, stats=False)
        path = os.path.join(runner.folder, f".drift.{entry.name}.onnx")
        runner.programs[kind].session = session_at(device, path)
        count += len(kept)
    return runner, count


def plan_drift(folder, model, *, prompts, precision, max_new_tokens=8, seed=0):
    """Tokens of float32 graphs against the device graphs under no plan, the measured plan and
    QEfficient's rule over `prompts` random prompts with an image each (`model`: the folder's
    `ref.gemma4.Gemma4`, for the prompts' tokens) → rows (plan, float32 node results (a body
    name's counted in every call), tokens equal, total, prompts identical)."""
    exact = Runner(folder, check_shards=False)
    rng = np.random.default_rng(seed)
    cases = [random_prompt(model, rng) for _ in range(prompts)]

    def tokens(runner):
        return [
            runner.generate(
                [ids], [(patches[0], grids[0])], max_new_tokens=max_new_tokens, stop=()
            )[0]  # fmt: skip
            for ids, patches, grids in cases
        ]

    want = tokens(exact)
    plans = {"none": {}, "measured": measured_plan(exact), "QEfficient's rule": rule_plan(exact)}
    rows = []
    for name, plan in plans.items():
        runner, count = device_runner(exact.export, precision, plan)  # the folder opened once
        got = tokens(runner)
        same = sum(int(np.sum(g == w)) for g, w in zip(got, want, strict=True))
        identical = sum(bool(np.array_equal(g, w)) for g, w in zip(got, want, strict=True))
        rows.append((name, count, same, prompts * max_new_tokens, identical))
    return rows


def plan_drift_table(rows, precision, prompts):
    head = ("plan", "float32 nodes", "tokens equal", "prompts identical")
    body = [(n, c, f"{s}/{t} = {s / t:.1%}", f"{i}/{prompts}") for n, c, s, t, i in rows]
    return "\n".join([f"float32 graphs vs {precision} device graphs", table(head, body)])
