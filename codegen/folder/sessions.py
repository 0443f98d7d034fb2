"""The export folder as the runner and the checks read it: manifest.json (`codegen.folder.manifest`,
its shards checked), each graph's ModelProto and onnxruntime session.

Imports onnx, onnxruntime and the folder's integrity check only — not the exporter (jax2onnx),
so `codegen run` and `serve` load without it (a test keeps it so).
"""

import ctypes
import json
import os
import shutil
import tempfile
from pathlib import Path

import onnx
import onnxruntime as ort

from codegen.folder import external, manifest
from codegen.folder.integrity import check_folder

MMAP_BYTES = 1 << 20  # blocks from this size on are mapped, and unmapped when freed
_M_MMAP_THRESHOLD = -3  # glibc's malloc.h

try:
    LIBC = ctypes.CDLL("libc.so.6")
    LIBC.malloc_trim  # noqa: B018 (glibc only)
except (OSError, AttributeError):
    LIBC = None


def give_back():
    """Hand the C heap's free pages back to the system (glibc's `malloc_trim`; elsewhere
    nothing): a layer's buffers below glibc's mmap threshold are otherwise kept by the
    process, and its resident size creeps up layer after layer."""
    if LIBC is not None:
        LIBC.malloc_trim(0)


def read_manifest(folder, *, check_shards=True):
    """The folder's `codegen.folder.manifest.Manifest` (`load`), after
    `codegen.folder.integrity.check_folder` unless told not to."""
    found = manifest.load(folder)
    if check_shards:
        check_folder(folder, found)
    return found


def options():
    """onnxruntime session options for every graph of an export: quiet, and nodes run in the
    graph's own order (`PRIORITY_BASED`: the ready node listed first runs first), which is
    the order `ref` traced them in. onnxruntime's default order is a depth-first walk back from
    the outputs that takes the input listed last first: it transposed a 31B layer's MLP
    weights (1.2 GB of float32) before its attention and kept all 16 KV blocks' score tiles of
    a query chunk alive at once; the 31B prefill's full layer ran at +5.9 GB over its inputs
    that way, +3.2 GB in the graph's order."""
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.execution_order = ort.ExecutionOrder.PRIORITY_BASED
    fix_mmap_threshold()
    return opts


def fix_mmap_threshold():
    """glibc only: every block of MMAP_BYTES or more is mapped, and unmapped when freed. By
    default glibc raises its threshold to each freed mapped block's size (up to 32 MiB); after
    that a graph's 16–36 MiB tensors come from the heap, which keeps its freed holes, and a
    run of many such tensors grows without bound: the E2B prefill's full layer as the fp16
    audit runs it (38,904 nodes, no tensor over 36 MiB) reached 6.22 GB at ctx 8192 and was
    killed past 17 GB at 65,536; with the threshold fixed, 1.61 GB at ctx 8192."""
    if LIBC is not None:
        LIBC.mallopt(_M_MMAP_THRESHOLD, MMAP_BYTES)


_SHARED = []  # the process's shared arena, registered once (`shared_arena`)


def shared_arena():
    """Register, once per process, onnxruntime's shared CPU arena that `session_at(...,
    shared=True)` sessions allocate from: a best-fit arena grown by what each allocation
    asks (not doubled), whose freed blocks the next run and the next session reuse. It is
    never handed back: use it in a process that ends when its runs do. Without it every
    tensor is a fresh mapping the kernel zero-fills (about 0.4 ns a byte on this host: a 31B
    vision layer's score tiles, 400 MB a tensor, cost 2 s of system time a layer)."""
    if not _SHARED:
        info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0,
                                 ort.OrtMemType.DEFAULT)  # fmt: skip
        ort.create_and_register_allocator(info, ort.OrtArenaCfg({"arena_extend_strategy": 1}))
        _SHARED.append(info)


def session_at(model, path, initializers=None, shared=False):
    """An onnxruntime CPU session on the in-memory `model`, written at `path` for as long as
    loading takes (its external data resolves beside it) and removed after; initializers:
    {name: (OrtValue, the array it may share)} used instead of the model's own (the caller
    keeps the arrays alive with the session); shared: its tensors from the process's
    `shared_arena` instead of fresh memory each."""
    opts = options()
    if shared:
        shared_arena()
        opts.add_session_config_entry("session.use_env_allocators", "1")
    for name, (value, _) in (initializers or {}).items():
        opts.add_initializer(name, value)
    # no constant folding: folding a weight's Cast holds the checkpoint's bytes, the float32
    # result and a serialized copy of it at once (31B layer: +4.2 GB → +3.1 GB, and faster);
    # unfolded, each Cast runs when the graph reaches it
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    # no arena of its own: each run's tensors go back when freed (an arena grows by doubling
    # and keeps its chunks for the session's life)
    opts.enable_cpu_mem_arena = shared
    try:
        with open(path, "wb") as f:
            f.write(model.SerializeToString())
        return ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
    finally:
        os.remove(path)


def load_graph(entry, folder, checkpoint):
    """The graph of manifest `entry` (a `codegen.folder.manifest.Graph`) as an in-memory ModelProto
    (external data left on disk); `--weights inputs` graphs get their weights bound from the
    weight spec."""
    model = onnx.load(os.path.join(folder, entry.file), load_external_data=False)
    if entry.weight_spec is not None:
        with open(os.path.join(folder, entry.weight_spec)) as f:
            spec = json.load(f)
        external.inputs_to_initializers(model, spec, checkpoint.tensors, checkpoint.dir)
    return model


def open_session(entry, folder, checkpoint):
    """An onnxruntime session on the graph; `--weights inputs` graphs get their weights bound
    from the weight spec (written beside the folder's other files, removed after loading)."""
    path = os.path.join(folder, entry.file)
    if entry.weight_spec is None:
        return ort.InferenceSession(path, options(), providers=["CPUExecutionProvider"])
    model = load_graph(entry, folder, checkpoint)
    return session_at(model, os.path.join(folder, f".verify.{entry.name}.onnx"))


def publish(tmp, out):
    """Rename the finished temporary folder to `out`, replacing what is there."""
    if out.is_dir() and any(out.iterdir()):
        old = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".old"))
        os.replace(out, old / "replaced")
        os.replace(tmp, out)
        shutil.rmtree(old)
    else:
        if out.is_dir():
            out.rmdir()
        os.replace(tmp, out)


def atomic_text(path, text):
    """Write `text` (str or bytes) to `path` through a temporary sibling, replaced into place."""
    tmp = f"{path}.tmp"
    with open(tmp, "w" if isinstance(text, str) else "wb") as f:
        f.write(text)
    os.replace(tmp, path)
