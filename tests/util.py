"""Small helpers shared by the test modules (one home each)."""

import functools
import json
import os
import shutil
import subprocess
import sys
import wave

import jax
import numpy as np
import pytest
from hypothesis import settings
from PIL import Image


def rel_err(got, want):
    """max|got − want| / max|want| in float64 (want not all zero: 1e-30 guards the division)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def jitted(fn, *arrays, **kwargs):
    """fn(*arrays, **kwargs) as one compiled program: positional and array keyword arguments
    traced, every other keyword static. Eager JAX compiles each primitive of a new shape on
    its own; a drawn example of an unrolled blocked mode is hundreds of them (measured on
    tiled vision attention: 3.7x slower than one jit)."""
    traced = {k: v for k, v in kwargs.items() if isinstance(v, np.ndarray | jax.Array)}
    static = tuple(sorted((k, v) for k, v in kwargs.items() if k not in traced))
    return _compiled(fn, static)(*arrays, **traced)


@functools.cache
def _compiled(fn, static):
    return jax.jit(functools.partial(fn, **dict(static)))


def vision_runs(rng, n):
    """Random contiguous vision runs over n positions: run id ≥ 0 per vision token, −1 text."""
    ids = np.full(n, -1)
    run, i = 0, 0
    while i < n:
        length = int(rng.integers(1, 5))
        if rng.random() < 0.4:
            ids[i : i + length] = run
            run += 1
        i += length
    return ids


def run_on_host_devices(script, devices):
    """Run `script` (Python source) in a fresh interpreter with `devices` CPU devices (the count
    is fixed when jax starts) from the repository root; → its stdout. Fails the test with the
    output unless it exits 0 and its last line is "OK"."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    flags = os.environ.get("XLA_FLAGS", "")
    env = dict(
        os.environ,
        XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count={devices}".strip(),
        JAX_PLATFORMS="cpu",
        PYTHONPATH=root,
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=root, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().endswith("OK"), proc.stdout
    return proc.stdout


def examples(n):
    """max_examples of a property test: n in the default run, chosen by the test's cost (the
    table in docs/testing.md); 20 times as many in the long profile (`HYPOTHESIS_PROFILE=long`),
    as tests without a count of their own go from hypothesis' 100 to the profile's 2000."""
    return 20 * n if settings.get_current_profile_name() == "long" else n


def small_export(checkpoint, tmp_path_factory, **options):
    """The folder of `checkpoint` exported with one vision budget (70), seq_len 16 and
    `options` (`ExportOptions` fields)."""
    from codegen.export.command import ExportOptions, export

    out = tmp_path_factory.mktemp("export") / "out"
    opts = ExportOptions(out=out, model=checkpoint, budgets=(70,), seq_len=16, **options)
    export(opts, log=print)
    return out


def prompt_logits(model, *args, **kwargs):
    """A `Gemma4`'s logits [V] of the prompt's last token: `model.generate_from(*args,
    max_new_tokens=1, **kwargs)` with each step traced anew (a patched function: the cached
    trace of the compiled step would not see it)."""
    from ref.gemma4.step import apply_step

    seen = []
    step = jax.jit(
        functools.partial(apply_step, last_only=True), static_argnames=("config", "attention")
    )

    def record(*a, **k):
        out = step(*a, **k)
        seen.append(np.asarray(out["logits"][0, 0]))
        return out

    model.with_step(record).generate_from(*args, max_new_tokens=1, **kwargs)
    return seen[0]


def serve_requests(out, lines, folder):
    """Request dicts `lines` written to folder/requests.jsonl and served greedily over the
    export `out` → (the Runner, (tokens per request, timeline))."""
    from codegen.run.commands import read_requests
    from codegen.run.runtime import Runner

    path = folder / "requests.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines))
    runner = Runner(out)
    return runner, runner.serve(read_requests(path, runner, {"greedy": True}))


def assert_served(got, wants, timeline):
    """Each request's tokens equal its wanted ones (the serve timeline in the message)."""
    for i, (g, w) in enumerate(zip(got, wants, strict=True)):
        np.testing.assert_array_equal(g, w, err_msg=f"request {i}\n" + "\n".join(timeline))


def folder_copy(folder, tmp_path):
    """tmp_path/copy: a copy of the export `folder` (shards copied, not linked) to change."""
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    return copy


def write_wav(path, samples, rate, channels=1, width=2):
    """int samples [n, channels] as a PCM WAV of `width` bytes a sample."""
    with wave.open(str(path), "wb") as f:
        f.setnchannels(channels)
        f.setsampwidth(width)
        f.setframerate(rate)
        f.writeframes(np.asarray(samples, f"<i{width}").tobytes())


def write_av(path, codec, ints, rate, frames=0):
    """ints [n, channels] int16 encoded by `codec` at `rate` (None: no sound stream; n = 0: a
    stream without packets) into the container `path` names, after `frames` 16×16 MPEG-4 video
    frames."""
    import av

    with av.open(str(path), "w") as container:
        streams = []
        if frames:
            video = container.add_stream("mpeg4", rate=8)
            video.width = video.height = 16
            black = av.VideoFrame.from_ndarray(np.zeros((16, 16, 3), np.uint8), format="rgb24")
            streams.append((video, [black] * frames))
        if ints is not None:
            layout = "stereo" if ints.shape[1] == 2 else "mono"
            pcm = np.asarray(ints, np.int16).reshape(1, -1)  # interleaved
            frame = av.AudioFrame.from_ndarray(pcm, format="s16", layout=layout)
            frame.sample_rate = rate
            sound = container.add_stream(codec, rate=rate, layout=layout)
            streams.append((sound, [frame] if len(ints) else []))
        for stream, items in streams:  # every stream added before the first packet
            for item in [*items, None]:
                container.mux(stream.encode(item))


def linked_copy(folder, tmp_path, graphs):
    """tmp_path/copy: a copy of the export `folder` whose `graphs`' .onnx files a test may edit
    (copied; the shards hard-linked, to be left unchanged)."""
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy, copy_function=os.link)
    for graph in graphs:
        os.remove(copy / f"{graph}.onnx")
        shutil.copyfile(folder / f"{graph}.onnx", copy / f"{graph}.onnx")
    return copy


def same_shape_pair(model, needle):
    """Two external initializers of different layers of the ModelProto `model` whose names end
    in `needle`, same shape and type."""
    found = {}
    for t in model.graph.initializer:
        if t.name.endswith(needle):
            found.setdefault((tuple(t.dims), t.data_type), []).append(t)
    pair = next(ts for ts in found.values() if len(ts) >= 2)
    return pair[0], pair[1]


def layer_of(name):
    """The layer index in a checkpoint name `….layers.N.…`."""
    return int(name.split(".layers.")[1].split(".")[0])


def rebind(folder, graph, target, source):
    """`graph`.onnx in `folder` with initializer `target` reading `source`'s bytes."""
    import onnx

    path = os.path.join(folder, f"{graph}.onnx")
    model = onnx.load(path, load_external_data=False)
    by_name = {t.name: t for t in model.graph.initializer}
    del by_name[target].external_data[:]
    by_name[target].external_data.extend(by_name[source].external_data)
    tmp = path + ".tmp"
    onnx.save(model, tmp)
    os.replace(tmp, path)


def released_template():
    """The released Gemma 4 instruct chat template, test data in ../shared/gemma4/ beside the
    checkout (never copied into the project); the test skips, saying why, where it is absent."""
    path = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "gemma4")
    path = os.path.join(os.path.abspath(path), "chat_template.jinja")
    if not os.path.isfile(path):
        pytest.skip(f"{path} is absent: the released template is test data beside the checkout")
    with open(path, encoding="utf-8") as f:
        return f.read()


def save_animation(path, frames, fps):
    """An animated PNG of frames [T, H, W, 3] uint8 whose frame duration carries fps (none
    when fps is None) → path."""
    timing = {} if fps is None else {"duration": 1000 / fps}
    first, *rest = [Image.fromarray(f) for f in frames]
    first.save(path, save_all=True, append_images=rest, default_image=False, **timing)
    return path
