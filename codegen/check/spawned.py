"""A check's work in a process of its own (spawned), for a graph checked layer by layer
because of its size: what the work leaves behind (onnxruntime's shared arena, XLA's compiled
layers and buffers, glibc's heap) ends with the process, and, for a graph of HUGE_BYTES of
weights or more, glibc backs the blocks it maps (every block of `sessions.MMAP_BYTES` or
more: a layer's weights, XLA's temporaries) with transparent huge pages
(`glibc.malloc.hugetlb=1`, read by glibc 2.35 and later at start; an older one ignores it).
Each such block is a fresh mapping the kernel zero-fills page by page; in 2 MiB pages a
26B-A4B decode layer of `ref`'s fp16 device model took 0.9 s where it took 2.1 s (with 2.2 s
of system CPU time over the 2 cores), a prefill layer 3.5–4.8 s where it took 6.5 s (5.9 s
of system time)."""

import contextlib
import multiprocessing
import os
import sys
from concurrent.futures import ProcessPoolExecutor

from codegen.folder.sessions import fix_mmap_threshold

HUGE_PAGES = "glibc.malloc.hugetlb=1"
# float32 weight bytes from which a graph's child gets huge pages: below, a child's small
# blocks cost more in 2 MiB pages than they save (the test suite's tiny graphs: the layer-by-
# layer plan test 45 → 52 s with them)
HUGE_BYTES = 1 << 30


def spawned(fn, *args, weights=0):
    """fn(*args) (picklable, as `args` are) in a new spawned process → its result; in huge
    pages when the graph's float32 `weights` bytes are HUGE_BYTES or more."""
    spawn = multiprocessing.get_context("spawn")
    pages = huge_pages() if weights >= HUGE_BYTES else contextlib.nullcontext()
    with pages, ProcessPoolExecutor(1, mp_context=spawn) as pool:
        return pool.submit(_entered, fn, args).result()


def _entered(fn, args):
    """The child's side: glibc's mmap threshold fixed from the start
    (`sessions.fix_mmap_threshold`), as a process that had opened a session first had it."""
    fix_mmap_threshold()
    return fn(*args)


def to_stderr(line):
    """A child's log: each line to standard error as it comes."""
    print(line, file=sys.stderr, flush=True)


@contextlib.contextmanager
def huge_pages():
    """GLIBC_TUNABLES with HUGE_PAGES added while the block runs (a process started in it
    reads it; a hugetlb setting already there is left as it is), restored after."""
    before = os.environ.get("GLIBC_TUNABLES")
    if "glibc.malloc.hugetlb=" not in (before or ""):
        os.environ["GLIBC_TUNABLES"] = ":".join(t for t in (before, HUGE_PAGES) if t)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("GLIBC_TUNABLES", None)
        else:
            os.environ["GLIBC_TUNABLES"] = before
