"""What each way of running Gemma 4's experts costs: one 26B-A4B MoE layer's experts (hidden
2,816, 128 experts of 704, top 8) exported alone through jax2onnx in each mode of
`ref.moe_modes`, run in onnxruntime (CPU, float32).

Two comparisons, as QEfficient compiles them: a decode step (`--decode-tokens`, 1: batch 1)
dense vs gather, and a prefill chunk of `--tokens` (1,024) dense vs nsp (`--num-nsp` 16 cores,
`--packed-chunk` 256 rows), beside what one core of nsp runs: its E / num_nsp experts (slot s
is expert s·num_nsp + core) over the same tokens, each token's picks renumbered to them (nsp
with num_nsp 1; checked against numpy's float64 answer for those experts). The expert weights
are initializers, as in the exported graphs (stored as ONNX external data beside the graph),
so onnxruntime folds their transposes once when the session is made; the runs are fed x, the
router's weights and index. Sessions are made with the runner's options (the graph's own
order: onnxruntime's default order ran every chunk's MLP before the first scatter and held
all their outputs, 3.97 GiB more for nsp's runs).

Per case: the bytes of weights the matmuls read, their FLOPs, the ONNX graph's op set checked
against `codegen.lower.ops`, the session's creation time and its resident size once made
(the weights and whatever constants onnxruntime folded from them), the median onnxruntime time
of `--runs` (after one warm-up), a run's peak RSS and what it added to the session's resident
size (the run's own intermediates, in a session without onnxruntime's arena; each case runs in
its own process), the largest intermediate read off the graph (onnx shape inference; a tensor
whose producer's inputs are all initializers or constants counts as folded, not as an
intermediate), and the largest difference from dense (the same inputs: every mode must give
dense's answer). Routing: each token's top-k experts drawn uniformly. Prints markdown tables,
then the prefill goal (nsp's largest intermediate and added memory at most a core's share of
dense's) checked for one core and for the whole process.

Decode: gather's `Gather` copies the picked experts (1/16 of the bytes) before its matmuls
read them, so it moves ~3/16 of dense's bytes (read, write, read again): in onnxruntime it
can be at most ~5.3× faster than dense at equal bandwidth; standard ONNX has no matmul over
an indexed batch that would read them in place.

Memory: onnxruntime's constant folding of nsp's weight layout (per-slot slices and their
transposes) peaks at ~3× the weights while the session is made (8.85 GiB for the real
layer); dense's session at ~1× (2.92 GiB).
    python benchmarks/moe.py                          # the real layer: ~3 GB of float32 weights
    python benchmarks/moe.py --experts 64             # half the experts: nsp's session ~4.5 GiB
    python benchmarks/moe.py --experts 32 --tokens 256 --runs 1   # a quick look
    python benchmarks/moe.py --graphs-only            # op types, largest intermediates: 1 min
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WEIGHTS = ("gate_up", "down")  # the graph's initializers; the rest are fed
FED = ("x", "weights", "index")
ALIGN = 1 << 16  # external data offsets (onnxruntime maps the file's pages)


def _inputs(tokens, hidden, experts, inter, top_k, seed=0):
    """x [T, H], gate_up [E, 2I, H], down [E, H, I], weights [T, K], index [T, K] (float32,
    int32): the same for every mode at one T."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((tokens, hidden), dtype=np.float32)
    gate_up = rng.standard_normal((experts, 2 * inter, hidden), dtype=np.float32)
    down = rng.standard_normal((experts, hidden, inter), dtype=np.float32)
    gate_up *= 0.02  # in place: no second copy of 3 GB
    down *= 0.02
    index = np.argsort(rng.random((tokens, experts)), axis=1)[:, :top_k].astype(np.int32)
    weights = rng.dirichlet(np.ones(top_k), tokens).astype(np.float32)
    return {"x": x, "gate_up": gate_up, "down": down, "weights": weights, "index": index}


def _spans(experts, hidden, inter):
    """{weight: (offset, length)} of gate_up and down in the external-data file."""
    spans, end = {}, 0
    for key, size in zip(WEIGHTS, (2 * inter * hidden, hidden * inter), strict=True):
        offset = end + (-end % ALIGN)
        spans[key] = (offset, 4 * experts * size)
        end = offset + 4 * experts * size
    return spans


def one_core(values, num_nsp, core=0):
    """The inputs of what core `core` of num_nsp computes in nsp: its experts (slot s is expert
    s·num_nsp + core: `ref.gemma4.moe.slot_experts`), and each token's picks renumbered to
    them, -1 where a pick is another core's (no expert: not routed here) → the values of
    `_inputs` for the one-core graph (nsp with num_nsp 1 over E / num_nsp experts)."""
    index = values["index"]
    mine = index % num_nsp == core
    return {**values, "gate_up": values["gate_up"][core::num_nsp],
            "down": values["down"][core::num_nsp],
            "index": np.where(mine, index // num_nsp, -1).astype(np.int32)}  # fmt: skip


def core_partial(values):
    """numpy float64, sharing nothing with `ref`: the one-core inputs' answer, each token's
    gated MLP (tanh GELU) over its picks among the core's experts, weighted → [T, H]."""
    x, index, weights = values["x"].astype(np.float64), values["index"], values["weights"]
    out = np.zeros_like(x)
    for e, (gu, dn) in enumerate(zip(values["gate_up"], values["down"], strict=True)):
        tokens, k = np.nonzero(index == e)
        gate, up = np.split(x[tokens] @ gu.T.astype(np.float64), 2, axis=1)
        act = 0.5 * gate * (1 + np.tanh(np.sqrt(2 / np.pi) * (gate + 0.044715 * gate**3)))
        out[tokens] += weights[tokens, k][:, None] * ((act * up) @ dn.T.astype(np.float64))
    return out


def write_inputs(values, tag, folder):
    """`values` (`_inputs`) under `tag`: gate_up and down as raw float32 in one external-data
    file, the fed ones in feed_TAG.npz → (the data file's name, {weight name: (offset,
    length)})."""
    experts, two_inter, hidden = values["gate_up"].shape
    np.savez(folder / f"feed_{tag}.npz", **{k: values[k] for k in FED})
    name = f"weights_{tag}.bin"
    spans = _spans(experts, hidden, two_inter // 2)
    with open(folder / name, "wb") as f:
        for key in WEIGHTS:
            f.write(b"\0" * (spans[key][0] - f.tell()))
            assert values[key].nbytes == spans[key][1], key
            values[key].tofile(f)
    return name, spans


def costs(mode, tokens, hidden, experts, inter, top_k):
    """(weight bytes the matmuls read, matmul FLOPs) of one call in `mode` (float32)."""
    per_expert = 3 * hidden * inter  # gate, up, down
    if mode.name == "gather":  # each token's k experts' matrices, gathered
        return 4 * tokens * top_k * per_expert, 2 * tokens * top_k * per_expert
    if mode.name == "nsp":  # every chunk of every expert runs (static shapes)
        chunks = tokens // mode.packed_chunk
        return 4 * chunks * experts * per_expert, 2 * tokens * experts * per_expert
    return 4 * experts * per_expert, 2 * tokens * experts * per_expert


def export(mode, tokens, hidden, experts, inter, top_k, path, data):
    """Write the experts in `mode` as an ONNX graph, gate_up and down initializers in the
    external-data file `data` = (name beside `path`, {weight: (offset, length)}) → its op
    types."""
    import jax
    import onnx
    from jax2onnx import to_onnx

    from codegen.check import structure as checks
    from codegen.lower.ops import OPSET
    from ref.gemma4 import moe

    def fn(x, gate_up, down, weights, index):
        return moe.run(mode, x, gate_up, down, weights, index)

    shapes = [
        ((tokens, hidden), "float32"),
        ((experts, 2 * inter, hidden), "float32"),
        ((experts, hidden, inter), "float32"),
        ((tokens, top_k), "float32"),
        ((tokens, top_k), "int32"),
    ]
    args = [jax.ShapeDtypeStruct(s, d) for s, d in shapes]
    model = to_onnx(fn, args, model_name=f"moe_{mode.name}", opset=OPSET,
                    input_names=["x", "gate_up", "down", "weights", "index"],
                    output_names=["out"])  # fmt: skip
    checks.allowed_ops(model)
    # the weights become initializers held as external data, as in the exported graphs
    location, spans = data
    inputs = {i.name: i for i in model.graph.input}
    for key in WEIGHTS:
        dims = [d.dim_value for d in inputs[key].type.tensor_type.shape.dim]
        model.graph.input.remove(inputs[key])
        t = model.graph.initializer.add()
        t.name, t.data_type = key, onnx.TensorProto.FLOAT
        t.dims.extend(dims)
        t.data_location = onnx.TensorProto.EXTERNAL
        offset, length = spans[key]
        assert length == 4 * int(np.prod(dims)), (key, dims, length)
        for k, v in (("location", location), ("offset", offset), ("length", length)):
            entry = t.external_data.add()
            entry.key, entry.value = k, str(v)
    assert [i.name for i in model.graph.input] == list(FED), model.graph.input
    path.write_bytes(model.SerializeToString())
    nodes = [*model.graph.node, *(n for f in model.functions for n in f.node)]
    return sorted({n.op_type for n in nodes})


def intermediates(path, num_nsp):
    """The graph's non-constant tensors, read with onnx shape inference (external data not
    loaded): a tensor is constant when it is an initializer or every input of its producer is
    → [(bytes, name, shape, split)], largest first. split: the cores are its outermost axis
    (a leading axis of num_nsp, or a Reshape that merges such an axis with the next ones:
    jax2onnx's scatters flatten [C, P, ...] to [C·P, ...]), so one core holds bytes / num_nsp."""
    import onnx
    from onnx import helper, inliner, shape_inference

    model = onnx.load(str(path), load_external_data=False)
    if model.functions:
        model = inliner.inline_local_functions(model)
    model = shape_inference.infer_shapes(model, strict_mode=True, data_prop=True)
    g = model.graph
    types = {v.name: v.type.tensor_type for v in [*g.value_info, *g.output]}
    missing = {o for n in g.node for o in n.output if o and o not in types}
    if missing:
        raise SystemExit(f"{path.name}: shape inference gave no type for {sorted(missing)[:5]}")
    const = {t.name for t in g.initializer}
    shapes = {t.name: list(t.dims) for t in g.initializer}
    for v in g.input:
        shapes[v.name] = [d.dim_value for d in v.type.tensor_type.shape.dim]
    unknown = []
    found = []
    split = set()
    for node in g.node:
        subgraph = any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
                       for a in node.attribute)  # fmt: skip
        folded = not subgraph and all(i in const for i in node.input if i)
        for name in filter(None, node.output):
            t = types.get(name)
            dims = [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim]
            if node.op_type == "Reshape" and dims.count(None) == 1 and node.input[0] in shapes:
                # a shape computed in the graph (jax2onnx's scatters): a Reshape keeps its
                # input's element count, so the one unknown dim follows from it
                known = int(np.prod([d for d in dims if d is not None]))
                dims[dims.index(None)] = int(np.prod(shapes[node.input[0]])) // known
            if folded:
                const.add(name)
            if None in dims:
                unknown.append(name)
                continue
            shapes[name] = dims
            if dims and dims[0] == num_nsp:
                split.add(name)
            elif node.op_type == "Reshape" and node.input[0] in split and dims:
                source = shapes[node.input[0]]
                if dims[0] in np.cumprod(source) and dims[0] % num_nsp == 0:
                    split.add(name)
            if not folded:
                size = np.dtype(helper.tensor_dtype_to_np_dtype(t.elem_type)).itemsize
                found.append((size * int(np.prod(dims, dtype=np.int64)), name, tuple(dims),
                              name in split))  # fmt: skip
    if unknown:
        raise SystemExit(f"{path.name}: no static shape for {len(unknown)} tensors: {unknown[:5]}")
    return sorted(found, reverse=True)


def per_core(found, num_nsp):
    """The largest tensor one core holds: a tensor split over the cores (see `intermediates`)
    by num_nsp, any other whole → (bytes, name, shape, split)."""
    return max((b // num_nsp if c else b, n, s, c) for b, n, s, c in found)


def _status_kib(field):
    """A field of /proc/self/status in KiB (VmRSS: now; VmHWM: the peak since the last reset)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise SystemExit(f"/proc/self/status has no {field}")


def _touch_mapped(folder):
    """Read one byte of every page the process maps from a .bin file in `folder`: onnxruntime
    maps the external data (whatever its offset) and keeps the mapping where a weight is used
    as it is (gather's), so its pages count in the session's resident size, not in the run
    that first touches them. (The page cache holds them: reading copies nothing.)"""
    import ctypes

    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if (
            len(fields) < 6
            or not fields[5].startswith(str(folder))
            or not fields[5].endswith(".bin")
        ):
            continue
        lo, hi = (int(a, 16) for a in fields[0].split("-"))
        pages = np.ctypeslib.as_array((ctypes.c_uint8 * (hi - lo)).from_address(lo))
        int(pages[::4096].sum())


def run_case(args):
    """In its own process: one graph's session and runs → JSON on stdout. Two sessions, made
    with the runner's options (`codegen.folder.sessions.options`): the first without
    onnxruntime's memory arena for the memory figures (the process's peak then follows the
    live tensors, not the freed blocks an arena keeps) and one run; then one with the arena,
    as the runner makes them, for the timed runs (without it every run maps its large tensors
    afresh: gather's decode step took 63 ms instead of ~18)."""
    import onnxruntime as ort

    from codegen.folder.sessions import options as runner_options

    with np.load(args.feed) as f:
        feed = {k: f[k] for k in FED}

    def make(arena):
        options = runner_options()
        options.enable_cpu_mem_arena = arena
        return ort.InferenceSession(args.case, options, providers=["CPUExecutionProvider"])

    bare = _status_kib("VmRSS")
    start = time.perf_counter()
    session = make(arena=False)
    made = time.perf_counter() - start
    _touch_mapped(Path(args.case).parent)
    made_peak = _status_kib("VmHWM")
    before = _status_kib("VmRSS")
    # reset the peak (Linux: clear_refs 5), so the run's own peak is measured, not the session's
    Path("/proc/self/clear_refs").write_text("5")
    out = session.run(None, feed)[0]
    peak = _status_kib("VmHWM")
    np.save(args.case + ".out.npy", out)
    del session
    session = make(arena=True)
    session.run(None, feed)  # warm-up
    times = []
    for _ in range(args.runs):
        start = time.perf_counter()
        session.run(None, feed)
        times.append(time.perf_counter() - start)
    print(json.dumps({"s": statistics.median(times), "made_s": made, "bare_kib": bare,
                      "made_peak_kib": made_peak, "session_kib": before, "peak_kib": peak,
                      "run_kib": peak - before}))  # fmt: skip


def _mib(n):
    return f"{n / 2**20:,.1f} MiB"


def _gib(kib):
    return f"{kib / 2**20:.2f}"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=2816)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--inter", type=int, default=704, help="moe_intermediate_size")
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--tokens", type=int, default=1024, help="prefill chunk (batch × seq_len)")
    p.add_argument("--decode-tokens", type=int, default=1, help="decode rows (batch)")
    p.add_argument("--num-nsp", type=int, default=16)
    p.add_argument("--packed-chunk", type=int, default=256)
    p.add_argument("--runs", type=int, default=2, help="timed runs per case (median)")
    p.add_argument("--graphs-only", action="store_true",
                   help="export and read the graphs (op types, largest intermediates) without "
                        "weights or runs: seconds, no memory")  # fmt: skip
    p.add_argument("--case", help=argparse.SUPPRESS)
    p.add_argument("--feed", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.case:
        return run_case(args)

    from ref.moe_modes import MoeMode

    nsp = MoeMode("nsp", args.num_nsp, args.packed_chunk)
    nsp.check(args.experts, args.tokens)
    n = args.num_nsp
    core = f"nsp, core 0 of {n}"
    cases = [  # (phase, tokens, mode, label, experts)
        ("decode", args.decode_tokens, MoeMode(), "dense", args.experts),
        ("decode", args.decode_tokens, MoeMode("gather"), "gather", args.experts),
        ("prefill", args.tokens, MoeMode(), "dense", args.experts),
        ("prefill", args.tokens, nsp, str(nsp), args.experts),
        # what one core runs: its E / num_nsp experts, nsp over one core
        ("prefill", args.tokens, MoeMode("nsp", 1, args.packed_chunk), core, args.experts // n),
    ]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = {}
        for phase, tokens, mode, label, experts in cases:
            shape = (args.hidden, experts, args.inter, args.top_k)
            tag = f"{tokens}_core" if label == core else str(tokens)
            if args.graphs_only:
                data[tag] = ("weights.bin", _spans(experts, args.hidden, args.inter))
            elif tag not in data:  # a weights file per row count (the seed's draws follow x)
                data.update(prepare(tokens, (args.hidden, args.experts, args.inter, args.top_k),
                                    n, tmp, with_core=phase == "prefill"))  # fmt: skip
            path = tmp / f"{phase}_{tag}_{mode.name}.onnx"
            start = time.perf_counter()
            ops = export(mode, tokens, *shape, path, data[tag])
            traced = time.perf_counter() - start
            found = intermediates(path, mode.num_nsp if mode.name == "nsp" else n)
            read, flops = costs(mode, tokens, *shape)
            row = dict(phase=phase, tokens=tokens, mode=mode, label=label, read=read, flops=flops,
                       traced=traced, ops=ops, found=found, r=None, diff=None)  # fmt: skip
            rows.append(row)
            if args.graphs_only:
                continue
            cmd = [sys.executable, __file__, "--case", str(path), "--feed",
                   str(tmp / f"feed_{tag}.npz"), "--runs", str(args.runs)]  # fmt: skip
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode:
                raise SystemExit(done.stderr)
            r = row["r"] = json.loads(done.stdout.strip().splitlines()[-1])
            out = np.load(str(path) + ".out.npy")
            if label == "dense":
                expected = out
            elif label == core:  # the core's own share: numpy's float64 answer
                expected = np.load(tmp / f"expected_{tag}.npy")
            row["diff"] = float(np.abs(out - expected).max() / np.abs(expected).max())
            print(f"{phase} {label}: session {r['made_s']:.1f} s, {_gib(r['session_kib'])} GiB "
                  f"(creation peak {_gib(r['made_peak_kib'])} GiB); run {r['s']:.3f} s, adds "
                  f"{_gib(r['run_kib'])} GiB", file=sys.stderr)  # fmt: skip
    report(args, rows)


def prepare(tokens, shape, num_nsp, folder, with_core):
    """The inputs at `tokens` rows written under `folder` (`write_inputs`), and with_core those
    of core 0 (`one_core`) with numpy's answer for them (expected_TAG.npy) → {tag: data}."""
    values = _inputs(tokens, *shape)
    data = {str(tokens): write_inputs(values, str(tokens), folder)}
    if not with_core:
        return data
    core = one_core(values, num_nsp)
    del values
    data[f"{tokens}_core"] = write_inputs(core, f"{tokens}_core", folder)
    np.save(folder / f"expected_{tokens}_core.npy", core_partial(core))
    return data


def report(args, rows):
    """The markdown tables and the prefill goal, from the cases' rows."""
    n = args.num_nsp
    ran = rows[0]["r"] is not None
    how = f"onnxruntime CPU float32, median of {args.runs}" if ran else "graphs only, not run"
    print(f"experts: hidden {args.hidden}, {args.experts} experts of {args.inter}, top "
          f"{args.top_k}; weights as initializers (external data); {how}\n")  # fmt: skip
    head = ["phase", "tokens", "mode", "weight bytes read", "GFLOP"]
    if ran:
        head += ["ort s", "vs dense", "session s", "session RSS GiB", "creation peak GiB",
                 "run peak RSS GiB", "run adds GiB"]  # fmt: skip
    head += [
        "largest intermediate",
        *(["rel diff"] if ran else []),
        "export s",
        "op types",
    ]
    print("| " + " | ".join(head) + " |")
    print("|---|---:|---|" + "---:|" * (len(head) - 3))
    base = {}
    for w in rows:
        cells = [w["phase"], f"{w['tokens']:,}", w["label"], f"{w['read'] / 2**20:,.0f} MiB",
                 f"{w['flops'] / 1e9:,.1f}"]  # fmt: skip
        r = w["r"]
        if ran:
            base.setdefault(w["phase"], r["s"])
            cells += [f"{r['s']:.3f}", f"{r['s'] / base[w['phase']]:.2f}", f"{r['made_s']:.1f}",
                      _gib(r["session_kib"]), _gib(r["made_peak_kib"]), _gib(r["peak_kib"]),
                      _gib(r["run_kib"])]  # fmt: skip
        cells.append(_mib(w["found"][0][0]))
        if ran:
            cells.append(f"{w['diff']:.1e}")
        cells += [f"{w['traced']:.1f}", str(len(w["ops"]))]
        print("| " + " | ".join(cells) + " |")
    if ran:
        print("\nsession RSS: resident once the session is made (the weights and the constants "
              "onnxruntime folded from them), the process alone before it "
              f"{_gib(rows[0]['r']['bare_kib'])} GiB; creation peak: the peak RSS while it was "
              "made; run peak RSS: the peak of one run; run adds: that peak over the session's "
              "resident size (a session without onnxruntime's arena; the timed runs use one "
              "with it, as the runner does). rel diff: the largest difference from dense's "
              "answer over dense's largest; the one core's from numpy's float64 answer for "
              "its experts alone.")  # fmt: skip
    print(f"\n| phase | mode | largest intermediate (whole process) | per core (tensors with "
          f"the {n} cores outermost split over them, others whole) | next largest |")  # fmt: skip
    print("|---|---|---|---|---|")
    for w in rows:
        found = w["found"]
        b, name, s, _ = found[0]
        core = "–"
        if w["mode"].name == "nsp" and w["mode"].num_nsp == n:
            cb, cname, cs, split = per_core(found, n)
            core = f"{_mib(cb)}: `{cname}` {list(cs)}" + (f" / {n}" if split else " (whole)")
        nxt = ", ".join(f"{_mib(b2)} {list(s2)}" for b2, _, s2, _ in found[1:3])
        print(f"| {w['phase']} | {w['label']} | {_mib(b)}: `{name}` {list(s)} | {core} | {nxt} |")
    goal(args, rows)


def goal(args, rows):
    """The prefill goal: nsp's largest intermediate and peak memory at most a core's share of
    dense's (1/num_nsp), for one core (its own graph, and the tensors split over the cores in
    the whole graph) and for the whole process."""
    n = args.num_nsp
    ran = rows[0]["r"] is not None
    prefill = [w for w in rows if w["phase"] == "prefill"]
    dw, nw, cw = prefill  # dense, nsp over every core, one core's share
    largest = dw["found"][0][0]
    whole = nw["found"][0][0]
    checks = [
        ("largest intermediate, one core's graph", cw["found"][0][0], largest / n),
        ("largest intermediate, per core of the whole graph", per_core(nw["found"], n)[0],
         largest / n),
        ("largest intermediate, whole process", whole, largest / n),
    ]  # fmt: skip
    if ran:
        dadd, nadd, cadd = (w["r"]["run_kib"] * 1024 for w in prefill)
        checks += [("memory the runs add, one core's graph", cadd, dadd / n),
                   ("memory the runs add, whole process", nadd, dadd / n)]  # fmt: skip
    print(f"\nprefill goal (nsp's largest intermediate and peak memory at most a core's "
          f"share of dense, 1/{n} of dense's):")  # fmt: skip
    for what, got, bound in checks:
        verdict = "met" if got <= bound else "not met"
        print(f"- {what}: {_mib(got)} vs a core's share of dense {_mib(bound)} "
              f"({got / bound:.2f}×): {verdict}")  # fmt: skip
    ratio = f"- nsp vs dense: largest intermediate {whole / largest:.3f}×"
    if ran:
        ratio += f", memory the runs add {nadd / dadd:.3f}×"
    print(ratio)


if __name__ == "__main__":
    main()
