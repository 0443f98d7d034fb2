"""`verify OUT`: every graph in onnxruntime (float32) against `ref` at every specialization.

The folder is reopened as the checkpoint it is (config.json + the linked shards), each graph's
GraphSpec is rebuilt from the manifest, random inputs are drawn per specialization, and
onnxruntime's outputs are compared with the `ref` composition's (for attention graphs: the
dense reference, not the blocked code that was exported) on the same float32 weights.
"""

import dataclasses
import zlib

import jax
import numpy as np

from codegen import graphs
from codegen.check import by_function, layerwise, segments
from codegen.check.layer_buffers import float32_bytes
from codegen.folder.manifest import VerifyError
from codegen.folder.opened import open_folder
from codegen.folder.sessions import open_session
from codegen.graphs import kinds

RTOL = layerwise.RTOL  # max |ort − ref| ≤ RTOL · max |ref|: float32 reassociation
# Graphs whose float32 weights exceed this are checked layer by layer by default (every
# released size; the tiny default model stays whole).
LAYERWISE_BYTES = 256 << 20
# the kinds of graph whose layer functions `check.layerwise` can check one call at a time
LAYERED_KINDS = ("vision", "audio", "prefill", "decode", "language", "speculate")


def rebuild(entry, checkpoint):
    """The GraphSpec a manifest entry (`codegen.folder.manifest.Graph`) was exported from
    (`codegen.graphs.kinds`), layers inlined."""
    shapes = {n: info.shape for n, info in checkpoint.tensors.items()}
    try:
        return kinds.build(entry.kind, entry.name, checkpoint.config, shapes, entry.options,
                           use_functions=False)  # fmt: skip
    except kinds.KindError as e:
        raise VerifyError(str(e)) from e


def _sample(spec, s, seed):
    rng = np.random.default_rng([seed, zlib.crc32(f"{spec.name}/{s['name']}".encode())])
    return spec.sample(s["symbols"], rng)


def _compiled_layers():
    """A `graphs.layer_check` hook applying each routed layer through one `jax.jit` per layer
    kind (the kind's static inputs and structure are the same at every call), where eager
    `ref` compiles each of a layer's operations apart: the default export's verify ran 733 such
    programs. A call given a drawn cache is applied eagerly as before."""
    programs = {}

    def hook(module, kind, slot, arrays):
        params = jax.tree_util.tree_leaves(module.variables["params"])
        inputs = [*arrays, *params]
        if not all(isinstance(x, (jax.Array, np.ndarray)) for x in inputs):
            return slot.apply(inputs)
        if kind not in programs:
            programs[kind] = jax.jit(slot.apply)
        return programs[kind](inputs)

    return hook


def _whole(spec, entry, folder, checkpoint, seed):
    """Rows (specialization, output, err, rel, where, ok) of the whole graph in onnxruntime
    against `ref` with every weight loaded."""
    session = open_session(entry, folder, checkpoint)
    weights = {n: checkpoint.read(n).astype(np.float32) for n in spec.weights}
    rows = []
    for s in spec.specializations:
        feed = graphs.drawn_feed(_sample(spec, s, seed))
        with graphs.layer_scope(), graphs.layer_check(_compiled_layers()):
            want = spec.reference(feed, weights)
        got = dict(
            zip([o.name for o in session.get_outputs()], session.run(None, feed), strict=True)
        )
        for t in spec.outputs:
            err, rel = layerwise.error(got[t.name], want[t.name])
            # token ids (the speculate graph's) must be exact; floats within RTOL
            ok = layerwise.passes(err, rel, exact=t.dtype.startswith("int"))
            rows.append((s["name"], t.name, err, rel, "whole graph", bool(ok)))
    return rows


def _layered(spec, model, folder, checkpoint, seed, log, chosen=None):
    """Rows as `_whole`'s, checked layer by layer (`check.layerwise`) on the graph `model`;
    chosen: the calls checked by layer function (`by_function.chosen_calls`), None: all."""
    rows = []
    stand_ins = by_function.StandIns(seed, checkpoint)  # shared: a call checked once per shapes
    for s in spec.specializations:
        feed = _sample(spec, s, seed)
        found = layerwise.verify_specialization(
            spec, model, folder, checkpoint, feed, log, chosen, stand_ins
        )
        rows += [(s["name"], *r) for r in found]
        worst = max(found, key=lambda r: r[2])
        bad = sum(not r[-1] for r in found)
        log(f"  {spec.name} {s['name']}: {len(found) - bad} of {len(found)} outputs ok, worst "
            f"{worst[0]} {worst[2]:.2e} at {worst[3]}")  # fmt: skip
    return rows


def way(spec, entry, model, checkpoint, layerwise_given=None):
    """ "layers" or "whole": how `verify` checks this graph (`model`, its ModelProto). Vision,
    audio and language graphs whose layers are ONNX functions go layer by layer when asked
    (layerwise_given True) or, by default, when their float32 weights exceed LAYERWISE_BYTES;
    everything else whole."""
    if layerwise_given is False or entry.kind not in LAYERED_KINDS:
        return "whole"
    if not segments.has_layers(model):
        return "whole"
    if layerwise_given or float32_bytes(spec, checkpoint) > LAYERWISE_BYTES:
        return "layers"
    return "whole"


def selected(export, graphs=None, specializations=None):
    """[(manifest entry, GraphSpec, ModelProto without weights)] of the graphs of the opened
    `export` (`opened.Export`) named in `graphs` (default all), each spec keeping only its
    specializations named in `specializations` (default all; a graph with none of them is
    left out). A name the export lacks is a VerifyError. A specialization's sample does not
    depend on which others are checked."""
    folder, manifest, checkpoint = export.folder, export.manifest, export.checkpoint
    names = [e.name for e in manifest.graphs]
    unknown = sorted(set(graphs or ()) - set(names))
    if unknown:
        raise VerifyError(f"{folder}: no graph {unknown[0]!r}; the export has {names}")
    chosen = []
    for entry in manifest.graphs:
        if not graphs or entry.name in graphs:
            chosen.append((entry, rebuild(entry, checkpoint)))
    known = [s["name"] for _, spec in chosen for s in spec.specializations]
    unknown = sorted(set(specializations or ()) - set(known))
    if unknown:
        raise VerifyError(
            f"{folder}: no specialization {unknown[0]!r} in the graphs checked; they have {known}"
        )
    out = []
    for entry, spec in chosen:
        keep = [
            s for s in spec.specializations if not specializations or s["name"] in specializations
        ]
        if keep:
            spec = dataclasses.replace(spec, specializations=tuple(keep))
            out.append((entry, spec, export.graph(entry)))
    return out


def opened(folder, check_shards=True, graphs=None, specializations=None):
    """(absolute folder, its checkpoint, `selected` graphs) of the export `folder` (a path,
    opened and checked first: `opened.open_folder`; or an `opened.Export`)."""
    export = open_folder(folder, check_shards=check_shards)
    chosen = selected(export, graphs, specializations)
    return export.folder, export.checkpoint, chosen


def _ways(spec, entry, model, checkpoint, layerwise_given, calls):
    """ "functions", "layers" or "whole": `way`, then by layer function when a graph checked
    layer by layer calls for it (`by_function.use_by_function`; calls "one" asks for it)."""
    given = True if calls == "one" else layerwise_given
    how = way(spec, entry, model, checkpoint, given)
    if how == "layers" and by_function.use_by_function(spec, model, checkpoint, calls):
        return "functions"
    return how


WAYS = {"functions": "by layer function", "layers": "layer by layer", "whole": "whole graph"}


def verify(
    folder, *, seed=0, check_shards=True, layerwise_given=None, log=None, graphs=None,
    specializations=None, calls=None,
):  # fmt: skip
    """Rows (graph, specialization, output, max abs error, relative error, where, ok) for every
    graph, specialization and output of the export `folder` (a path, checked first:
    `read_manifest`; or an `opened.Export`). where: "whole graph", or for a graph checked
    layer by layer (`way`) the layer (or "glue") with the largest error. log(line): progress,
    one line per graph and, layer by layer, per layer and per specialization. graphs,
    specializations: the names of those to check (default all; `selected`). calls: "one"
    checks the layer graphs by layer function (`by_function`: a row "bindings" for the proof,
    one call per function chosen by `seed`), "every" each call; None: by function where
    `by_function.use_by_function` says."""
    log = log or (lambda line: None)
    folder, checkpoint, chosen = opened(folder, check_shards, graphs, specializations)
    rows = []
    for entry, spec, model in chosen:
        how = _ways(spec, entry, model, checkpoint, layerwise_given, calls)
        gib = float32_bytes(spec, checkpoint) / 2**30
        log(f"verify {spec.name}: {WAYS[how]} ({gib:.2f} GiB of float32 weights)")
        if how == "functions":
            picked = by_function.chosen_calls(model, seed, spec.name)
            log(f"  {spec.name}: checked {by_function.described(picked, model)} (seed {seed})")
            proof = by_function.proof_row(entry, model, folder, checkpoint, log)
            found = [proof]
            if proof[-1]:  # a graph bound otherwise than `ref` may not even run
                found += _layered(spec, model, folder, checkpoint, seed, log, picked)
        elif how == "layers":
            found = _layered(spec, model, folder, checkpoint, seed, log)
        else:
            found = _whole(spec, entry, folder, checkpoint, seed)
        rows += [(spec.name, *r) for r in found]
    return rows


def table(rows):
    """The verify table as text."""
    head = ("graph", "specialization", "output", "max abs err", "rel err", "worst at", "ok")
    body = [
        (g, s, o, f"{e:.2e}", f"{r:.2e}", w, "ok" if ok else "MISMATCH")
        for g, s, o, e, r, w, ok in rows
    ]
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in [head, *body]
    )
