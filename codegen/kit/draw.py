"""The picture of a blocked-attention schedule (`python -m codegen plan --png FILE`): one panel
per (batch rows, kv heads, query-head range) with the mask, every tile's status and order, and
how partial results flow (online carries, head-parallel merges). The tiles and costs are
`codegen.kit.schedule.report`'s."""

import json

import numpy as np

from codegen.kit.schedule import range_text, ratio, span
from codegen.kit.vector_options import attention_positions, attention_sizes

_ALL_ROWS, _SOME_ROWS, _PADDING = "#6baed6", "#c6dbef", "#e0e0e0"
_STATUS_COLORS = {"computed": "none", "empty": "#fdae6b", "skipped": "#bdbdbd"}
_CLIP = "#d62728"


def _panels(tiles):
    """Tiles grouped by (batch, kv heads, query-head range): one picture panel each."""
    out = {}
    for t in tiles:
        out.setdefault((t.batch, t.kv_heads, t.reps), []).append(t)
    return list(out.items())


def _panel_title(key, plan, group):
    batch, (j0, j1), (r0, r1) = key
    if plan.batch_fold:
        where = f"folded rows {j0}:{j1} (b*Hkv + j)"
    else:
        where = f"batch {range_text(batch)}, kv heads {j0}:{j1}"
    if (r0, r1) == (0, group):
        return f"{where}, q heads {j0 * group}:{j1 * group}"
    return f"{where}, q heads {j0 * group + r0}:{j0 * group + r1}"


def _shade(ax, visible, padding):
    """The mask: visible [rows, S, T] bool over keys 0 … T (dark where every row sees, light
    where some do), grey bands on the queries where padding [S] is set."""
    from matplotlib import colors

    s_len, t_len = visible.shape[1:]
    seen = visible.sum(0)
    shade = np.where(seen == visible.shape[0], 2, np.minimum(seen, 1))
    cmap = colors.ListedColormap(["white", _SOME_ROWS, _ALL_ROWS])
    ax.imshow(shade, cmap=cmap, vmin=0, vmax=2, extent=(0, t_len, s_len, 0), aspect="auto")
    for s in np.flatnonzero(padding):
        ax.axhspan(s, s + 1, color=_PADDING, zorder=0.5)


def _box(ax, q, kv, status, label, size):
    """A tile over queries q × keys kv (half-open ranges), filled by its status, its label in
    the middle."""
    from matplotlib.patches import Rectangle

    (q0, q1), (t0, t1) = q, kv
    face = _STATUS_COLORS[status]
    hatch = "///" if status == "skipped" else None
    rect = Rectangle(
        (t0, q0), t1 - t0, q1 - q0, facecolor=face, edgecolor="black", lw=1.6, hatch=hatch
    )
    rect.set_alpha(None if face == "none" else 0.75)
    rect.set_gid("tile")
    ax.add_patch(rect)
    ax.text(
        (t0 + t1) / 2, (q0 + q1) / 2, label, ha="center", va="center", fontsize=size, weight="bold"
    )


def _draw_panel(ax, tiles, plan, visible, padding, t_len):
    """One panel: visible [rows, S, T] of the block's batch rows, padding [S] (every row's
    query is −1), its tiles, numbers and flow arrows → number of tiles drawn."""
    s_len = visible.shape[1]
    merge = plan.parallel and len(plan.kv) * plan.split > 1
    margin = max(1.5, 0.18 * t_len) if merge else 0
    _shade(ax, visible, padding)
    size = 9 if len(tiles) <= 8 else 7
    for t in tiles:
        label = str(t.order) + (f"\n{len(t.pieces)} pieces" if len(t.pieces) > 1 else "")
        _box(ax, t.q, t.kv, t.status, label, size)
        for a, _ in t.pieces[1:]:
            ax.plot([a, a], list(t.q), ls="--", color="black", lw=1.0)
    _draw_flow(ax, tiles, plan, t_len, margin)
    ax.set_xlim(0, t_len + margin)
    ax.set_ylim(s_len, 0)
    ax.set_xticks(sorted({0, t_len, *(t.kv[0] for t in tiles)}))
    ax.set_yticks(sorted({0, s_len, *(t.q[0] for t in tiles)}))
    ax.tick_params(labelsize=7)
    return len(tiles)


def _draw_flow(ax, tiles, plan, t_len, margin):
    """Arrows: (m, l, O) carried from KV block to KV block, or every block into one merge."""
    arrow = dict(arrowstyle="->", color="#d62728", lw=1.3)
    by_loop = {}
    for t in tiles:
        by_loop.setdefault(t.loop, []).append(t)
    for group in by_loop.values():
        q0, q1 = group[0].q
        y = q0 + 0.72 * (q1 - q0)
        if not plan.parallel:
            for a, b in zip(group, group[1:], strict=False):
                reach = min(0.35 * span(a.kv), 0.35 * span(b.kv), 2.0)
                x = a.kv[1]
                ax.annotate("", xy=(x + reach, y), xytext=(x - reach, y), arrowprops=arrow)
            continue
        if not margin:
            continue
        box = (t_len + 0.5 * margin, (q0 + q1) / 2)
        frame = {"boxstyle": "round", "fc": "#fee0d2", "ec": "#d62728"}
        ax.text(*box, "merge", ha="center", va="center", fontsize=7, rotation=90, bbox=frame)
        for t in group:
            for a, c in t.pieces:
                ax.annotate(
                    "",
                    xy=(box[0] - 0.3 * margin, box[1]),
                    xytext=((a + c) / 2, y),
                    arrowprops={**arrow, "connectionstyle": "arc3,rad=-0.15", "lw": 0.9},
                )


def draw(path, result, options, max_panels=16):
    """Draw the schedule (attention; MoE: `draw_moe`; audio: `draw_audio`) to a PNG at `path`;
    returns {"tiles": drawn, "tiles_total": ..., "panels": drawn, "panels_total": ...} (also
    written into the PNG's Description)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    from matplotlib.patches import Patch

    if result.get("op") == "moe":
        return draw_moe(path, result)
    if result.get("op") == "audio_attention":
        return draw_audio(path, result)
    plan, tiles, visible = result["plan"], result["tiles"], result["visible"]
    _, h, hkv, s, t_len, _ = attention_sizes(options)
    q_pos = attention_positions(options)[0]
    panels = _panels(tiles)
    shown = panels[:max_panels]
    aspect = min(t_len / s, 2.5)
    cols = min(len(shown), 2 if aspect > 1.4 else 3)
    rows = -(-len(shown) // cols)
    width = 2.6 + 2.2 * aspect
    fig, axes = plt.subplots(
        rows,
        cols,
        figsize=(max(cols * width, 8.5), rows * 3.0 + 1.6),
        squeeze=False,
        layout="constrained",
    )
    drawn = 0
    for ax, (key, group) in zip(axes.flat, shown, strict=False):
        r0, r1 = group[0].rows
        padding = (q_pos[r0:r1] < 0).all(0)
        drawn += _draw_panel(ax, group, plan, visible[r0:r1], padding, t_len)
        ax.set_title(_panel_title(key, plan, h // hkv) + f" (mask rows {r0}:{r1})", fontsize=8)
        ax.set_xlabel("key slot (slot t holds position t)", fontsize=7)
        ax.set_ylabel("query", fontsize=7)
    for ax in axes.flat[len(shown) :]:
        ax.axis("off")
    more = "" if len(shown) == len(panels) else f"; first {len(shown)} of {len(panels)} panels"
    total, dense = result["total"], result["dense"]
    summary = (
        f"{len(tiles)} tiles; FLOPs {ratio(total.qk_flops + total.pv_flops, dense.qk_flops * 2)}"
        f" of dense, bytes {ratio(total.bytes, dense.bytes)}, peak working memory "
        f"{ratio(total.peak, dense.peak)}{more}"
    )
    fig.suptitle(
        _wrap(result["title"], int(max(cols * width, 8.5) * 13)) + "\n" + summary, fontsize=9
    )
    legend = [
        Patch(facecolor=_ALL_ROWS, label="visible (query, key) pair, every batch row"),
        Patch(facecolor=_SOME_ROWS, label="visible in some of the block's batch rows"),
        Patch(facecolor="white", edgecolor="black", label="tile computed (number = order)"),
        Patch(facecolor=_STATUS_COLORS["empty"], edgecolor="black", label="computed, fully masked"),
        Patch(facecolor=_STATUS_COLORS["skipped"], hatch="///", edgecolor="black", label="skipped"),
        Patch(facecolor=_PADDING, label="padding query (-1)"),
    ]
    flow = "red arrows: (m, l, O) carried to the next KV block"
    if plan.parallel:
        flow = "red arrows: independent pieces/blocks merged once (dashed: pieces, one per core)"
    fig.legend(
        handles=legend,
        loc="outside lower center",
        ncol=3,
        fontsize=7,
        title=flow,
        title_fontsize=7,
    )
    return _save(fig, path, drawn, len(tiles), len(shown), len(panels))


def _save(fig, path, drawn, total, panels, panels_total):
    """Write the figure (its counts in the PNG's Description) and close it → the counts."""
    from matplotlib import pyplot as plt

    info = {"tiles": drawn, "tiles_total": total, "panels": panels, "panels_total": panels_total}
    fig.savefig(path, dpi=90, metadata={"Software": None, "Description": json.dumps(info)})
    plt.close(fig)
    return info


def _wrap(text, width=120):
    words, lines, line = text.split(" "), [], ""
    for w in words:
        if line and len(line) + len(w) + 1 > width:
            lines.append(line)
            line = w
        else:
            line = f"{line} {w}".strip()
    return "\n".join([*lines, line])


def draw_moe(path, result, max_panels=16):
    """An MoE schedule (`codegen.kit.moe_schedule.report`) to a PNG: one panel per core, a row per
    expert it holds, each item a box over the rows it computes (dense: tokens; gather: picks
    of each token, one panel row per token; nsp: packed rows) filled as far as its rows are
    routed tokens, numbered in execution order → the same dict as `draw`."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    items, mode = result["items"], result["mode"]
    cores = sorted({i.core for i in items})
    shown = cores[:max_panels]
    cols = min(len(shown), 4)
    rows = -(-len(shown) // cols)
    fig, axes = plt.subplots(
        rows, cols, figsize=(max(3.4 * cols, 8.5), 2.8 * rows + 1.6), squeeze=False,
        layout="constrained",
    )  # fmt: skip
    drawn = 0
    for ax, core in zip(axes.flat, shown, strict=False):
        mine = [i for i in items if i.core == core]
        lane = (lambda i: i.token) if mode.name == "gather" else (lambda i: i.slot)
        lanes = sorted({lane(i) for i in mine})
        width = max(i.rows[1] for i in mine)
        size = 8 if len(mine) <= 16 else 6
        for item in mine:
            y = lanes.index(lane(item))
            a, b = item.rows
            box = Rectangle((a, y), b - a, 0.8, facecolor="none", edgecolor="black", lw=1.2)
            box.set_gid("tile")
            ax.add_patch(box)
            # nsp packs an expert's tokens to the front; dense's routed tokens sit where they are
            spans = [(a, item.routed)]
            if mode.name == "dense":
                spans = [(n, 1) for n in np.flatnonzero((result["index"] == item.expert).any(1))]
            for start, rows in spans:
                ax.add_patch(Rectangle((start, y), rows, 0.8, facecolor=_ALL_ROWS, lw=0))
            label = f"{item.order}\ne{item.expert}" if mode.name != "dense" else str(item.order)
            ax.text((a + b) / 2, y + 0.4, label, ha="center", va="center", fontsize=size)
            drawn += 1
        ax.set_xlim(0, width)
        ax.set_ylim(len(lanes), 0)
        ax.set_yticks([n + 0.4 for n in range(len(lanes))])
        names = {"gather": "token {}", "dense": "expert {}"}.get(mode.name, "slot {}")
        ticks = [names.format(v) for v in lanes]
        if mode.name == "nsp":
            ticks = [f"slot {v}: e{v * mode.num_nsp + core}" for v in lanes]
        ax.set_yticklabels(ticks, fontsize=7)
        ax.tick_params(labelsize=7)
        xlabel = {"dense": "token", "gather": "pick k"}.get(mode.name, "packed row")
        ax.set_xlabel(xlabel, fontsize=7)
        ax.set_title(f"core {core}" if mode.name == "nsp" else f"{mode.name}: one core", fontsize=8)
    for ax in axes.flat[len(shown) :]:
        ax.axis("off")
    total, dense = result["total"], result["dense"]
    more = "" if len(shown) == len(cores) else f"; first {len(shown)} of {len(cores)} cores"
    fig.suptitle(
        _wrap(result["title"], 110) + f"\n{len(items)} items; FLOPs "
        f"{ratio(total.flops, dense.flops)} of dense, weight bytes "
        f"{ratio(total.weight_bytes, dense.weight_bytes)}{more}",
        fontsize=9,
    )
    legend = [
        Patch(facecolor=_ALL_ROWS, label="rows of routed tokens"),
        Patch(
            facecolor="white", edgecolor="black", label="rows computed (number = order; eN: expert)"
        ),
    ]
    fig.legend(handles=legend, loc="outside lower center", ncol=2, fontsize=7)
    return _save(fig, path, drawn, len(items), len(shown), len(cores))


def _zero_slots(ax, chunk):
    """Hatch a chunk's window slots outside its clip (they read the zero row, masked)."""
    from matplotlib.patches import Rectangle

    (q0, q1), (w0, w1), (k0, k1) = chunk.queries, chunk.window, chunk.keys
    for a, b in ((w0, k0), (k1, w1)):
        if b > a:
            face = _STATUS_COLORS["skipped"]
            ax.add_patch(Rectangle((a, q0), b - a, q1 - q0, fc=face, hatch="///", lw=0, alpha=0.75))


def draw_audio(path, result):
    """The audio chunked attention (`codegen.kit.audio_schedule.report`) to a PNG: the packed
    (query, key) plane shaded by the chunked mask, each chunk's C + P + F window a tile over its
    queries (number: chunk row + 1), its slots outside the clip hatched, clip boundaries dashed,
    filler tokens grey → the same dict as `draw` (filler chunks, with no query, not drawn)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    packing, found, visible = result["packing"], result["chunks"], result["visible"]
    real = [c for c in found if c.clip is not None]
    filler = packing.segment_ids < 0
    m = len(visible)
    fig, ax = plt.subplots(figsize=(9.5, 9.0), layout="constrained")
    _shade(ax, visible[None], filler)
    for chunk in real:
        _box(ax, chunk.queries, chunk.window, "computed", str(chunk.order), 9)
        _zero_slots(ax, chunk)
    bounds = [int(x) for x in packing.cu_tokens[1:]]
    for x in bounds:
        ax.axvline(x, color=_CLIP, ls="--", lw=1.2)
        ax.axhline(x, color=_CLIP, ls="--", lw=1.2)
    ax.set_xlim(min(0, *(c.window[0] for c in real)), max(m, *(c.window[1] for c in real)))
    ax.set_ylim(m, 0)
    ticks = sorted({0, m, *bounds, *(c.queries[0] for c in real)})
    ax.set_xticks(ticks)
    ax.set_yticks(ticks)
    ax.tick_params(labelsize=7)
    ax.set_xlabel("key: packed soft token (clips back to back)", fontsize=8)
    ax.set_ylabel("query: packed soft token", fontsize=8)
    total, dense = result["total"], result["dense"]
    extra = (
        f" (+{len(found) - len(real)} filler chunks, no query)" if len(real) < len(found) else ""
    )
    fig.suptitle(
        _wrap(result["title"], 110) + f"\n{len(real)} chunks{extra}; FLOPs "
        f"{ratio(total.qk_flops + total.pv_flops, dense.qk_flops + dense.pv_flops)} of dense, "
        f"exps {ratio(total.exps, dense.exps)}, peak working memory "
        f"{ratio(total.peak, dense.peak)}",
        fontsize=9,
    )
    legend = [
        Patch(facecolor=_ALL_ROWS, label="visible (query, key): same clip, the query itself or "
              "one of its P - 1 past keys (or F later)"),
        Patch(facecolor="white", edgecolor="black", label="chunk: its queries x its C + P + F "
              "window slots (number = chunk row + 1)"),
        Patch(facecolor=_STATUS_COLORS["skipped"], hatch="///", label="window slot outside the "
              "clip: reads the zero row, masked (-1e9 after the cap)"),
        Line2D([], [], color=_CLIP, ls="--", label="clip boundary (cu_tokens)"),
    ]  # fmt: skip
    if filler.any():
        legend.append(Patch(facecolor=_PADDING, label="filler token (segment_ids -1)"))
    fig.legend(handles=legend, loc="outside lower center", ncol=2, fontsize=7)
    return _save(fig, path, len(real), len(found), 1, 1)
