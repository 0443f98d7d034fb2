"""`export`: trace `ref` over abstract weights into ONNX graphs plus their QAIC artifacts.

The output folder holds, for each graph G: G.onnx, G.specializations.json, G.custom_io.yaml
(graphs with retained state), G.weights.json (`--weights inputs`); and once: the checkpoint's
shards (hard links), its config.json (and shard index), compile.sh and manifest.json. So the
folder is itself a checkpoint `verify` can reopen. It is built in a temporary sibling and
renamed into place: a failed export leaves nothing behind.
"""

import contextlib
import dataclasses
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from codegen import graphs
from codegen.check import structure as checks
from codegen.export import qaic
from codegen.export.options import EXPORT_DEFAULTS
from codegen.folder import external, hashcache
from codegen.folder.manifest import FORMAT, MANIFEST, Graph, Manifest, Shard, Tensor
from codegen.folder.sessions import publish
from codegen.graphs import attention as attention_graph
from codegen.graphs import kinds
from codegen.graphs import model as model_graphs
from codegen.graphs import vision as vision_graph
from codegen.lower.clip import clip_fp16
from codegen.lower.ops import OPSET
from codegen.lower.trace import trace
from ref.blocking import VISION_TILES
from ref.gemma4.images import DEFAULT_BUDGETS
from weights import open_checkpoint

# what `run` and `serve` read besides the graphs: the tokenizer, the chat template (in
# tokenizer_config.json or its own file), the stop ids and sampling defaults
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


class ExportError(ValueError):
    """Bad options or an output folder that cannot be written."""


@dataclasses.dataclass(frozen=True)
class ExportOptions:
    """Everything `python -m codegen export` takes (see `--help` for each)."""

    out: Path
    model: Path | None = None
    budgets: tuple = DEFAULT_BUDGETS
    vision_tiles: tuple = VISION_TILES  # (query tiles, KV tiles) of its attention
    graphs: tuple = ("model",)  # "model" (vision, prefill, decode) and/or "attention"
    prefill_blocking: tuple = ("none", {})  # (mode, {option: value})
    decode_blocking: tuple = ("none", {})
    sliding_ring: bool = True  # sliding layers in a ring of the window's slots
    full_batch_size: int | None = None
    blocking: tuple = ()  # attention graphs: ((mode, {option: value}), ...)
    attention_layers: int | None = None
    batch_size: int = EXPORT_DEFAULTS["batch_size"]
    seq_len: int = EXPORT_DEFAULTS["seq_len"]
    ctx_len: int = EXPORT_DEFAULTS["ctx_len"]
    weights: str = "external"
    sub_functions: bool = True
    legacy_specializations: bool = False
    kv_dtype: str = "float16"
    num_cores: int = EXPORT_DEFAULTS["num_cores"]
    mxfp6: bool = False
    mos: int | None = None
    mdp_config: str | None = None
    num_devices: int = EXPORT_DEFAULTS["num_devices"]
    phases: tuple = ("prefill", "decode")  # --prefill-only / --decode-only
    hw_version: str = EXPORT_DEFAULTS["hw_version"]
    hash_shards: bool = True
    force: bool = False
    verify: bool = True
    clip_fp16: bool = (
        False  # codegen.lower.clip: clamp out-of-range weights and known overflow points
    )
    comp_ctx_lengths_prefill: tuple = ()  # compute context lengths (`ccl_lists`)
    comp_ctx_lengths_decode: tuple = ()
    moe_prefill: str | None = None  # `ref.moe_modes` text; None: `model_graphs.phase_moe`'s
    moe_decode: str | None = None

    def ccl_lists(self):
        """{phase: its compute context lengths}: each list given sorted, ctx_len appended when
        missing (as QEfficient's `validate_ccl_lists`; a phase's last specialization then
        reaches every position), () for a phase given none (its graph takes no
        `comp_ctx_lengths`). A value outside [seq_len (prefill) or 1, ctx_len] is an
        ExportError naming it (QEfficient raises it to 1,024 or clamps it, silently)."""
        lists = {}
        for phase, given in (
            ("prefill", self.comp_ctx_lengths_prefill),
            ("decode", self.comp_ctx_lengths_decode),
        ):
            low = self.seq_len if phase == "prefill" else 1
            for k in given:
                if isinstance(k, bool) or not isinstance(k, int) or not low <= k <= self.ctx_len:
                    option = f"--comp-ctx-lengths-{phase}"
                    what = "seq_len" if phase == "prefill" else "1"
                    raise ExportError(
                        f"{option} {k!r}: expected ints in [{what}={low}, ctx_len={self.ctx_len}]"
                    )
            lists[phase] = tuple(sorted({*given, self.ctx_len})) if given else ()
        return lists

    def validate(self):
        """Raise ExportError for an option value no export could use."""
        if self.weights not in ("external", "inputs"):
            raise ExportError(f"--weights {self.weights!r}: expected 'external' or 'inputs'")
        if qaic.KV_ALIASES.get(self.kv_dtype, self.kv_dtype) not in qaic.KV_DTYPES:
            raise ExportError(
                f"--kv-dtype {self.kv_dtype!r}: expected one of {qaic.KV_DTYPES} "
                f"(or {sorted(qaic.KV_ALIASES)})"
            )
        for name in ("batch_size", "seq_len", "ctx_len", "num_cores"):
            if getattr(self, name) < 1:
                raise ExportError(f"--{name.replace('_', '-')} {getattr(self, name)}: must be >= 1")
        if self.num_devices < 1:
            raise ExportError(f"--num-devices {self.num_devices}: must be >= 1")
        if self.num_devices > 1 and self.mdp_config is not None:
            raise ExportError(
                "--num-devices writes its own partition config; drop --mdp-config or use 1 device"
            )
        if not self.phases or set(self.phases) - {"prefill", "decode"}:
            raise ExportError(f"phases {list(self.phases)}: expected prefill and/or decode")
        if self.full_batch_size is not None and self.full_batch_size < self.batch_size:
            raise ExportError(
                f"--full-batch-size {self.full_batch_size}: must be >= --batch-size "
                f"{self.batch_size} (the cache slots the prefill rows write into)"
            )
        if self.attention_layers is not None and self.attention_layers < 1:
            raise ExportError(f"--attention-layers {self.attention_layers}: must be >= 1")
        unknown = set(self.graphs) - {"model", "attention"}
        if unknown or not self.graphs:
            raise ExportError(f"--graphs {list(self.graphs)}: expected 'model' and/or 'attention'")
        try:
            vision_graph.check_budgets(self.budgets, None)
        except graphs.GraphError as e:
            raise ExportError(str(e)) from e
        self.ccl_lists()


def graph_specs(checkpoint, opts):
    """The GraphSpecs this checkpoint and these options ask for: the vision tower (when the
    checkpoint has one), then the language model's prefill and decode graphs (`--graphs
    model`, when it has a text decoder) and/or the attention stacks (`--graphs attention`)."""
    shapes = {n: info.shape for n, info in checkpoint.tensors.items()}
    shared = {"batch_size": opts.batch_size, "seq_len": opts.seq_len, "ctx_len": opts.ctx_len}

    def build(kind, name, options):
        return kinds.build(kind, name, checkpoint.config, shapes, options,
                           use_functions=opts.sub_functions)  # fmt: skip

    language = "model" in opts.graphs and model_graphs.text_prefix(shapes) is not None
    language = language and graphs.text_config(checkpoint.config) is not None
    specs = []
    # a --decode-only export reads no image: its vision graph belongs to the prefill side
    wants_vision = not language or "prefill" in opts.phases
    if opts.budgets and wants_vision and vision_graph.vision_prefix(shapes) is not None:
        # vision_size < ctx_len binds only where a language graph reads the soft tokens
        vision_graph.check_budgets(opts.budgets, opts.ctx_len if language else None)
        asked = {"budgets": opts.budgets, "tiles": opts.vision_tiles}
        specs.append(build("vision", "vision", asked))
    if language:
        # both sides hold the cache as the decode graph reads it (the retained state)
        folded = model_graphs.folds_cache(
            *opts.decode_blocking, batch=opts.full_batch_size or opts.batch_size,
            ctx_len=opts.ctx_len,
        )  # fmt: skip
        cfg = graphs.text_config(checkpoint.config)
        for phase, (mode, options), moe in (
            ("prefill", opts.prefill_blocking, opts.moe_prefill),
            ("decode", opts.decode_blocking, opts.moe_decode),
        ):
            if phase not in opts.phases:
                continue
            # the step's rows: decode runs over every continuous-batching slot
            decode_rows = opts.full_batch_size or opts.batch_size
            tokens = opts.batch_size * opts.seq_len if phase == "prefill" else decode_rows
            asked = {
                "mode": mode,
                "blocking": options,
                "budgets": opts.budgets,
                "sliding_ring": opts.sliding_ring,
                "full_batch_size": opts.full_batch_size,
                "folded_cache": folded,
                "comp_ctx_lengths": list(opts.ccl_lists()[phase]),
                "moe": model_graphs.phase_moe(
                    moe, phase, cfg, num_cores=opts.num_cores, tokens=tokens
                ),
            }
            specs.append(build(phase, phase, {**shared, **asked}))  # fmt: skip
    stackable = "attention" in opts.graphs and attention_graph.attention_layers_available(
        checkpoint.config, shapes
    )
    seen = {}
    for mode, options in opts.blocking if stackable else ():
        seen[mode] = seen.get(mode, 0) + 1
        name = f"attention_{mode}" + (f"_{seen[mode]}" if seen[mode] > 1 else "")
        asked = {"mode": mode, "blocking": options, "layers": opts.attention_layers or stackable}
        specs.append(build("attention", name, {**shared, **asked}))
    if not specs:
        raise ExportError(
            f"{checkpoint.dir}: nothing to export (no vision tower tensors, no text decoder "
            f"for --graphs model, no stackable attention layers for --graphs attention)"
        )
    return specs


def _function_names(model):
    return sorted({f.name for f in model.functions})


def _atomic_text(path, text):
    tmp = f"{path}.tmp"
    with open(tmp, "w" if isinstance(text, str) else "wb") as f:
        f.write(text)
    os.replace(tmp, path)


def _io_entry(tensor, specializations):
    return Tensor(
        name=tensor.name,
        dtype=tensor.dtype,
        shape=list(tensor.shape),
        shapes={s["name"]: list(tensor.concrete(s["symbols"])) for s in specializations},
    )


def write_graph(spec, checkpoint, folder, opts, log):
    """Trace, bind weights, write and check one graph; returns its manifest entry (a
    `codegen.folder.manifest.Graph`)."""
    shapes = {n: info.shape for n, info in checkpoint.tensors.items()}
    t0 = time.perf_counter()
    first = {spec.specializations[0]["name"]: checks.no_unclamped_dynamic_slice(spec, shapes)}
    model = trace(spec, checkpoint.tensors)
    traced = time.perf_counter() - t0
    weight_spec = None
    if opts.weights == "external":
        external.externalize(model, spec.weights, checkpoint.tensors, checkpoint.dir)
    else:
        weight_spec = f"{spec.name}.weights.json"
        ws = external.as_inputs(model, spec.weights, checkpoint.tensors, spec.name, checkpoint.dir)
        _atomic_text(os.path.join(folder, weight_spec), json.dumps(ws, indent=2) + "\n")
    clipped = clip_fp16(model, spec.weights, checkpoint.read) if opts.clip_fp16 else None
    path = os.path.join(folder, f"{spec.name}.onnx")
    data = model.SerializeToString(deterministic=True)
    _atomic_text(path, data)
    t1 = time.perf_counter()
    checks.checker(model)
    checks.external_paths(model, folder)
    checks.allowed_ops(model)
    checks.inferred_shapes(model, spec, shapes, known=first)
    checked = time.perf_counter() - t1
    _atomic_text(
        os.path.join(folder, f"{spec.name}.specializations.json"),
        qaic.specializations_json(spec.specializations, legacy=opts.legacy_specializations),
    )
    if spec.retained:
        _atomic_text(
            os.path.join(folder, f"{spec.name}.custom_io.yaml"),
            qaic.custom_io_yaml(spec.retained, opts.kv_dtype),
        )
    log(
        f"  {spec.name}: traced {traced:.1f} s, checked {checked:.1f} s, "
        f"{len(data) / 1e6:.2f} MB, {len(model.graph.node)} nodes, "
        f"functions {_function_names(model) or 'none'}"
    )
    return Graph(
        name=spec.name,
        file=f"{spec.name}.onnx",
        kind=spec.kind,
        options=spec.options,
        weights_mode=opts.weights,
        clip_fp16=clipped,
        weight_spec=weight_spec,
        sub_functions=bool(model.functions),
        functions=_function_names(model),
        nodes=len(model.graph.node),
        onnx_bytes=len(data),
        trace_s=round(traced, 3),
        inputs=tuple(_io_entry(t, spec.specializations) for t in spec.inputs),
        outputs=tuple(_io_entry(t, spec.specializations) for t in spec.outputs),
        weights=list(spec.weights),
        specializations=list(spec.specializations),
        retained_state=[list(p) for p in spec.retained],
    )


def _prepare_out(out, force):
    """Refuse an output that exists as a file, or a non-empty folder without `force`."""
    out = Path(os.path.abspath(out))
    if os.path.lexists(out) and not out.is_dir():
        raise ExportError(f"--out {out}: exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ExportError(f"--out {out}: folder is not empty (pass --force to replace it)")
    return out


def retained_layout(entries):
    """The KV-cache layout the exported language graphs share: {input name: shape} of every
    retained-state input, at the decode (else prefill) graph's first specialization — what a
    prefill-only and a decode-only export must agree on to hand the cache over."""
    for kind in ("decode", "prefill"):
        for e in entries:
            if e.kind == kind:
                retained = {pair[0] for pair in e.retained_state}
                spec = e.specializations[0]["name"]
                return {t.name: t.shapes[spec] for t in e.inputs if t.name in retained}
    return None


@contextlib.contextmanager
def _fewer_collections():
    """Python's cyclic garbage collector at larger thresholds while exporting: tracing makes
    millions of objects (jaxpr equations, ONNX IR values), and at the default (700, 10, 10) a
    full collection rescans all of them every ~70,000 allocations (measured, E2B at
    QEfficient's production blocking: 20.0 s -> 13.1 s of export, same peak RSS)."""
    old = gc.get_threshold()
    gc.set_threshold(50_000, 20, 20)
    try:
        yield
    finally:
        gc.set_threshold(*old)


def export(opts, log=None):
    """Write the export folder `opts.out`; returns (its `codegen.folder.manifest.Manifest`, seconds
    the folder took to write). Raises ExportError, CheckpointError, GraphError (bad input) or
    CheckError (a graph failed a check)."""
    with _fewer_collections():
        return _export(opts, log)


def _export(opts, log):
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    opts.validate()
    out = _prepare_out(opts.out, opts.force)
    if opts.model is None:
        from codegen.export.defaults import default_checkpoint

        model_dir = default_checkpoint()
        log(f"default model: {model_dir}")
    else:
        model_dir = opts.model
    checkpoint = open_checkpoint(model_dir)
    specs = graph_specs(checkpoint, opts)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp"))
    start = time.perf_counter()
    try:
        shards = external.place_shards(checkpoint.shards, tmp, checkpoint.dir)
        # the tokenizer, template and stop ids too: `run --prompt` needs only the folder
        extras = ("config.json", "model.safetensors.index.json", *TOKENIZER_FILES)
        for extra in extras:
            if (checkpoint.dir / extra).is_file():
                shutil.copyfile(checkpoint.dir / extra, tmp / extra)
        shards = [_shard(s, tmp, source, opts, log) for s, source in
                  zip(shards, checkpoint.shards, strict=True)]  # fmt: skip
        entries = []
        for i, spec in enumerate(specs):
            log(f"[{i + 1}/{len(specs)}] {spec.name}")
            entries.append(write_graph(spec, checkpoint, tmp, opts, log))
        for name, text in qaic.compiler_files(entries, opts).items():
            _atomic_text(tmp / name, text)
        os.chmod(tmp / qaic.COMPILE_SCRIPT, 0o755)
        manifest = Manifest(
            format=FORMAT,
            source=str(checkpoint.dir),
            opset=OPSET,
            options=_options_json(opts),
            shards=tuple(shards),
            bytes_copied=sum(s.bytes for s in shards if s.copied),
            graphs=tuple(entries),
            retained_layout=retained_layout(entries),
        )
        _atomic_text(tmp / MANIFEST, manifest.to_json())
        os.chmod(tmp, 0o755)
        publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest, time.perf_counter() - start


def _shard(placed, folder, source, opts, log):
    """The Shard of one placed shard ({"file", "bytes", "copied"}: `external.place_shards`),
    hashed unless `--no-hash`."""
    if placed["copied"]:
        log(f"warning: could not hard-link {placed['file']}; copied {placed['bytes']} bytes")
    digest = hashcache.sha256(folder / placed["file"], source=source) if opts.hash_shards else None
    return Shard(**placed, sha256=digest)


def _options_json(opts):
    d = dataclasses.asdict(opts)
    d["out"] = None
    d["model"] = None if opts.model is None else str(opts.model)
    d["budgets"] = list(opts.budgets)
    d["vision_tiles"] = list(opts.vision_tiles)
    d["blocking"] = [[m, dict(o)] for m, o in opts.blocking]
    d["graphs"] = list(opts.graphs)
    d["phases"] = list(opts.phases)
    d["prefill_blocking"] = [opts.prefill_blocking[0], dict(opts.prefill_blocking[1])]
    d["decode_blocking"] = [opts.decode_blocking[0], dict(opts.decode_blocking[1])]
    return d


def summary(manifest):
    """The table printed after an export."""
    rows = [("graph", "specializations", "nodes", "functions", ".onnx MB", "trace s")]
    for g in manifest.graphs:
        rows.append(
            (
                g.name,
                ",".join(s["name"] for s in g.specializations),
                str(g.nodes),
                ",".join(g.functions) or "-",
                f"{g.onnx_bytes / 1e6:.2f}",
                f"{g.trace_s:.1f}",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    linked = sum(s.bytes for s in manifest.shards if not s.copied)
    lines.append(
        f"weights: {len(manifest.shards)} shard(s), {linked} bytes hard-linked, "
        f"{manifest.bytes_copied} bytes copied"
    )
    return "\n".join(lines)
