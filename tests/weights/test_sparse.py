"""A sparse checkpoint (holes where no byte was written: every full-size benchmark's text
layers) reads as zeros there, whole, into a reused buffer and by blocks, whether or not the
file system reports its holes."""

import dataclasses
import errno
import json
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from weights.blocks import read_block
from weights.safetensors import numpy_dtype, read_header, read_tensor

PAGE = 4096


def _sparse_file(path, values, written):
    """A one-tensor safetensors file of float32 `values` whose data starts on a page, with
    only the data pages in `written` written (the rest holes) → the values it holds (the
    oracle: numpy, no reader of ours)."""
    header = {"t": {"dtype": "F32", "shape": [values.size], "data_offsets": [0, values.nbytes]}}
    raw = json.dumps(header).encode()
    raw += b" " * (PAGE - 8 - len(raw))
    data = values.tobytes()
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        f.truncate(PAGE + len(data))
        for p in written:
            f.seek(PAGE + p * PAGE)
            f.write(data[p * PAGE : (p + 1) * PAGE])
    held = np.zeros(values.size, np.float32)
    for p in written:
        held[p * PAGE // 4 : (p + 1) * PAGE // 4] = values[p * PAGE // 4 : (p + 1) * PAGE // 4]
    return held


def _reports_holes(folder):
    """True when the file system of `folder` reports holes: a file of one hole has no data."""
    probe = folder / "hole"
    with open(probe, "wb") as f:
        f.truncate(PAGE)
        try:
            os.lseek(f.fileno(), 0, os.SEEK_DATA)
        except OSError as e:
            return e.errno == errno.ENXIO
        return False


@st.composite
def layouts(draw):
    pages = draw(st.integers(1, 12))
    size = draw(st.integers((pages - 1) * PAGE // 4 + 1, pages * PAGE // 4))
    written = draw(st.sets(st.integers(0, pages - 1)))
    return size, sorted(written), draw(st.integers(0, 2**32 - 1))


@settings(max_examples=40, deadline=None)
@given(layouts(), st.booleans())
def test_holes_read_as_zeros(tmp_path_factory, layout, reported):
    """Whole (into a buffer full of NaN, so a hole left unwritten shows), mapped, and a block;
    reported=False: a file system that does not report holes (lseek's EINVAL)."""
    size, written, seed = layout
    values = np.random.default_rng(seed).standard_normal(size, dtype=np.float32) + 1
    path = tmp_path_factory.mktemp("sparse") / "model.safetensors"
    held = _sparse_file(path, values, written)
    info = read_header(path)["t"]
    real, pread, read = os.lseek, os.preadv, []

    def lseek(fd, pos, how):
        if how in (os.SEEK_DATA, os.SEEK_HOLE) and not reported:
            raise OSError(errno.EINVAL, "holes not reported")
        return real(fd, pos, how)

    def preadv(fd, buffers, offset):
        read.append(pread(fd, buffers, offset))
        return read[-1]

    os.lseek, os.preadv = lseek, preadv
    try:
        out = np.full(size, np.nan, np.float32)
        got = read_tensor(info, out=out)
    finally:
        os.lseek, os.preadv = real, pread
    assert got is out
    if reported and _reports_holes(path.parent):  # only the written pages were read
        assert sum(read) == sum(min(PAGE, 4 * size - p * PAGE) for p in written)
    box = read_block(info, (slice(size // 3, size),))
    np.testing.assert_array_equal(got, held)
    np.testing.assert_array_equal(read_tensor(info), held)
    np.testing.assert_array_equal(box, held[size // 3 :])


def test_a_file_of_holes_only_reads_as_zeros(tmp_path):
    """Nothing written after the header: every span is a hole (lseek's ENXIO at once)."""
    path = tmp_path / "model.safetensors"
    _sparse_file(path, np.ones(3000, np.float32), [])
    out = np.full(3000, np.nan, np.float32)
    assert not read_tensor(read_header(path)["t"], out=out).any()


@settings(max_examples=30, deadline=None)
@given(layouts(), st.integers(2, 3 * PAGE), st.sampled_from(["BF16", "F16"]))
def test_read_through_a_stage_casts_every_element(tmp_path_factory, layout, stage, code):
    """A 16-bit tensor with holes read into float32 through a stage of any length of at least
    one element (not a multiple of the element: the last byte unused): every element equals
    numpy's cast of the stored values, holes zeros; a stage shorter than an element, not of
    bytes, or without `out`, is refused naming it."""
    size, written, seed = layout
    dt = numpy_dtype(code)
    values = (np.random.default_rng(seed).standard_normal(2 * size) + 1).astype(dt)
    path = tmp_path_factory.mktemp("staged") / "model.safetensors"
    _sparse_file(path, values.view(np.float32), written)
    info = read_header(path)["t"]
    info = dataclasses.replace(info, dtype=code, shape=(2, size))
    held = np.frombuffer(path.read_bytes()[PAGE : PAGE + values.nbytes], dt).reshape(2, size)
    out = np.full((2, size), np.nan, np.float32)
    got = read_tensor(info, out=out, stage=np.empty(stage, np.uint8))
    assert got is out
    np.testing.assert_array_equal(got, held.astype(np.float32))
    with pytest.raises(ValueError, match="stage uint8\\[1\\] needs `out`"):
        read_tensor(info, out=out, stage=np.empty(1, np.uint8))
    with pytest.raises(ValueError, match="stage uint8\\[8\\] needs `out`"):
        read_tensor(info, stage=np.empty(8, np.uint8))
    with pytest.raises(ValueError, match="stage float32\\[4\\] needs `out`"):
        read_tensor(info, out=out, stage=np.empty(4, np.float32))
