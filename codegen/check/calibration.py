"""The calibration inputs of a node-precision plan from the user's own requests (`verify
--precision fp16 --write-npi --prompts FILE`): real prompts, images, videos and audio clips are
what overflow, not drawn ones.

FILE is `serve`'s requests file (JSONL, `codegen.run.commands.read_requests`: prompt text or
ids, images, videos, audios, max_new_tokens). Each request is generated alone by the export's
float32 graphs in onnxruntime (`codegen.run.runtime.Runner`, greedy, no stop id: every one of
its max_new_tokens steps runs), and the feed of every graph call is kept by graph kind: the
vision calls of its images and video frames, the audio calls of its clips, its prefill chunks,
its decode steps. The device graph then runs on those feeds; the caches a prefill or decode
call reads are the float32 graphs' (a feed is a graph's input, not the device's own history).
Every feed is held until the plan is made: a decode step holds its whole KV cache, so keep
max_new_tokens small at large ctx_len.
"""

import numpy as np

from codegen.run.commands import read_requests
from codegen.run.runtime import Runner


def recorded_feeds(folder, path, *, check_shards=True, log=None):
    """{graph kind: [(label, feed)]} of every graph call made generating the requests of
    `path` with the export `folder` (a path, or an opened `codegen.folder.opened.Export`), in
    call order; label: "request R <kind> N"."""
    log = log or (lambda line: None)
    calls, current = {}, [0]

    def record(kind, feed):
        mine = calls.setdefault(kind, [])
        label = f"request {current[0] + 1} {kind} {len(mine) + 1}"
        mine.append((label, {k: np.array(v, copy=True) for k, v in feed.items()}))

    runner = Runner(folder, check_shards=check_shards, on_call=record)
    requests = read_requests(path, runner)
    for i, r in enumerate(requests):
        current[0] = i
        runner.generate([r.ids], r.images, audios=r.audios, max_new_tokens=r.max_new_tokens,
                        stop=())  # fmt: skip
        log(f"calibration: request {i + 1} of {len(requests)} generated")
    return calls
