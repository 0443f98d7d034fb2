r"""The Gemma 4 audio encoder in float16: which tensors its clamps keep in range, which can still
overflow, and when (docs/precision.md, "Audio").

The released E2B/E4B audio config (`AudioConfig`'s defaults, as released: hidden 1024, 12
conformer layers, 8 heads, gradient_clipping 1e10, attention_logit_cap 50) and E2B's
embed_audio (to 1536), random weights at init scales: every matrix and convolution
N(0, 1/fan_in), norm scales 1, per_dim_scale 0, output_proj's bias 0, and the clipped linears'
bounds ±inf (they bound nothing: the worst case; the released bounds are not known here). ref's
device model (`ref.numerics.probe`, float16) of the packed tower and embed_audio on one clip's
log-mel features (`ref.gemma4.audio_features.log_mel`): noise at −20 dBFS, full-scale noise, a
full-scale square wave, silence.

Per clip: the features' range (computed on the host, float32, not in the graph), and per kind
of tensor (its module path with the layer index dropped, its primitive and ordinal: `mul#0` of
a norm is its x·x) the largest |x| over all layers and the headroom to 65,504; the first tensor
that turns non-finite; `--show REGEX`: kinds shown beyond the top (default the attention logits
q·k + q·r, the softcap's input ×50). `--scale PATTERN K`: the parameters whose dotted path
PATTERN matches (`re.search`) ×K, on the full-scale noise (`norm\.weight$`: every RMSNorm and
LayerNorm scale, the way trained scales grow the residual stream; `(q|k)_proj\.linear`: the
attention logits ×K²), the same report.

    python benchmarks/audio_precision.py [--layers 12] [--seconds 30] [--top 12] [--show REGEX]
        [--scale PATTERN K]... [--no-clips]
"""

import argparse
import re
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ref import numerics  # noqa: E402
from ref.gemma4.audio import AudioModel, EmbedAudio  # noqa: E402
from ref.gemma4.audio_config import AudioConfig  # noqa: E402
from ref.gemma4.audio_features import log_mel  # noqa: E402
from ref.gemma4.audio_packing import pack, pack_frames  # noqa: E402
from ref.gemma4.audio_tower import audio_apply  # noqa: E402

RATE = 16_000
TEXT_HIDDEN = 1536  # E2B's embed_audio output (E4B's: 2560)


def clips(seconds, seed=0):
    """{name: [n] float32 samples in [−1, 1]} of the clips the audit runs."""
    n = int(seconds * RATE)
    rng = np.random.default_rng(seed)
    t = np.arange(n) / RATE
    return {
        "noise -20 dBFS": 0.1 * rng.uniform(-1, 1, n),
        "noise full scale": rng.uniform(-1, 1, n),
        "square 1 kHz full scale": np.sign(np.sin(2 * np.pi * 1000 * t)),
        "silence": np.zeros(n),
    }


def random_params(cfg, seed=0):
    """(tower params, embed_audio params) at init scales (module docstring): a tree shaped as
    `AudioModel`'s and `EmbedAudio`'s."""
    frames = jnp.zeros((8, 128), jnp.float32)
    index = pack([8], cfg).arrays
    tower = jax.eval_shape(lambda: AudioModel(cfg, False).init(jax.random.PRNGKey(0), frames,
                                                               index))["params"]  # fmt: skip
    out = jnp.zeros((1, cfg.output_proj_dims), jnp.float32)
    embed = jax.eval_shape(lambda: EmbedAudio(cfg).init(jax.random.PRNGKey(0), out))["params"]
    rng = np.random.default_rng(seed)

    def leaf(path, shape):
        name = path[-1].key
        if name == "weight" and len(shape.shape) >= 2:
            fan_in = int(np.prod(shape.shape[1:]))
            return rng.standard_normal(shape.shape, np.float32) / np.sqrt(fan_in)
        if name == "weight":
            return np.ones(shape.shape, np.float32)
        if name in ("per_dim_scale", "bias"):
            return np.zeros(shape.shape, np.float32)
        return np.full(shape.shape, -np.inf if "min" in name else np.inf, np.float32)

    return (jax.tree_util.tree_map_with_path(leaf, tower),
            jax.tree_util.tree_map_with_path(leaf, embed))  # fmt: skip


def scaled(params, pattern, k):
    """params with every leaf whose dotted path `pattern` matches (`re.search`) ×k."""

    def leaf(path, x):
        return x * k if re.search(pattern, ".".join(p.key for p in path)) else x

    return jax.tree_util.tree_map_with_path(leaf, params)


def probed(cfg, params, samples):
    """(features [T, 128] of `samples`, the float16 Records of the tower and embed_audio on
    them)."""
    features, mask = log_mel(np.asarray(samples, np.float32))
    features = features[mask]
    packing = pack([len(features)], cfg)
    frames = pack_frames([features], packing)

    def fn(frames, index, tower, embed):
        return audio_apply(tower, embed, frames, index, config=cfg, keep_states=False)["embeds"]

    _, records = numerics.probe(fn, "float16", frames, packing.arrays, *params)
    return features, records


def kind(record):
    """A Record's kind: its module path without the layer index, primitive and ordinal."""
    module = re.sub(r"layers\.\d+", "layers.N", record.name)
    return f"{module}:{record.primitive}#{record.ordinal}"


def peaks(records):
    """[(kind, largest |x| over its layers, the layer of that peak)], largest first."""
    top = {}
    for r in records:
        k = kind(r)
        if r.max_abs > top.get(k, (-1.0, ""))[0]:
            top[k] = (r.max_abs, r.name)
    return sorted(((k, p, n) for k, (p, n) in top.items()), key=lambda t: -t[1])


def report(label, features, records, top, show):
    """Lines: the features' range, the `top` largest kinds and those `show` matches
    (`re.search`) with their headroom, the first non-finite tensor."""
    lines = [f"{label}: features [{features.min():.3f}, {features.max():.3f}]"]
    found = peaks(records)
    for k, p, n in found[:top] + [t for t in found[top:] if re.search(show, t[0])]:
        lines.append(f"  {k:58s} {p:11.4g}  headroom {65504 / p if p else np.inf:9.3g}x  ({n})")
    bad = numerics.first_nonfinite(records)
    where = "none" if bad is None else f"{bad.primitive} {list(bad.shape)} in {bad.name}"
    lines.append(f"  first non-finite: {where}")
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--scale", nargs=2, action="append", default=[],
                        metavar=("PATTERN", "K"))  # fmt: skip
    parser.add_argument("--no-clips", action="store_true", help="only the --scale runs")
    parser.add_argument(
        "--show",
        default=r"self_attn:add#2$",
        help="kinds to show beyond --top (default: the attention logits)",
    )
    args = parser.parse_args()
    cfg = AudioConfig(num_hidden_layers=args.layers, text_hidden_size=TEXT_HIDDEN)
    params = random_params(cfg)
    sounds = clips(args.seconds)
    runs = [] if args.no_clips else [(label, params, s) for label, s in sounds.items()]
    for pattern, k in args.scale:
        changed = tuple(scaled(p, pattern, float(k)) for p in params)
        runs.append((f"{pattern} x{k}, noise full scale", changed, sounds["noise full scale"]))
    for label, weights, samples in runs:
        start = time.time()
        features, records = probed(cfg, weights, samples)
        print("\n".join(report(label, features, records, args.top, args.show)))
        print(f"  ({time.time() - start:.1f} s)", flush=True)


if __name__ == "__main__":
    main()
