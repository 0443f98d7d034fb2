"""`export`: trace `ref` over abstract weights into ONNX graphs plus their QAIC artifacts.

The output folder holds, for each graph G: G.onnx, G.specializations.json, G.custom_io.yaml
(graphs with retained state), G.weights.json (`--weights inputs`); and once: the checkpoint's
shards (hard links), its config.json (and shard index), compile.sh and manifest.json. So the
folder is itself a checkpoint `verify` can reopen. It is built in a temporary sibling and
renamed into place: a failed export leaves nothing behind.

This module holds the command: its options (`ExportOptions`), the run that writes the folder
(`export`) and the table printed after it (`summary`). The graphs it writes come from
`codegen.export.specs`, each graph's files from `codegen.export.graph_files`.
"""

import contextlib
import dataclasses
import gc
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from codegen import graphs
from codegen.export import qaic
from codegen.export.graph_files import retained_layout, write_graph
from codegen.export.options import EXPORT_DEFAULTS, ExportError
from codegen.export.specs import graph_specs
from codegen.folder import external, hashcache, paired
from codegen.folder.manifest import FORMAT, MANIFEST, Manifest, Shard
from codegen.folder.sessions import atomic_text, publish
from codegen.graphs import audio as audio_graph
from codegen.graphs import vision as vision_graph
from codegen.lower.ops import OPSET
from ref.blocking import VISION_TILES
from ref.gemma4.assistant import DEFAULT_DRAFTS
from ref.gemma4.images import DEFAULT_BUDGETS
from weights import generation_config, open_checkpoint

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


@dataclasses.dataclass(frozen=True)
class ExportOptions:
    """Everything `python -m codegen export` takes (see `--help` for each)."""

    out: Path
    model: Path | None = None
    budgets: tuple = DEFAULT_BUDGETS
    vision_tiles: tuple = VISION_TILES  # (query tiles, KV tiles) of its attention
    audio_budgets: tuple = EXPORT_DEFAULTS["audio_budgets"]  # with an audio tower
    audio_clips: int = EXPORT_DEFAULTS["audio_clips"]
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
    split_programs: bool = False  # prefill and decode as two programs even where one can be
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
    assistant: Path | None = None  # an MTP assistant's checkpoint: the speculate graph
    num_speculative_tokens: int | None = None  # K (None: the assistant's, else DEFAULT_DRAFTS)

    def drafts(self):
        """K, the speculate graph's draft tokens: 0 without an assistant; else
        --num-speculative-tokens, or the assistant's generation_config
        `num_assistant_tokens`, or `ref.gemma4.assistant.DEFAULT_DRAFTS`."""
        if self.assistant is None:
            return 0
        if self.num_speculative_tokens is not None:
            return self.num_speculative_tokens
        given = (generation_config(self.assistant) or {}).get("num_assistant_tokens")
        return DEFAULT_DRAFTS if given is None else int(given)

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
        self._check_assistant()
        if self.attention_layers is not None and self.attention_layers < 1:
            raise ExportError(f"--attention-layers {self.attention_layers}: must be >= 1")
        unknown = set(self.graphs) - {"model", "attention"}
        if unknown or not self.graphs:
            raise ExportError(f"--graphs {list(self.graphs)}: expected 'model' and/or 'attention'")
        try:
            vision_graph.check_budgets(self.budgets, None)
            audio_graph.check_audio_budgets(self.audio_budgets, self.audio_clips)
        except graphs.GraphError as e:
            raise ExportError(str(e)) from e
        self.ccl_lists()

    def _check_assistant(self):
        """ExportError for speculation options no export can use."""
        k = self.num_speculative_tokens
        if k is not None and self.assistant is None:
            raise ExportError(f"--num-speculative-tokens {k}: give --assistant DIR too")
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ExportError(f"--num-speculative-tokens {k!r}: expected an int >= 1")
        if self.assistant is None:
            return
        if "model" not in self.graphs:
            raise ExportError("--assistant: speculate is a language graph (--graphs model)")
        if self.weights != "external":
            raise ExportError(
                "--assistant with --weights inputs: not supported (the drafter's tensors are "
                "named assistant.* in the graph, not in its shards)"
            )
        if self.drafts() + 1 > self.ctx_len:
            raise ExportError(
                f"--num-speculative-tokens {self.drafts()}: K + 1 must be <= --ctx-len "
                f"{self.ctx_len}"
            )


def _prepare_out(out, force):
    """Refuse an output that exists as a file, or a non-empty folder without `force`."""
    out = Path(os.path.abspath(out))
    if os.path.lexists(out) and not out.is_dir():
        raise ExportError(f"--out {out}: exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ExportError(f"--out {out}: folder is not empty (pass --force to replace it)")
    return out


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
    """`export` at the default collector thresholds: check the options and the output, open
    the checkpoint, ask for its graphs, then fill a temporary sibling of the output and
    publish it in its place (removed instead when anything fails)."""
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
    assistant = None if opts.assistant is None else open_checkpoint(opts.assistant)
    both = checkpoint if assistant is None else paired.with_assistant(checkpoint, assistant)
    specs = graph_specs(both, opts)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp"))
    start = time.perf_counter()
    try:
        manifest = _fill(tmp, (checkpoint, assistant), specs, opts, log)
        os.chmod(tmp, 0o755)
        publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest, time.perf_counter() - start


def _fill(folder, checkpoints, specs, opts, log):
    """Write the export's files into `folder`: the checkpoint's shards and side files (and the
    assistant's, in `assistant/`), each graph of `specs`, the compiler's files and
    manifest.json; returns the Manifest. checkpoints: (the target, the assistant or None). The
    shards are hashed in threads while the graphs are traced (hashing releases the GIL)."""
    checkpoint, assistant = checkpoints
    with hashcache.threads() as pool:
        pending = _place(checkpoint, folder, opts, log, pool)
        if assistant is not None:
            inside = folder / paired.ASSISTANT
            inside.mkdir()
            pending += [(dataclasses.replace(s, file=f"{paired.ASSISTANT}/{s.file}"), digest)
                        for s, digest in _place(assistant, inside, opts, log, pool)]  # fmt: skip
            # the graphs' assistant.* initializers point into the shards at assistant/…
            checkpoint = paired.open_export(folder)
        entries = []
        for i, spec in enumerate(specs):
            log(f"[{i + 1}/{len(specs)}] {spec.name}")
            entries.append(write_graph(spec, checkpoint, folder, opts, log))
        shards = [_digested(shard, digest) for shard, digest in pending]
    for name, text in qaic.compiler_files(entries, opts).items():
        atomic_text(folder / name, text)
    os.chmod(folder / qaic.COMPILE_SCRIPT, 0o755)
    manifest = Manifest(
        format=FORMAT,
        source=str(checkpoints[0].dir),
        assistant=None if assistant is None else str(assistant.dir),
        opset=OPSET,
        options=_options_json(opts),
        shards=tuple(shards),
        bytes_copied=sum(s.bytes for s in shards if s.copied),
        graphs=tuple(entries),
        retained_layout=retained_layout(entries),
    )
    atomic_text(folder / MANIFEST, manifest.to_json())
    return manifest


def _place(checkpoint, folder, opts, log, pool):
    """Hard-link the checkpoint's shards into `folder` and copy its side files (config.json,
    the shard index; the tokenizer, template and stop ids: `run --prompt` needs only the
    folder) → [(its `Shard` without a digest, the digest's Future in `pool` or None)]."""
    placed = external.place_shards(checkpoint.shards, folder, checkpoint.dir)
    extras = ("config.json", "model.safetensors.index.json", *TOKENIZER_FILES)
    for extra in extras:
        if (checkpoint.dir / extra).is_file():
            shutil.copyfile(checkpoint.dir / extra, folder / extra)
    pending = []
    for shard, source in zip(placed, checkpoint.shards, strict=True):
        if shard["copied"]:
            log(f"warning: could not hard-link {shard['file']}; copied {shard['bytes']} bytes")
        path = folder / shard["file"]
        digest = (
            pool.submit(hashcache.export_digest, path, source=source) if opts.hash_shards else None
        )
        pending.append((Shard(**shard), digest))
    return pending


def _digested(shard, digest):
    """`shard` with the digest the Future `digest` gives ((algorithm, hex); None: unhashed)."""
    if digest is None:
        return shard
    algorithm, value = digest.result()
    return dataclasses.replace(shard, **{algorithm: value})


def _options_json(opts):
    """`opts` as manifest.json records them (plain JSON: lists, no paths but the model's)."""
    d = dataclasses.asdict(opts)
    d["out"] = None
    d["model"] = None if opts.model is None else str(opts.model)
    d["assistant"] = None if opts.assistant is None else str(opts.assistant)
    d["budgets"] = list(opts.budgets)
    d["vision_tiles"] = list(opts.vision_tiles)
    d["audio_budgets"] = list(opts.audio_budgets)
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
