"""An export with an MTP assistant (`export --assistant`): the drafter's checkpoint lives in a
folder of its own inside the export (`assistant/`: its config.json, generation_config.json and
hard-linked shards), and the graphs name its tensors `assistant.<checkpoint name>`, so that
one graph can hold both models' weights without a clash (both have `model.layers.0…`).

`with_assistant` is the one view of both checkpoints every reader uses (export, verify, run):
the target's tensors under their names, the drafter's under the prefix, each pointing at the
bytes of its own shard. Plain Python over `weights`; no onnx.
"""

import dataclasses
import os

from weights import generation_config, open_checkpoint

ASSISTANT = "assistant"  # the drafter's folder inside an export
PREFIX = ASSISTANT + "."  # the graphs' names of its tensors


def with_assistant(target, assistant):
    """One `Checkpoint` over the target (its dir and config) and the drafter: the drafter's
    tensors named `PREFIX + name`, its shards after the target's."""
    tensors = dict(target.tensors)
    for name, info in assistant.tensors.items():
        tensors[PREFIX + name] = info
    return dataclasses.replace(target, tensors=tensors, shards=[*target.shards, *assistant.shards])


def open_export(folder):
    """The export `folder` as a checkpoint: the target, with the drafter of its `assistant/`
    folder when it has one (`with_assistant`)."""
    target = open_checkpoint(folder)
    inside = os.path.join(folder, ASSISTANT)
    if not os.path.isfile(os.path.join(inside, "config.json")):
        return target
    return with_assistant(target, open_checkpoint(inside))


def assistant_options(folder):
    """{"config": the drafter's config.json dict, "generation_config": its
    generation_config.json dict or None} of an assistant checkpoint folder: what the
    speculate graph is built from (and records)."""
    return {
        "config": open_checkpoint(folder).config,
        "generation_config": generation_config(folder),
    }


def stored_name(location, name):
    """The name a graph's weight `name`, held in shard `location` (relative to the export),
    has in that shard's header: the drafter's without `PREFIX`."""
    inside = location.startswith(ASSISTANT + "/") and name.startswith(PREFIX)
    return name[len(PREFIX) :] if inside else name
