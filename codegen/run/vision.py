"""The vision graph's part of a prefill: each prompt row's images and video frames through
`vision`, consecutive items packed into one call while they fit the largest exported budget,
each call at the least budget that holds it; a row's soft tokens come back as one stream
[tokens, hidden] in order of appearance, which the prefill hands out chunk by chunk."""

import numpy as np

from codegen.run import unified
from codegen.run.errors import RunError
from ref.gemma4.config import VisionConfig
from ref.gemma4.packing import pack, pack_patches


class Vision:
    """The vision graph's calls for one prefill."""

    def __init__(self, hf_config, budgets, hidden_size, *, takes_images, run):
        """hf_config: the checkpoint's config.json (its `vision_config` read when an image is
        encoded); budgets: the exported soft-token budgets, increasing; hidden_size: the text
        model's; takes_images: whether the prefill graph takes `vision_embeds`; run: feed →
        the vision graph's outputs (None: the export has no vision graph)."""
        self.hf_config = hf_config
        self.budgets = budgets
        self.hidden_size = hidden_size
        self.takes_images = takes_images
        self.run = run

    def streams(self, runs, images, log):
        """Each row's soft tokens in order of appearance, [tokens, hidden] per row (None when
        the prefill graph takes no vision inputs).

        runs: per row, (start, length) of each image run; images: (patches [h·w, 3·p·p] in
        [0, 1], (h, w)) per image run, in order of appearance, row by row."""
        want = sum(len(r) for r in runs)
        if len(images) != want:
            raise RunError(f"{len(images)} images given, the prompts hold {want} image runs")
        if not self.takes_images:
            if want:
                raise RunError("the prompts hold image runs but the prefill graph takes no images")
            return None
        it = iter(images)
        streams = []
        for i, row_runs in enumerate(runs):
            items = [next(it) for _ in row_runs]
            streams.append(self.encode_row(i, row_runs, items))
            if items:
                log(f"vision row {i}: {len(items)} item(s), {len(streams[-1])} soft tokens")
        return streams

    def encode_row(self, row, row_runs, items):
        """One row's items through the vision graph, consecutive items packed together while
        they fit the largest budget, each call at the least budget that holds it → [tokens,
        hidden]."""
        most = self.budgets[-1]
        groups = []
        for run, item in zip(row_runs, items, strict=True):
            if run[1] > most:
                raise RunError(
                    f"row {row}: the image run at {run[0]} has {run[1]} tokens; the largest "
                    f"vision budget exported is {most}"
                )
            if not groups or sum(n for _, n in groups[-1][0]) + run[1] > most:
                groups.append(([], []))
            groups[-1][0].append(run)
            groups[-1][1].append(item)
        parts = [np.zeros((0, self.hidden_size), np.float32)]
        for group_runs, group_items in groups:
            total = sum(n for _, n in group_runs)
            budget = next(b for b in self.budgets if b >= total)
            parts.append(self.encode(row, group_runs, group_items, budget)[:total])
        return np.concatenate(parts)

    def encode(self, row, row_runs, row_images, budget):
        """The vision graph on one row's images packed into `budget` soft tokens → [budget,
        hidden]."""
        if self.run is None:
            raise RunError("images given but the export has no vision graph")
        if unified.is_unified(self.hf_config):
            return unified.encode_blocks(row, row_runs, row_images, budget, self.run)
        cfg = VisionConfig.from_hf(self.hf_config)
        k = cfg.pooling_kernel_size
        grids = []
        for (start, n), (_, grid) in zip(row_runs, row_images, strict=True):
            h, w = (int(x) for x in grid)
            if h % k or w % k or (h // k) * (w // k) != n:
                raise RunError(
                    f"row {row}: the image run at {start} has {n} tokens but grid {h}x{w} "
                    f"pools to {(h // k) * (w // k)} (h and w must be multiples of {k})"
                )
            grids.append((h, w))
        packing = pack(
            grids,
            pooling_kernel_size=k,
            position_embedding_size=cfg.position_embedding_size,
            budget=budget,
        )
        patches = pack_patches([p for p, _ in row_images], grids, cfg.patch_dim, packing)
        feed = {
            "pixel_patches": patches,
            "positions": packing.positions,
            "segment_ids": packing.segment_ids,
            "pool_index": packing.pool_index,
        }
        return next(iter(self.run(feed).values()))
