"""weights.read_block / LazyTensor: any box of a tensor, read from its byte ranges alone, is
bit-exact numpy slicing of the whole (exact runs and spanned short runs alike); bad indices
and a file that shrank are refused with messages naming them."""

import os

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import weights
from tests.util import examples
from weights import blocks

DTYPES = [np.float32, ml_dtypes.bfloat16, np.int8, np.float64]


@st.composite
def boxes(draw):
    """(array, index): a random tensor (0-4 dims) and a tuple of step-1 slices of it."""
    shape = tuple(draw(st.lists(st.integers(0, 9), max_size=4)))
    dtype = draw(st.sampled_from(DTYPES))
    seed = draw(st.integers(0, 2**32 - 1))
    bits = np.random.default_rng(seed).integers(
        0, 256, size=int(np.prod(shape)) * 8, dtype=np.uint8
    )
    array = bits.view(np.uint8)[: int(np.prod(shape)) * np.dtype(dtype).itemsize]
    array = array.view(dtype).reshape(shape)
    index = []
    for n in shape[: draw(st.integers(0, len(shape)))]:
        a = draw(st.integers(0, n))
        b = draw(st.integers(a, n))
        index.append(draw(st.sampled_from([slice(a, b), slice(None), slice(a, None)])))
    return array, tuple(index)


@pytest.mark.parametrize("span", [blocks.SPAN, 24])  # 24 bytes: many spans of short runs
@settings(max_examples=examples(150), deadline=None)
@given(case=boxes())
def test_block_equals_numpy_slicing(tmp_path_factory, span, case):
    array, index = case
    path = tmp_path_factory.mktemp("b") / "t.safetensors"
    weights.write_safetensors(path, {"a": np.arange(3.0), "t": array})
    lazy = weights.LazyTensor(weights.read_header(path)["t"])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(blocks, "SPAN", span)
        got = lazy[index]
    want = array[index]
    assert got.shape == want.shape and got.dtype == want.dtype
    assert got.tobytes() == want.tobytes()
    assert lazy.shape == array.shape and lazy.dtype == array.dtype
    assert np.asarray(lazy).tobytes() == array.tobytes()


def test_long_runs_are_read_exactly(tmp_path, monkeypatch):
    """Runs of a page or more: one read per run, of exactly its bytes."""
    array = np.arange(8 * 4096, dtype=np.float32).reshape(8, 4096)
    path = tmp_path / "t.safetensors"
    weights.write_safetensors(path, {"t": array})
    reads = []
    real = os.preadv
    monkeypatch.setattr(
        os, "preadv", lambda fd, bufs, off: reads.append(len(bufs[0])) or real(fd, bufs, off)
    )
    got = weights.LazyTensor(weights.read_header(path)["t"])[:, 1024:2048]
    np.testing.assert_array_equal(got, array[:, 1024:2048])
    assert reads == [4096] * 8


def test_bad_indices_and_shrunk_file(tmp_path):
    path = tmp_path / "t.safetensors"
    weights.write_safetensors(path, {"t": np.zeros((4, 5), np.float32)})
    lazy = weights.LazyTensor(weights.read_header(path)["t"])
    with pytest.raises(
        IndexError, match=r"entry 1 is slice\(None, None, 2\); expected a slice with step 1"
    ):
        lazy[:, ::2]
    with pytest.raises(IndexError, match="entry 0 is 3; expected a slice"):
        lazy[3]
    with pytest.raises(IndexError, match="has 3 entries for a 2-d tensor"):
        lazy[:, :, :]
    os.truncate(path, os.path.getsize(path) - 4)
    with pytest.raises(weights.CheckpointError, match="shorter than when its header was read"):
        lazy[3:, 4:]


def test_lazy_tree_reads_nothing_until_asked(tmp_path):
    weights.save_checkpoint(tmp_path / "m", {}, {"a.b": np.ones((2, 3), np.float32)})
    _, tree = weights.load_checkpoint(tmp_path / "m", lazy=True)
    leaf = tree["a"]["b"]
    assert isinstance(leaf, weights.LazyTensor) and leaf.shape == (2, 3)
    np.testing.assert_array_equal(leaf[1:, :2], np.ones((1, 2), np.float32))


def test_short_reads_are_continued(tmp_path, monkeypatch):
    """Linux preadv returns at most 2 GiB per call: a partial read is continued, not refused."""
    array = np.arange(64, dtype=np.float64).reshape(4, 16)
    path = tmp_path / "t.safetensors"
    weights.write_safetensors(path, {"t": array})
    real = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, off: real(fd, [bufs[0][:7]], off))
    lazy = weights.LazyTensor(weights.read_header(path)["t"])
    np.testing.assert_array_equal(lazy[1:3], array[1:3])
    np.testing.assert_array_equal(lazy[:, 3:5], array[:, 3:5])
