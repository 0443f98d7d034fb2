"""`verify OUT`: every graph in onnxruntime (float32) against `ref` at every specialization.

The folder is reopened as the checkpoint it is (config.json + the linked shards), each graph's
GraphSpec is rebuilt from the manifest, random inputs are drawn per specialization, and
onnxruntime's outputs are compared with the `ref` composition's (for attention graphs: the
dense reference, not the blocked code that was exported) on the same float32 weights.
"""

import json
import os
import zlib

import numpy as np
import onnx
import onnxruntime as ort

from codegen import attention_graph, external, graphs, model_graphs, vision_graph
from codegen.export import MANIFEST
from codegen.integrity import check_folder
from weights import open_checkpoint

RTOL = 1e-5  # max |ort − ref| ≤ RTOL · max |ref|: float32 reassociation across a few layers


class VerifyError(ValueError):
    """The folder is not an export this version can verify."""


def rebuild(entry, checkpoint):
    """The GraphSpec a manifest entry was exported from."""
    shapes = {n: info.shape for n, info in checkpoint.tensors.items()}
    o = entry["options"]
    if entry["kind"] == "vision":
        # exports before the tiles option attended with the dense mask: one tile each way
        tiles = o.get("tiles", (1, 1))
        return vision_graph.vision_graph(
            checkpoint.config, shapes, o["budgets"], use_functions=False, tiles=tiles
        )
    if entry["kind"] == "attention":
        return attention_graph.attention_graph(
            checkpoint.config,
            shapes,
            name=entry["name"],
            mode=o["mode"],
            options=o["blocking"],
            layers=o["layers"],
            batch_size=o["batch_size"],
            seq_len=o["seq_len"],
            ctx_len=o["ctx_len"],
            use_functions=False,
        )
    if entry["kind"] in ("prefill", "decode"):
        return model_graphs.model_graph(
            checkpoint.config,
            shapes,
            phase=entry["kind"],
            mode=o["mode"],
            options=o["blocking"],
            batch_size=o["batch_size"],
            seq_len=o["seq_len"],
            ctx_len=o["ctx_len"],
            budgets=o["budgets"],
            sliding_ring=o["sliding_ring"],
            full_batch_size=o.get("full_batch_size"),
            use_functions=False,
        )
    raise VerifyError(f"graph {entry['name']!r} has unknown kind {entry['kind']!r}")


def open_session(entry, folder, checkpoint):
    """An onnxruntime session on the graph; `--weights inputs` graphs get their weights bound
    from the weight spec (written beside the folder's other files, removed after loading)."""
    path = os.path.join(folder, entry["file"])
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    if entry.get("weight_spec") is None:
        return ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
    with open(os.path.join(folder, entry["weight_spec"])) as f:
        spec = json.load(f)
    model = onnx.load(path, load_external_data=False)
    external.inputs_to_initializers(model, spec, checkpoint.tensors, checkpoint.dir)
    bound = os.path.join(folder, f".verify.{entry['name']}.onnx")
    try:
        with open(bound, "wb") as f:
            f.write(model.SerializeToString())
        return ort.InferenceSession(bound, opts, providers=["CPUExecutionProvider"])
    finally:
        os.remove(bound)


def read_manifest(folder, *, check_shards=True):
    """The folder's manifest.json, after `codegen.integrity.check_folder` unless told not to."""
    try:
        with open(os.path.join(folder, MANIFEST)) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise VerifyError(f"{folder}: no readable {MANIFEST} ({e})") from e
    if check_shards:
        check_folder(folder, manifest)
    return manifest


def verify(folder, *, seed=0, check_shards=True):
    """Rows (graph, specialization, output, max abs error, relative error, ok) for every graph,
    specialization and output of the export in `folder` (checked first: `read_manifest`)."""
    folder = os.path.abspath(folder)
    manifest = read_manifest(folder, check_shards=check_shards)
    checkpoint = open_checkpoint(folder)
    rows = []
    for entry in manifest["graphs"]:
        spec = rebuild(entry, checkpoint)
        session = open_session(entry, folder, checkpoint)
        weights = {n: checkpoint.read(n).astype(np.float32) for n in spec.weights}
        for s in spec.specializations:
            rng = np.random.default_rng([seed, zlib.crc32(f"{spec.name}/{s['name']}".encode())])
            feed = spec.sample(s["symbols"], rng)
            with graphs.layer_scope():
                want = spec.reference(feed, weights)
            got = dict(
                zip([o.name for o in session.get_outputs()], session.run(None, feed), strict=True)
            )
            for t in spec.outputs:
                ref, out = np.asarray(want[t.name], np.float64), np.asarray(got[t.name])
                if out.shape != ref.shape:
                    rows.append((spec.name, s["name"], t.name, float("inf"), float("inf"), False))
                    continue
                err = float(np.max(np.abs(out - ref))) if ref.size else 0.0
                scale = float(np.max(np.abs(ref))) if ref.size else 0.0
                rel = err / scale if scale else err
                rows.append((spec.name, s["name"], t.name, err, rel, bool(rel <= RTOL)))
    return rows


def table(rows):
    """The verify table as text."""
    head = ("graph", "specialization", "output", "max abs err", "rel err", "ok")
    body = [
        (g, s, o, f"{e:.2e}", f"{r:.2e}", "ok" if ok else "MISMATCH") for g, s, o, e, r, ok in rows
    ]
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in [head, *body]
    )
