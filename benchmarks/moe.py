"""What each way of running Gemma 4's experts costs: one 26B-A4B MoE layer's experts (hidden
2,816, 128 experts of 704, top 8) exported alone through jax2onnx in each mode of
`ref.moe_modes`, run in onnxruntime (CPU, float32).

Two comparisons, as QEfficient compiles them: a decode step (`--decode-tokens`, 1: batch 1)
dense vs gather, and a prefill chunk of `--tokens` (1,024) dense vs nsp (`--num-nsp` 16 cores,
`--packed-chunk` 256 rows). The expert weights are initializers, as in the exported graphs
(stored as ONNX external data beside the graph), so onnxruntime folds their transposes once
when the session is made; the runs are fed x, the router's weights and index.

Per case: the bytes of weights the matmuls read, their FLOPs, the ONNX graph's op set checked
against `codegen.lower.ops`, the session's creation time and its resident size once made
(the weights and whatever constants onnxruntime folded from them), the median onnxruntime time
of `--runs` (after one warm-up), the runs' peak RSS and what they added to the session's
resident size (the runs' own intermediates; each case runs in its own process), the largest
intermediate read off the graph (onnx shape inference; a tensor whose producer's inputs are all
initializers or constants counts as folded, not as an intermediate), and the largest
difference from dense (the same inputs: every mode must give dense's answer). Routing: each
token's top-k experts drawn uniformly. Prints markdown tables, then the prefill goal (nsp's
largest intermediate and added memory at most a core's share of dense's) checked for the whole
process and per core.

Memory: onnxruntime's constant folding of nsp's weight layout (transpose, per-core reshape and
transpose, per-slot slices) holds ~5.5× the weights while the session is made (3.85 GiB at 32
experts, 7.88 GiB at 64, 2026-12-04), so the real layer's nsp case needs ~16 GiB free; dense's
session peaks at ~1.7× the weights, and its prefill runs add ~2.7× (3.80 GiB at 64 experts).

    python benchmarks/moe.py                          # the real layer: ~3 GB of float32 weights
    python benchmarks/moe.py --experts 64             # half the experts: nsp's session ~8 GiB
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


def write_inputs(tokens, shape, folder):
    """The inputs at `tokens` rows: gate_up and down as raw float32 in one external-data file,
    the fed ones in an .npz → (the data file's name, {weight name: (offset, length)})."""
    hidden, experts, inter, _ = shape
    values = _inputs(tokens, *shape)
    np.savez(folder / f"feed_{tokens}.npz", **{k: values[k] for k in FED})
    name = f"weights_{tokens}.bin"
    spans = _spans(experts, hidden, inter)
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
    """In its own process: one graph's session and runs → JSON on stdout."""
    import onnxruntime as ort

    with np.load(args.feed) as f:
        feed = {k: f[k] for k in FED}
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    bare = _status_kib("VmRSS")
    start = time.perf_counter()
    session = ort.InferenceSession(args.case, options, providers=["CPUExecutionProvider"])
    made = time.perf_counter() - start
    _touch_mapped(Path(args.case).parent)
    made_peak = _status_kib("VmHWM")
    before = _status_kib("VmRSS")
    # reset the peak (Linux: clear_refs 5), so the runs' own peak is measured, not the session's
    Path("/proc/self/clear_refs").write_text("5")
    out = session.run(None, feed)[0]  # warm-up
    times = []
    for _ in range(args.runs):
        start = time.perf_counter()
        out = session.run(None, feed)[0]
        times.append(time.perf_counter() - start)
    peak = _status_kib("VmHWM")
    np.save(args.case + ".out.npy", out)
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
    cases = [
        ("decode", args.decode_tokens, MoeMode()),
        ("decode", args.decode_tokens, MoeMode("gather")),
        ("prefill", args.tokens, MoeMode()),
        ("prefill", args.tokens, nsp),
    ]
    shape = (args.hidden, args.experts, args.inter, args.top_k)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = {}
        for phase, tokens, mode in cases:
            if args.graphs_only:
                data[tokens] = ("weights.bin", _spans(args.experts, args.hidden, args.inter))
            elif tokens not in data:  # a weights file per row count (the seed's draws follow x)
                data[tokens] = write_inputs(tokens, shape, tmp)
            path = tmp / f"{phase}_{mode.name}.onnx"
            start = time.perf_counter()
            ops = export(mode, tokens, *shape, path, data[tokens])
            traced = time.perf_counter() - start
            found = intermediates(path, args.num_nsp)
            read, flops = costs(mode, tokens, *shape)
            row = dict(phase=phase, tokens=tokens, mode=mode, read=read, flops=flops,
                       traced=traced, ops=ops, found=found, r=None, diff=None)  # fmt: skip
            rows.append(row)
            if args.graphs_only:
                continue
            cmd = [sys.executable, __file__, "--case", str(path),
                   "--feed", str(tmp / f"feed_{tokens}.npz"), "--runs", str(args.runs)]  # fmt: skip
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode:
                raise SystemExit(done.stderr)
            r = row["r"] = json.loads(done.stdout.strip().splitlines()[-1])
            out = np.load(str(path) + ".out.npy")
            if mode.name == "dense":
                dense = out
            row["diff"] = float(np.abs(out - dense).max() / np.abs(dense).max())
            print(f"{phase} {mode}: session {r['made_s']:.1f} s, {_gib(r['session_kib'])} GiB "
                  f"(creation peak {_gib(r['made_peak_kib'])} GiB); run {r['s']:.3f} s, adds "
                  f"{_gib(r['run_kib'])} GiB", file=sys.stderr)  # fmt: skip
    report(args, rows)


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
        *(["rel diff vs dense"] if ran else []),
        "export s",
        "op types",
    ]
    print("| " + " | ".join(head) + " |")
    print("|---|---:|---|" + "---:|" * (len(head) - 3))
    base = {}
    for w in rows:
        cells = [w["phase"], f"{w['tokens']:,}", str(w["mode"]), f"{w['read'] / 2**20:,.0f} MiB",
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
              "made; run peak RSS: the peak of the warm-up and timed runs; run adds: that peak "
              "over the session's resident size.")  # fmt: skip
    print(f"\n| phase | mode | largest intermediate (whole process) | per core (tensors with "
          f"the {n} cores outermost split over them, others whole) | next largest |")  # fmt: skip
    print("|---|---|---|---|---|")
    for w in rows:
        found = w["found"]
        b, name, s, _ = found[0]
        core = "–"
        if w["mode"].name == "nsp":
            cb, cname, cs, split = per_core(found, n)
            core = f"{_mib(cb)}: `{cname}` {list(cs)}" + (f" / {n}" if split else " (whole)")
        nxt = ", ".join(f"{_mib(b2)} {list(s2)}" for b2, _, s2, _ in found[1:3])
        print(f"| {w['phase']} | {w['mode']} | {_mib(b)}: `{name}` {list(s)} | {core} | {nxt} |")
    prefill = {w["mode"].name: w for w in rows if w["phase"] == "prefill"}
    if {"dense", "nsp"} <= prefill.keys():
        dw, nw = prefill["dense"], prefill["nsp"]
        largest = dw["found"][0][0]
        whole = nw["found"][0][0]
        checks = [
            ("largest intermediate, whole process", whole, largest / n),
            ("largest intermediate, per core", per_core(nw["found"], n)[0], largest / n),
        ]
        if ran:
            dadd, nadd = dw["r"]["run_kib"] * 1024, nw["r"]["run_kib"] * 1024
            checks.append(("memory the runs add, whole process", nadd, dadd / n))
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
