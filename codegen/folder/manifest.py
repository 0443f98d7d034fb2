"""The export folder's contract: manifest.json as frozen records, read by `load` and written
by `Manifest.to_json`.

`load` checks the format string and gives an older folder's missing keys their old meaning,
here and nowhere else (`Shard`, `Graph` defaults and `_OPTION_UPGRADES`), so every reader
sees one shape. Imports neither onnx nor jax2onnx: the runner reads it (a test keeps it so).
"""

import dataclasses
import json
import os

MANIFEST = "manifest.json"
# what export writes as the manifest's "format"; a folder in another format is refused by name
FORMAT = "gemma4-qaic-export/1"

# graph options older exports did not record, with the meaning they had then: the vision graph
# attended with the dense mask (one tile each way); no continuous batching, no folded cache,
# no compute context lengths; every expert on every token; no speculate graph (no drafts)
_LANGUAGE = {
    "full_batch_size": None,
    "folded_cache": False,
    "comp_ctx_lengths": [],
    "moe": "dense",
    "drafts": 0,
}
_OPTION_UPGRADES = {"vision": {"tiles": (1, 1)}, "prefill": _LANGUAGE, "decode": _LANGUAGE}


class VerifyError(ValueError):
    """The folder is not an export this version can read."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Tensor:
    """A graph input or output: `shape` with its symbols, `shapes` {specialization: [int]}."""

    name: str
    dtype: str
    shape: list
    shapes: dict


@dataclasses.dataclass(frozen=True, kw_only=True)
class Shard:
    """A checkpoint shard placed in the folder (hard-linked, else `copied`) and its digest: at
    most one of sha256 (an HF blob's or local-dir metadata's, or any shard before BLAKE3) and
    blake3 (`codegen.folder.filehash`) set; both None: not hashed (`--no-hash`, or a folder
    older than the hashes)."""

    file: str
    bytes: int
    copied: bool
    sha256: str | None = None
    blake3: str | None = None

    @property
    def digest(self):
        """(algorithm, hex digest) manifest.json records, or None."""
        for algorithm in ("blake3", "sha256"):
            if getattr(self, algorithm):
                return algorithm, getattr(self, algorithm)
        return None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Graph:
    """One exported graph. options: what `codegen.graphs.kinds.build` rebuilds it from (upgraded);
    clip_fp16: `codegen.lower.clip`'s report or None; weight_spec: the `--weights inputs` file or
    None; specializations [{"name", "symbols"}]; retained_state [[input, output]]."""

    name: str
    file: str
    kind: str
    options: dict
    weights_mode: str
    clip_fp16: dict | None = None
    weight_spec: str | None = None
    sub_functions: bool
    functions: list
    nodes: int
    onnx_bytes: int
    trace_s: float
    inputs: tuple
    outputs: tuple
    weights: list
    specializations: list
    retained_state: list

    @property
    def clipped(self):
        """Whether `--clip-fp16` clamped any tensor of this graph."""
        return bool(self.clip_fp16 and self.clip_fp16["tensors"])

    def shapes(self, specialization):
        """{input name: concrete shape tuple} at one specialization."""
        return {t.name: tuple(t.shapes[specialization]) for t in self.inputs}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Manifest:
    """manifest.json: the export's options, shards (the assistant's under `assistant/`) and
    graphs. retained_layout: {input: shape} of the KV cache the language graphs share
    (`export.retained_layout`), or None."""

    format: str
    source: str
    opset: int
    options: dict
    shards: tuple
    bytes_copied: int
    graphs: tuple
    retained_layout: dict | None = None
    assistant: str | None = None  # the MTP assistant's source folder (`export --assistant`)

    def to_json(self):
        """The text of manifest.json (what `export` writes; `load` reads it back equal)."""
        return json.dumps(dataclasses.asdict(self), indent=2) + "\n"


def _record(cls, data, where):
    """cls(**data), a missing or unknown key a VerifyError naming it."""
    if not isinstance(data, dict):
        raise VerifyError(f"{where}: {type(data).__name__} where {cls.__name__} expected")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise VerifyError(f"{where}: unknown key {unknown[0]!r} (known: {sorted(names)})")
    try:
        return cls(**data)
    except TypeError as e:
        raise VerifyError(f"{where}: {e}") from e


def graph_from(data, where):
    """A Graph from its manifest entry, options an older export left out given their old
    meaning (`_OPTION_UPGRADES`; keys it recorded keep their order)."""
    g = _record(Graph, data, where)
    missing = {k: v for k, v in _OPTION_UPGRADES.get(g.kind, {}).items() if k not in g.options}
    tensors = {
        side: tuple(_record(Tensor, t, f"{where} {g.name} {side}") for t in getattr(g, side))
        for side in ("inputs", "outputs")
    }
    return dataclasses.replace(g, options={**g.options, **missing}, **tensors)


def from_dict(data, where=MANIFEST):
    """A Manifest from manifest.json's parsed value; refuses another format by name."""
    found = data.get("format") if isinstance(data, dict) else None
    if found != FORMAT:
        raise VerifyError(
            f"{where} format {found!r}: expected {FORMAT!r} (export it again with this version)"
        )
    m = _record(Manifest, data, where)
    shards = tuple(_record(Shard, s, f"{where} shard") for s in m.shards)
    graphs = tuple(graph_from(g, f"{where} graph") for g in m.graphs)
    return dataclasses.replace(m, shards=shards, graphs=graphs)


def load(folder):
    """The Manifest of the export in `folder` (its format checked, older keys upgraded)."""
    path = os.path.join(folder, MANIFEST)
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise VerifyError(f"{folder}: no readable {MANIFEST} ({e})") from e
    return from_dict(data, f"{folder}: {MANIFEST}")
