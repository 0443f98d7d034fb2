"""The audio graph's part of a prefill: each clip's log-mel frames (`ref.gemma4.audio_features`),
consecutive clips packed into one call while they fit the largest exported budget and the
graph's clips per call, each call at the least budget that holds it; each clip's soft tokens
(after embed_audio) come back in order, and `merge` puts them in a row's soft-token stream
between its images' where their runs appear; `per_row` hands a batch's clips to its rows (each
row a request of its own under continuous batching)."""

import numpy as np

from codegen.run import unified
from codegen.run.errors import RunError
from ref.gemma4.audio_config import AudioConfig
from ref.gemma4.audio_features import log_mel
from ref.gemma4.audio_packing import clip_frames, pack, pack_frames, soft_tokens
from ref.gemma4.multimodal import GEMMA4_MEDIA, soft_runs
from ref.gemma4.schedule import image_runs


def embed_clips(hf_config, entry, run, clips):
    """Each clip's soft tokens → list of [n_i, text_hidden] float32 (n_i = 0 for a clip too
    short to have any). entry: the audio graph's manifest entry (None: no audio graph);
    run: feed → its outputs; clips: [n] float32 samples at 16 kHz each."""
    if unified.is_unified(hf_config):
        return unified.embed_clips(entry, run, clips)
    if not len(clips):
        return []
    if entry is None:
        raise RunError(f"{len(clips)} audio clips given but the export has no audio graph")
    cfg = AudioConfig.from_hf(hf_config)
    # each budget's frames, as the graph's specializations name them (4 a soft token)
    budgets = sorted(s["symbols"]["num_frames"] for s in entry.specializations)
    most_clips = entry.options["clips"]
    pairs = [log_mel(c, f"audio clip {i}") for i, c in enumerate(clips)]
    frames = clip_frames([f for f, _ in pairs], [m for _, m in pairs])
    most = budgets[-1]
    groups = []
    for i, f in enumerate(frames):
        if len(f) > most:
            raise RunError(
                f"audio clip {i}: {len(f)} frames ({soft_tokens(len(f))} soft tokens); the "
                f"largest audio budget exported holds {most} frames ({soft_tokens(most)} tokens)"
            )
        last = groups[-1] if groups else None
        if last is None or len(last) == most_clips or sum(len(g) for g in last) + len(f) > most:
            groups.append([])
        groups[-1].append(f)
    out = []
    for group in groups:
        counts = [len(f) for f in group]
        budget = next(b for b in budgets if b >= sum(counts))
        packing = pack(counts, cfg, frame_budget=budget, max_clips=most_clips)
        feed = {"frames": pack_frames(group, packing), **packing.arrays}
        embeds = run(feed)["audio_embeds"]
        cu = packing.cu_tokens
        out += [embeds[a:z] for a, z in zip(cu[:-1], cu[1:], strict=True)]
    return out


def merge(rows, vision_streams, vision_ids, audio_ids, clips, hidden):
    """Each row's soft tokens in order of appearance, [tokens, hidden] per row: its image runs'
    (from `vision_streams`, that row's runs back to back; None: no images) and its audio
    runs' (the next of `clips` with soft tokens, in order, row by row)."""
    audio = iter([c for c in clips if len(c)])
    streams = []
    for i, row in enumerate(rows):
        parts, at = [np.zeros((0, hidden), np.float32)], 0
        for start, n, kind in soft_runs(row, vision_ids, audio_ids):
            if kind == "image":
                parts.append(vision_streams[i][at : at + n])
                at += n
                continue
            clip = next(audio, None)
            if clip is None or len(clip) != n:
                got = "no clip" if clip is None else f"a clip of {len(clip)} soft tokens"
                raise RunError(f"row {i}: the audio run at {start} has {n} tokens but {got}")
            parts.append(np.asarray(clip, np.float32))
        streams.append(np.concatenate(parts))
    if next(audio, None) is not None:
        raise RunError("more audio clips given than the prompts hold audio runs")
    return streams


def per_row(rows, clips, audio_id, media=GEMMA4_MEDIA):
    """Each row's clips → a list per row: rows are token-id arrays [L_i] whose audio runs (of
    `audio_id`) the clips ([n] float32 at 16 kHz) fill in order, row by row, one clip a run; a
    clip too short for soft tokens has no run and goes with the row of the clip after it (the
    last row when none follows). media: the processor's readers (`ref.gemma4.multimodal`)."""
    ends = np.cumsum([len(image_runs(r, audio_id)) for r in rows])
    try:
        heard = [media.audio_tokens(len(media.audio(c, f"audio clip {i}"))) > 0
                 for i, c in enumerate(clips)]  # fmt: skip
    except ValueError as e:
        raise RunError(str(e)) from e
    if sum(heard) != ends[-1]:
        raise RunError(
            f"{sum(heard)} audio clips with soft tokens (of {len(clips)} given) but the prompts "
            f"hold {ends[-1]} audio runs: expected one clip a run"
        )
    before = np.cumsum(heard, dtype=int) - heard  # clips with soft tokens before each clip
    row_of = np.minimum(np.searchsorted(ends, before, side="right"), len(rows) - 1)
    return [[c for c, r in zip(clips, row_of, strict=True) if r == i] for i in range(len(rows))]
