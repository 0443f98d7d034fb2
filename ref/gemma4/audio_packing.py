"""Host-side packing of audio clips for the packed audio tower (numpy only; never a device array).

Clips of different lengths run in one call as one sequence along time: each clip's valid frames,
back to back, no padding between them. Everything that reads a neighbouring row reads it through
an index array built here, and an index that would leave its clip points past the end of the
array it reads, at a zero row the tower appends (`ref.gemma4.audio_attention.gather_rows`):

- the two subsampling convolutions (k 3, stride 2, pad 1 along time): output row j of a clip
  reads rows 2j − 1, 2j, 2j + 1 of that clip (`conv_taps`); a tap outside the clip reads zeros,
  the clip's own zero padding, so no frame of another clip is ever read;
- the chunked attention: each clip is cut into chunks of C tokens from its own first token, as
  when it runs alone; a chunk's C queries and its C + P + F context keys (P past, F future)
  are gathered by index (`chunk_index`), a key outside the clip is a zero row the mask hides;
- the causal depthwise convolution (kernel K): token t reads t − K + 1 … t of its clip
  (`causal_taps`), earlier taps read zeros, as transformers' left padding does.

A clip's valid frames are all the tower reads: transformers zeroes invalid frames before each
convolution and masks invalid keys, so its valid soft tokens depend on the valid frames alone
(the mask is a prefix; the later frames are padding).

Static sizes: with a frame budget N and at most K clips, the rows after the first conv (R), the
soft tokens (M) and the chunks (B) have bounds of N and K alone (`budgets`), so an export with a
fixed frame budget has fixed shapes; filler rows, tokens and chunks read only zero rows.
"""

from dataclasses import dataclass

import numpy as np

from ref.gemma4.audio_features import MEL_BINS


def halved(n):
    """Output rows of a k 3, stride 2, pad 1 convolution over n rows: ⌈n / 2⌉."""
    return -(-int(n) // 2)


def soft_tokens(frames):
    """Soft tokens of a clip of `frames` valid frames: halved twice."""
    return halved(halved(frames))


def budgets(frame_budget, max_clips, chunk):
    """(R, M, B): rows after the first conv, soft tokens and chunks that any ≤ max_clips clips of
    ≤ frame_budget frames in all can need (each clip rounds up by at most one row per halving,
    and by at most chunk − 1 tokens in its last chunk)."""
    rows = (frame_budget + max_clips) // 2
    tokens = (rows + max_clips) // 2
    return rows, tokens, (tokens + max_clips * (chunk - 1)) // chunk


def _starts(counts):
    return np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)


def conv_taps(in_counts, total_rows, sentinel):
    """The time taps of a k 3, stride 2, pad 1 convolution per clip.

    in_counts: input rows per clip (packed back to back) → [total_rows, 3] int32: output row j of
    a clip reads its rows 2j − 1, 2j, 2j + 1; taps outside the clip and filler rows read
    `sentinel` (a zero row).
    """
    taps = np.full((total_rows, 3), sentinel, np.int64)
    out = 0
    for start, n in zip(_starts(in_counts)[:-1], in_counts, strict=True):
        rows = 2 * np.arange(halved(n))[:, None] + np.arange(-1, 2)
        taps[out : out + len(rows)] = np.where((rows >= 0) & (rows < n), start + rows, sentinel)
        out += len(rows)
    return taps.astype(np.int32)


def chunk_index(token_counts, chunk, past, future, total_chunks, sentinel):
    """Each clip's chunks: queries, context keys, and where each token's output lands.

    token_counts: tokens per clip (packed back to back) → (queries [B, C], keys [B, C + P + F],
    slots [M]) int32 with B = total_chunks, M = sentinel: chunk b of a clip starting at its
    token s holds queries s … s + C − 1 and keys s − P … s + C + F − 1 of that clip, `sentinel`
    where they leave the clip; token t's output is row slots[t] of the chunks' outputs flattened
    to [B·C] (filler tokens: row 0).
    """
    queries = np.full((total_chunks, chunk), sentinel, np.int64)
    keys = np.full((total_chunks, chunk + past + future), sentinel, np.int64)
    slots = np.zeros(sentinel, np.int64)
    b = 0
    for start, n in zip(_starts(token_counts)[:-1], token_counts, strict=True):
        for s in range(0, n, chunk):
            q = s + np.arange(chunk)
            k = s - past + np.arange(chunk + past + future)
            queries[b] = np.where(q < n, start + q, sentinel)
            keys[b] = np.where((k >= 0) & (k < n), start + k, sentinel)
            real = q[q < n]
            slots[start + real] = b * chunk + real - s
            b += 1
    return queries.astype(np.int32), keys.astype(np.int32), slots.astype(np.int32)


def causal_taps(token_counts, kernel, total_tokens):
    """Taps of the causal depthwise convolution: [M, K] int32, token t of a clip reads its tokens
    t − K + 1 … t; earlier ones and filler rows read M (a zero row)."""
    taps = np.full((total_tokens, kernel), total_tokens, np.int64)
    for start, n in zip(_starts(token_counts)[:-1], token_counts, strict=True):
        t = np.arange(n)[:, None] + np.arange(1 - kernel, 1)
        taps[start : start + n] = np.where(t >= 0, start + t, total_tokens)
    return taps.astype(np.int32)


@dataclass(frozen=True)
class AudioPacking:
    """Metadata of one packed call. N frames, R rows after the first conv, M soft tokens, B
    attention chunks of C queries (budgets included); every index array reads a zero row at its
    source's length.

    frame_counts, token_counts: valid frames and soft tokens per clip; num_frames: N;
    cu_tokens: [clips + 1] int32 soft-token offsets; segment_ids: [M] int32 clip index, −1 for
    filler; arrays: the tower's index inputs, int32 — "first_taps" [R, 3] into frames,
    "second_taps" [M, 3] into rows, "chunk_queries" [B, C], "chunk_keys" [B, C + P + F] and
    "causal_taps" [M, K] into tokens, "token_slots" [M] into the B·C chunk rows.
    """

    frame_counts: tuple
    token_counts: tuple
    num_frames: int
    cu_tokens: np.ndarray
    segment_ids: np.ndarray
    arrays: dict

    @property
    def num_real_tokens(self):
        return int(self.cu_tokens[-1])


def _check_counts(frame_counts):
    counts = tuple(frame_counts)
    if not counts:
        raise ValueError("empty input: expected at least one clip")
    for i, n in enumerate(counts):
        if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 0:
            raise ValueError(f"frame_counts[{i}] = {n!r}: expected an int >= 0")
    return tuple(int(n) for n in counts)


def _sizes(frames, rows, tokens, chunk, frame_budget, max_clips):
    """(N, R, M, B): exact without a frame budget, else `budgets` of it."""
    if frame_budget is None:
        if max_clips is not None:
            raise ValueError(f"max_clips={max_clips!r} needs a frame_budget")
        return sum(frames), sum(rows), sum(tokens), sum(-(-m // chunk) for m in tokens)
    clips = len(frames) if max_clips is None else int(max_clips)
    if clips < len(frames):
        raise ValueError(f"max_clips={clips}: fewer than the {len(frames)} clips given")
    if int(frame_budget) < sum(frames):
        raise ValueError(
            f"frame_budget={frame_budget} is smaller than the {sum(frames)} valid frames of the "
            "clips"
        )
    return int(frame_budget), *budgets(int(frame_budget), clips, chunk)


def pack(frame_counts, config, *, frame_budget=None, max_clips=None):
    """Packing metadata for clips of `frame_counts` valid frames under an AudioConfig.

    frame_budget: None (exact sizes), or N frames with room for max_clips clips (default: as
    many as given): the sizes are then those of `budgets`, fixed for any such call.
    """
    frames = _check_counts(frame_counts)
    rows = tuple(halved(n) for n in frames)
    tokens = tuple(halved(r) for r in rows)
    chunk = config.attention_chunk_size
    n, r, m, b = _sizes(frames, rows, tokens, chunk, frame_budget, max_clips)
    queries, keys, slots = chunk_index(
        tokens, chunk, config.max_past, config.attention_context_right, b, m
    )
    cu_tokens = _starts(tokens).astype(np.int32)
    segments = np.full(m, -1, np.int32)
    for i, (a, z) in enumerate(zip(cu_tokens[:-1], cu_tokens[1:], strict=True)):
        segments[a:z] = i
    arrays = {
        "first_taps": conv_taps(frames, r, n),
        "second_taps": conv_taps(rows, m, r),
        "chunk_queries": queries,
        "chunk_keys": keys,
        "token_slots": slots,
        "causal_taps": causal_taps(tokens, config.conv_kernel_size, m),
    }
    return AudioPacking(frames, tokens, n, cu_tokens, segments, arrays)


def clip_frames(features, masks=None):
    """Each clip's valid frames, checked: features[i] [T_i, MEL_BINS] finite; masks[i] [T_i] bool,
    a prefix of Trues (None: every frame valid) → list of [v_i, MEL_BINS] float32."""
    if masks is not None and len(masks) != len(features):
        raise ValueError(f"{len(masks)} masks for {len(features)} clips: expected one each")
    out = []
    for i, f in enumerate(features):
        f = np.asarray(f)
        if f.ndim != 2 or f.shape[1] != MEL_BINS:
            raise ValueError(f"features[{i}] has shape {f.shape}: expected [frames, {MEL_BINS}]")
        if not np.isfinite(f).all():
            raise ValueError(f"features[{i}] has a value that is not finite: expected finite")
        valid = len(f)
        if masks is not None:
            mask = np.asarray(masks[i])
            if mask.shape != (len(f),) or mask.dtype != bool:
                raise ValueError(
                    f"masks[{i}] has shape {mask.shape} and dtype {mask.dtype}: expected "
                    f"[{len(f)}] bool"
                )
            valid = int(mask.sum())
            if not mask[:valid].all():
                raise ValueError(
                    f"masks[{i}] is not a prefix of valid frames (frame {int(np.argmin(mask))} "
                    f"invalid, {valid} valid): expected the feature extractor's mask"
                )
        out.append(f[:valid].astype(np.float32))
    return out


def pack_frames(clips, packing):
    """Clips' valid frames back to back, zeros to the packing's frame budget → [N, MEL_BINS]."""
    flat = np.concatenate([np.zeros((0, MEL_BINS), np.float32), *clips])
    return np.concatenate([flat, np.zeros((packing.num_frames - len(flat), MEL_BINS), np.float32)])
