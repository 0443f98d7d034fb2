"""Gemma 4 12B Unified's part of a prefill: its embedder graphs (`codegen.graphs.unified`) in
place of the towers. A call's items are packed one after another, the rest of the budget
zero blocks (or frames) whose rows are dropped: every row of an embedder is its own token's,
so filler changes no real row."""

import numpy as np

from codegen.run.errors import RunError
from ref.gemma4.multimodal import GEMMA4_MEDIA
from ref.gemma4.unified_config import MODEL_TYPE
from ref.gemma4.unified_media import UNIFIED_MEDIA, audio_frames, grid_positions

# the embedder graphs' kinds → the part of a prefill they play (a tower's graph kind)
ROLES = {"embed_vision": "vision", "embed_audio": "audio"}


def is_unified(hf_config):
    """Whether the checkpoint's config.json is a gemma4_unified one."""
    return hf_config.get("model_type") == MODEL_TYPE


def media(hf_config):
    """The processor's readers for this checkpoint (`ref.gemma4.multimodal.Media`)."""
    return UNIFIED_MEDIA if is_unified(hf_config) else GEMMA4_MEDIA


def _padded(rows, total):
    return np.concatenate([rows, np.zeros((total - len(rows), *rows.shape[1:]), rows.dtype)])


def encode_blocks(row, row_runs, row_images, budget, run):
    """One row's images (patches [h·w, (p·k)²·3], grid (h, w) in blocks) through the vision
    embedder graph in one call of `budget` rows → [budget, hidden]."""
    for (start, n), (patches, (h, w)) in zip(row_runs, row_images, strict=True):
        if h * w != n or len(patches) != n:
            raise RunError(
                f"row {row}: the image run at {start} has {n} tokens but its grid {h}x{w} "
                f"holds {h * w} blocks ({len(patches)} given)"
            )
    patches = np.concatenate([np.asarray(p, np.float32) for p, _ in row_images])
    positions = grid_positions([g for _, g in row_images])
    feed = {"pixel_patches": _padded(patches, budget), "positions": _padded(positions, budget)}
    return run(feed)["vision_embeds"]


def embed_clips(entry, run, clips):
    """Each clip's soft tokens through the audio embedder graph, consecutive clips packed into
    one call while they fit the largest budget → list of [n_i, hidden]. entry: the audio
    graph's manifest entry (None: no audio graph)."""
    if not len(clips):
        return []
    if entry is None:
        raise RunError(f"{len(clips)} audio clips given but the export has no audio graph")
    budgets = sorted(s["symbols"]["audio_size"] for s in entry.specializations)
    frames = [audio_frames(UNIFIED_MEDIA.audio(c, f"audio clip {i}")) for i, c in enumerate(clips)]
    groups = []
    for i, f in enumerate(frames):
        if len(f) > budgets[-1]:
            raise RunError(
                f"audio clip {i}: {len(f)} frames of 640 samples; the largest audio budget "
                f"exported holds {budgets[-1]}"
            )
        if not groups or sum(len(g) for g in groups[-1]) + len(f) > budgets[-1]:
            groups.append([])
        groups[-1].append(f)
    out = []
    for group in groups:
        flat = np.concatenate(group)
        budget = next(b for b in budgets if b >= len(flat))
        embeds = run({"frames": _padded(flat, budget)})["audio_embeds"]
        cu = np.cumsum([0, *(len(f) for f in group)])
        out += [embeds[a:z] for a, z in zip(cu[:-1], cu[1:], strict=True)]
    return out
