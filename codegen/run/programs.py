"""An export's graphs as the runner opens them: each a `codegen.run.device.Program` (one per
graph: a language program serves prefill and decode), the compute context lengths each kind
of call takes, and what a decode step feeds besides its tokens."""

import numpy as np

from codegen.run.device import Program
from codegen.run.errors import RunError


def ccl_for(ccls, position_ids):
    """The least compute context length above every valid position (≥ 0) of a step, from the
    increasing `ccls` (the last is ctx_len); the least one for a step with none."""
    valid = np.asarray(position_ids)[np.asarray(position_ids) >= 0]
    top = int(valid.max()) if valid.size else -1
    above = [k for k in ccls if k > top]
    if not above:
        raise RunError(f"position {top}: no compute context length above it in {list(ccls)}")
    return above[0]


def lengths(entry, kind):
    """The compute context lengths `kind`'s calls of graph `entry` take: its own, or in a
    language program the phase's (ctx_len alone for a phase without any when the other has
    some: the graph then always takes comp_ctx_lengths); () for none."""
    o = entry.options
    if entry.kind != "language":
        return tuple(o["comp_ctx_lengths"])
    own, other = o["comp_ctx_lengths"], o["decode_comp_ctx_lengths"]
    if kind != "prefill":
        own, other = other, own
    return tuple(own) or ((o["ctx_len"],) if other else ())


def decode_media(entry):
    """{input: array} a decode step of graph `entry` feeds besides ids, positions, slots and
    compute context lengths: a language program's one-row `vision_embeds` (zeros) and
    `image_idx` at its end (1: no soft token left, so a generated image id is text, as a
    decode graph without vision inputs embeds it: `ref.gemma4.text.within_stream`)."""
    name = next(s["name"] for s in entry.specializations if s["name"].startswith("decode"))
    shapes = entry.shapes(name)
    if "vision_embeds" not in shapes:
        return {}
    rows, size, hidden = shapes["vision_embeds"]
    return {"vision_embeds": np.zeros((rows, size, hidden), np.float32),
            "image_idx": np.full(shapes["image_idx"], size, np.int32)}  # fmt: skip


def kv_dtype(manifest):
    """The KV format an export's custom_io.yaml gives its retained state."""
    return manifest.options.get("kv_dtype", "float16")


def program(entry, home, transfers, engine):
    """The `Program` of manifest `entry` whose graph is in `home` (folder, checkpoint, KV
    format) on `engine`'s session, counting into `transfers`."""
    folder, checkpoint, kv_dtype = home
    return Program(entry.name, entry, engine(entry, folder, checkpoint), transfers, kv_dtype)
