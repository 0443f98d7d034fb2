"""weights: safetensors index and HF folders, checked bit-exactly against the raw bytes and
against the `safetensors` library (the format's reference implementation) as oracles."""

import json
import math
import os
import tempfile
from pathlib import Path

import hypothesis.extra.numpy as hnp
import numpy as np
import pytest
import safetensors
import safetensors.numpy
from hypothesis import given, settings
from hypothesis import strategies as st

import weights
from tests.util import examples
from weights import CheckpointError

READABLE = [code for code, (_, dt) in weights.DTYPES.items() if dt is not None]
# The reference library's constructor names for each dtype code it can serialize.
SPEC_NAMES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "I16": "int16",
    "U16": "uint16",
    "I32": "int32",
    "U32": "uint32",
    "I64": "int64",
    "U64": "uint64",
    "F16": "float16",
    "F32": "float32",
    "F64": "float64",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2": "float8_e5m2",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "F8_E8M0": "float8_e8m0fnu",
    "F4": "float4_e2m1fn_x2",
    "C64": "complex64",
}

names = st.text(
    st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=12
).filter(lambda s: s != "__metadata__")
shapes = hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5)


@st.composite
def arrays(draw, codes=READABLE):
    """Any readable dtype (bf16/fp8 via ml_dtypes), 0-d and zero-size included, random bits."""
    code = draw(st.sampled_from(codes))
    shape = draw(shapes)
    dt = weights.numpy_dtype(code)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    count = math.prod(shape) * dt.itemsize
    # bool bytes other than 0/1 are not booleans to numpy or torch
    raw = rng.integers(0, 2 if code == "BOOL" else 256, count, dtype=np.uint8)
    return raw.view(dt).reshape(shape)


tensor_dicts = st.dictionaries(names, arrays(), max_size=6)
metadata = st.none() | st.dictionaries(names, st.text(max_size=8), max_size=3)


def bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8).tobytes()


def assert_same(ours: np.ndarray, expected: np.ndarray) -> None:
    assert ours.dtype == expected.dtype and ours.shape == expected.shape
    assert bits(ours) == bits(expected)


def raw_slice(info: weights.TensorInfo) -> bytes:
    """What an ONNX external-data reader does: seek to offset, read nbytes."""
    with open(info.file, "rb") as f:
        f.seek(info.offset)
        return f.read(info.nbytes)


# ---------------------------------------------------------------- round trips


@settings(max_examples=examples(60))
@given(tensors=tensor_dicts, meta=metadata)
def test_file_round_trip_bit_exact(tensors, meta):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "x.safetensors"
        weights.write_safetensors(path, tensors, meta)
        infos = weights.read_header(path)
        assert weights.read_metadata(path) == (meta or {})
        assert set(infos) == set(tensors)
        size = path.stat().st_size
        for name, a in tensors.items():
            info = infos[name]
            assert (info.file, info.dtype, info.shape) == (
                path,
                weights.dtype_code(a.dtype),
                a.shape,
            )
            assert info.offset % max(a.dtype.itemsize, 1) == 0  # aligned like the reference writer
            assert info.offset + info.nbytes <= size
            assert_same(weights.read_tensor(info), a)
            assert raw_slice(info) == bits(a)
        assert not [p for p in os.listdir(tmp) if p != "x.safetensors"]  # no temp left behind


@settings(max_examples=examples(40))
@given(tensors=tensor_dicts.filter(bool), shard_bytes=st.none() | st.integers(1, 400))
def test_checkpoint_round_trip_bit_exact(tensors, shard_bytes):
    config = {"model_type": "test", "n": len(tensors)}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "model"
        weights.save_checkpoint(folder, config, tensors, max_shard_bytes=shard_bytes)
        ckpt = weights.open_checkpoint(folder)
        assert ckpt.config == config and ckpt.dir == folder
        assert list(ckpt.tensors) == sorted(tensors)
        for name, a in tensors.items():
            info = ckpt.tensors[name]
            assert info.file.parent == folder and info.file in ckpt.shards
            assert_same(ckpt.read(name), a)
            assert_same(ckpt.read(name, mapped=False), a)
            assert raw_slice(info) == bits(a)
        if len(ckpt.shards) > 1:
            total = sum(a.nbytes for a in tensors.values())
            index = json.loads((folder / "model.safetensors.index.json").read_text())
            assert index["metadata"]["total_size"] == total
            for shard in ckpt.shards:  # full, except a tensor bigger than a shard goes alone
                sizes = [i.nbytes for i in ckpt.tensors.values() if i.file == shard]
                assert sum(sizes) <= shard_bytes or len(sizes) == 1


# ------------------------------------------------ cross-check with `safetensors`


@st.composite
def reference_files(draw):
    """(bytes written by the reference library, {name: (code, shape, data bytes)})."""
    entries, keep = {}, []
    for name in draw(st.lists(names, max_size=6, unique=True)):
        code = draw(st.sampled_from(sorted(SPEC_NAMES)))
        shape = list(draw(shapes))
        if code == "F4" and not shape:
            shape = [1]
        storage = math.prod(shape) * weights.DTYPES[code][0] // 8  # F4: shape is bytes here
        if code == "F4":
            shape[-1] *= 2
            storage = math.prod(shape) // 2
        data = np.frombuffer(draw(st.binary(min_size=storage, max_size=storage)), np.uint8)
        if code == "BOOL":
            data = data & 1
        data = np.ascontiguousarray(data)
        keep.append(data)
        spec_shape = shape[:-1] + [shape[-1] // 2] if code == "F4" else shape
        entries[name] = (code, tuple(shape), data.tobytes())
        spec = safetensors.TensorSpec(
            dtype=SPEC_NAMES[code],
            shape=spec_shape,
            data_ptr=data.ctypes.data if data.size else 0,
            data_len=data.size,
        )
        entries[name] += (spec,)
    meta = draw(metadata)
    blob = safetensors.serialize({k: v[3] for k, v in entries.items()}, meta)
    del keep
    return blob, {k: v[:3] for k, v in entries.items()}, meta


@settings(max_examples=examples(60))
@given(case=reference_files())
def test_reads_what_the_reference_library_writes(case):
    blob, expected, meta = case
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ref.safetensors"
        path.write_bytes(blob)
        try:
            theirs = dict(safetensors.deserialize(blob))
        except safetensors.SafetensorError:
            # safetensors 0.8.0 writes `{},"__metadata__":{}}` for no tensors + empty metadata
            with pytest.raises(CheckpointError, match="not valid JSON"):
                weights.read_header(path)
            return
        infos = weights.read_header(path)
        assert weights.read_metadata(path) == (meta or {})
        assert set(infos) == set(expected) == set(theirs)
        for name, (code, shape, data) in expected.items():
            info = infos[name]
            assert (info.dtype, info.shape) == (code, shape)
            assert raw_slice(info) == data == bytes(theirs[name]["data"])
            if code in READABLE:
                assert bits(weights.read_tensor(info)) == data


@settings(max_examples=examples(40))
@given(tensors=tensor_dicts, meta=metadata)
def test_reference_library_reads_what_we_write(tensors, meta):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ours.safetensors"
        weights.write_safetensors(path, tensors, meta)
        theirs = dict(safetensors.deserialize(path.read_bytes()))
        assert set(theirs) == set(tensors)
        for name, a in tensors.items():
            entry = theirs[name]
            assert entry["dtype"] == weights.dtype_code(a.dtype)
            assert tuple(entry["shape"]) == a.shape and bytes(entry["data"]) == bits(a)
        plain = {k: a for k, a in tensors.items() if a.dtype in safetensors.numpy._TYPES.values()}
        with safetensors.safe_open(path, framework="np") as f:
            for name, a in plain.items():
                assert_same(f.get_tensor(name), a)


# ------------------------------------------------------------- HF folder layouts


def _save(folder: Path, tensors: dict, shard_bytes=None) -> Path:
    weights.save_checkpoint(folder, {"model_type": "t"}, tensors, max_shard_bytes=shard_bytes)
    return folder


SMALL = {
    "model.a.weight": np.arange(12, dtype=np.float32).reshape(3, 4),
    "model.a.bias": np.ones(3, np.float32),
    "model.b.weight": np.arange(6, dtype=np.int64),
}


def test_hf_cache_layout_with_symlinked_shards(tmp_path):
    """snapshots/<rev>/*.safetensors -> ../../blobs/<hash>: loads, files stay in the snapshot."""
    built = _save(tmp_path / "built", SMALL, shard_bytes=50)
    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots" / "abc123"
    blobs.mkdir()
    snap.mkdir(parents=True)
    for i, f in enumerate(sorted(built.iterdir())):
        (blobs / f"hash{i}").write_bytes(f.read_bytes())
        (snap / f.name).symlink_to(Path("../../blobs") / f"hash{i}")
    ckpt = weights.open_checkpoint(snap)
    assert len(ckpt.shards) > 1
    for name, a in SMALL.items():
        assert ckpt.tensors[name].file.parent == snap and ckpt.tensors[name].file.is_symlink()
        assert_same(ckpt.read(name), a)


def test_load_checkpoint_tree_and_prefix(tmp_path):
    folder = _save(tmp_path / "m", SMALL, shard_bytes=50)
    config, params = weights.load_checkpoint(folder)
    assert config == {"model_type": "t"}
    assert_same(params["model"]["a"]["weight"], SMALL["model.a.weight"])
    assert_same(params["model"]["b"]["weight"], SMALL["model.b.weight"])
    sub = weights.open_checkpoint(folder).tree("model.a.")
    assert set(sub) == {"weight", "bias"}
    assert weights.open_checkpoint(folder).tree("model.a").keys() == sub.keys()
    with pytest.raises(CheckpointError, match="no tensor names start with 'model.zzz.'"):
        weights.open_checkpoint(folder).tree("model.zzz")


def test_tree_refuses_a_name_that_is_both_tensor_and_group(tmp_path):
    folder = _save(tmp_path / "m", {"a": np.ones(1), "a.b": np.ones(2)})
    with pytest.raises(CheckpointError, match="'a.b'.*'a'"):
        weights.load_checkpoint(folder)


def test_require_names_tensor_and_both_shapes(tmp_path):
    ckpt = weights.open_checkpoint(_save(tmp_path / "m", SMALL))
    ckpt.require({"model.a.weight": (3, 4), "model.b.weight": (6,)})
    with pytest.raises(
        CheckpointError, match=r"'model\.a\.weight' has shape \(3, 4\), expected \(4, 3\)"
    ):
        ckpt.require({"model.a.weight": (4, 3)})
    with pytest.raises(CheckpointError, match=r"'model\.c' with shape \(2,\) is missing"):
        ckpt.require({"model.c": (2,)})
    with pytest.raises(CheckpointError, match="no tensor 'nope'"):
        ckpt.read("nope")


def test_save_checkpoint_refuses_to_overwrite(tmp_path):
    folder = _save(tmp_path / "m", SMALL)
    with pytest.raises(FileExistsError, match="not empty"):
        _save(folder, {"x": np.zeros(2)})
    weights.save_checkpoint(folder, {"v": 2}, {"x": np.zeros(2)}, overwrite=True)
    ckpt = weights.open_checkpoint(folder)
    assert list(ckpt.tensors) == ["x"] and ckpt.config == {"v": 2}
    assert sorted(os.listdir(tmp_path)) == ["m"]  # no temporary siblings left
    (tmp_path / "empty").mkdir()
    _save(tmp_path / "empty", SMALL)
    assert set(weights.open_checkpoint(tmp_path / "empty").tensors) == set(SMALL)


def test_failed_save_leaves_nothing(tmp_path):
    with pytest.raises(TypeError, match="'bad' must be a numpy array"):
        _save(tmp_path / "m", {"ok": np.ones(2), "bad": [1, 2]})
    assert os.listdir(tmp_path) == []
    with pytest.raises(TypeError, match="no safetensors code"):
        weights.write_safetensors(tmp_path / "x.safetensors", {"s": np.array(["a"])})
    assert os.listdir(tmp_path) == []


# --------------------------------------------- one clear error per bad input


def encode(header: dict | bytes, data: bytes = b"", length: int | None = None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return (len(raw) if length is None else length).to_bytes(8, "little") + raw + data


F32x2 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
HEADER_CASES = {
    "short file": (b"\x01\x00", "too short for the 8-byte header length"),
    "length past end": (encode({"t": F32x2}, bytes(8), length=10**6), "runs past the end"),
    "length over limit": (encode({}, length=2**64 - 1), "exceeds the format's limit"),
    "not utf-8": (encode(b'{"\xff":1}'), "not UTF-8"),
    "not json": (encode(b'{"t": '), "not valid JSON"),
    "not an object": (encode([1, 2]), "must be a JSON object, got list"),
    "duplicate name": (
        encode(
            b'{"t":'
            + json.dumps(F32x2).encode() * 1
            + b',"t":'
            + json.dumps(F32x2).encode()
            + b"}",
            bytes(8),
        ),
        "duplicate key 't'",
    ),
    "unknown dtype": (
        encode({"t": {**F32x2, "dtype": "F33"}}, bytes(8)),
        "'t': unknown dtype 'F33'",
    ),
    "negative dim": (encode({"t": {**F32x2, "shape": [-2]}}, bytes(8)), "'t': shape must be"),
    "offsets not pair": (
        encode({"t": {**F32x2, "data_offsets": [0]}}, bytes(8)),
        "'t': data_offsets must",
    ),
    "offsets reversed": (encode({"t": {**F32x2, "data_offsets": [8, 0]}}, bytes(8)), "end before"),
    "offset past end": (
        encode({"t": {**F32x2, "data_offsets": [0, 16]}}, bytes(8)),
        "'t': data_offsets span 16 bytes",
    ),
    "size mismatch": (
        encode({"t": {**F32x2, "shape": [3]}}, bytes(8)),
        "needs more than the 8 bytes",
    ),
    "gap": (encode({"t": {**F32x2, "data_offsets": [4, 12]}}, bytes(12)), "'t': gap of 4 bytes"),
    "overlap": (
        encode({"t": F32x2, "u": {**F32x2, "data_offsets": [4, 12]}}, bytes(12)),
        "'u': data_offsets \\[4, 12\\] overlap tensor 't'",
    ),
    "trailing bytes": (encode({"t": F32x2}, bytes(9)), "tensors cover 8 bytes but the data after"),
    "sub-byte": (
        encode({"t": {"dtype": "F4", "shape": [3], "data_offsets": [0, 2]}}, bytes(2)),
        "not a whole number of bytes",
    ),
    "zero-size beyond numpy": (
        encode({"t": {"dtype": "F32", "shape": [2**61, 0], "data_offsets": [0, 0]}}),
        "'t': F32 shape \\[2305843009213693952, 0\\] is too large for numpy",
    ),
    "metadata values": (encode({"__metadata__": {"k": 1}}), "__metadata__ must map strings"),
    "missing key": (
        encode({"t": {"dtype": "F32", "shape": [2]}}, bytes(8)),
        "'t': entry has no 'data_offsets'",
    ),
}


@pytest.mark.parametrize("case", sorted(HEADER_CASES))
def test_each_bad_header_has_its_own_error(tmp_path, case):
    blob, message = HEADER_CASES[case]
    path = tmp_path / "bad.safetensors"
    path.write_bytes(blob)
    with pytest.raises(CheckpointError, match=message) as err:
        weights.read_header(path)
    assert str(path) in str(err.value)


def test_sub_byte_dtypes_are_indexed_but_not_read_as_numpy(tmp_path):
    path = tmp_path / "f4.safetensors"
    path.write_bytes(
        encode({"t": {"dtype": "F4", "shape": [2, 3], "data_offsets": [0, 3]}}, b"abc")
    )
    info = weights.read_header(path)["t"]
    assert raw_slice(info) == b"abc"
    with pytest.raises(CheckpointError, match="'t': cannot read dtype 'F4'"):
        weights.read_tensor(info)


def _sharded(tmp_path) -> tuple[Path, dict]:
    folder = _save(tmp_path / "m", SMALL, shard_bytes=64)  # [a.bias, a.weight], [b.weight]
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    return folder, index


def _with_index(folder: Path, index: dict) -> Path:
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("../m/model-00001-of-00002.safetensors", "expected a relative file name inside"),
        ("/etc/passwd", "expected a relative file name inside"),
        ("sub/../../x.safetensors", "expected a relative file name inside"),
        ("C:\\x.safetensors", "expected a relative file name inside"),
        (
            "missing.safetensors",
            "missing.safetensors \\(holding tensor 'model.a.bias'\\) is missing",
        ),
        ("model-00002-of-00002.safetensors", "lists tensor 'model.a.bias' in shard model-00002"),
    ],
)
def test_bad_index_entries(tmp_path, name, message):
    folder, index = _sharded(tmp_path)
    index["weight_map"]["model.a.bias"] = name
    with pytest.raises(CheckpointError, match=message):
        weights.open_checkpoint(_with_index(folder, index))


def test_index_and_shards_disagree(tmp_path):
    folder, index = _sharded(tmp_path)
    shard = index["weight_map"].pop("model.a.bias")
    with pytest.raises(CheckpointError, match="holds tensor 'model.a.bias', which the shard index"):
        weights.open_checkpoint(_with_index(folder, index))
    index["weight_map"]["model.a.bias"] = shard
    index["weight_map"]["model.ghost"] = shard
    with pytest.raises(CheckpointError, match="lists tensor 'model.ghost'.*which does not hold it"):
        weights.open_checkpoint(_with_index(folder, index))
    for bad in ({}, {"weight_map": {}}, {"weight_map": ["x"]}):
        with pytest.raises(CheckpointError, match="'weight_map' must be a non-empty object"):
            weights.open_checkpoint(_with_index(folder, bad))


def test_duplicate_tensor_across_shards(tmp_path):
    folder, index = _sharded(tmp_path)
    shards = sorted(set(index["weight_map"].values()))
    first = dict(weights.read_header(folder / shards[0]))
    extra = {n: weights.read_tensor(i) for n, i in first.items()}
    second = {
        n: np.array(weights.read_tensor(i))
        for n, i in weights.read_header(folder / shards[1]).items()
    }
    weights.write_safetensors(
        folder / shards[1], {**second, **{n: np.array(a) for n, a in extra.items()}}
    )
    with pytest.raises(CheckpointError, match="is also in shard .*exactly one shard"):
        weights.open_checkpoint(folder)


def test_missing_files_and_non_regular_shards(tmp_path):
    folder, index = _sharded(tmp_path)
    shard = folder / index["weight_map"]["model.a.bias"]
    shard.unlink()
    shard.symlink_to(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match="is a broken symbolic link"):
        weights.open_checkpoint(folder)
    shard.unlink()
    os.mkfifo(shard)  # opening a FIFO for reading would block without O_NONBLOCK
    with pytest.raises(CheckpointError, match="not a regular file"):
        weights.open_checkpoint(folder)
    shard.unlink()
    shard.mkdir()
    with pytest.raises(CheckpointError, match="not a regular file"):
        weights.open_checkpoint(folder)
    (folder / "model.safetensors.index.json").unlink()
    with pytest.raises(CheckpointError, match="has neither model.safetensors nor"):
        weights.open_checkpoint(folder)
    (folder / "config.json").write_text("[1]")
    with pytest.raises(CheckpointError, match="config must be a JSON object"):
        weights.open_checkpoint(folder)
    (folder / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json: file is missing"):
        weights.open_checkpoint(folder)
    with pytest.raises(CheckpointError, match="not a folder"):
        weights.open_checkpoint(folder / "nothing")


def test_read_tensor_refuses_a_file_that_shrank(tmp_path):
    path = tmp_path / "x.safetensors"
    weights.write_safetensors(path, {"t": np.arange(100, dtype=np.float32)})
    info = weights.read_header(path)["t"]
    with open(path, "r+b") as f:
        f.truncate(info.offset + 10)
    for mapped in (True, False):
        with pytest.raises(CheckpointError, match="'t': file is .* shorter than when its head"):
            weights.read_tensor(info, mapped=mapped)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc")
def test_reading_every_tensor_keeps_one_descriptor_per_file(tmp_path):
    """Each memory map holds a file descriptor: one per file, not per tensor."""
    path = tmp_path / "many.safetensors"
    weights.write_safetensors(path, {f"t{i}": np.full(3, i, np.float32) for i in range(300)})
    before = len(os.listdir("/proc/self/fd"))
    arrays = [weights.read_tensor(i) for i in weights.read_header(path).values()]
    assert len(os.listdir("/proc/self/fd")) - before <= 1
    assert sorted(int(a[0]) for a in arrays) == list(range(300))
    assert not arrays[0].flags.writeable


def test_big_endian_arrays_are_written_little_endian(tmp_path):
    path = tmp_path / "be.safetensors"
    values = np.array([1.5, -2.0, 3.25])
    weights.write_safetensors(path, {"be": values.astype(">f4"), "i": np.arange(3, dtype=">i8")})
    infos = weights.read_header(path)
    assert infos["be"].dtype == "F32" and raw_slice(infos["be"]) == values.astype("<f4").tobytes()
    assert_same(weights.read_tensor(infos["i"]), np.arange(3, dtype="<i8"))


def test_config_is_read_as_transformers_reads_it(tmp_path):
    """config.json is Python JSON (Infinity allowed, last duplicate wins), the index is strict."""
    folder = _save(tmp_path / "m", SMALL, shard_bytes=64)
    (folder / "config.json").write_text('{"cap": Infinity, "a": 1, "a": 2}')
    assert weights.open_checkpoint(folder).config == {"cap": float("inf"), "a": 2}
    (folder / "model.safetensors.index.json").write_text('{"weight_map": {"a": "x", "a": "y"}}')
    with pytest.raises(CheckpointError, match="duplicate key 'a'"):
        weights.open_checkpoint(folder)


# ------------------------------------------------ exact messages and limits (make mutation)


def _header_error(tmp_path, blob) -> str:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(blob)
    with pytest.raises(CheckpointError) as err:
        weights.read_header(path)
    prefix = f"{path}: "
    assert str(err.value).startswith(prefix)
    return str(err.value)[len(prefix) :]


def test_header_errors_exact(tmp_path):
    """The whole message: which tensor, what is wrong, the numbers involved."""
    cases = [
        ({"t": 5}, b"", "tensor 't': entry must be an object, got int"),
        (
            {"t": {**F32x2, "shape": [9], "data_offsets": [0, 32]}},
            bytes(32),
            "tensor 't': F32 shape [9] needs more than the 32 bytes data_offsets span",
        ),
        (
            {"t": {**F32x2, "shape": [1]}},
            bytes(8),
            "tensor 't': data_offsets span 8 bytes; F32 [1] needs 4",
        ),
        (
            {"t": {"dtype": "F4", "shape": [3], "data_offsets": [0, 2]}},
            bytes(2),
            "tensor 't': F4 shape [3] is not a whole number of bytes",
        ),
        (
            {"t": {**F32x2, "shape": [2**63]}},
            bytes(8),
            "tensor 't': shape must be a list of integers in [0, 2**63), got [9223372036854775808]",
        ),
        (
            {"t": {**F32x2, "data_offsets": [0, 2**64]}},
            bytes(8),
            "tensor 't': data_offsets must be [begin, end] byte offsets, got "
            "[0, 18446744073709551616]",
        ),
    ]
    for header, data, message in cases:
        assert _header_error(tmp_path, encode(header, data)) == message
    name = "\ud800"  # a lone surrogate, smuggled in by a JSON escape
    blob = encode(b'{"\\ud800": ' + json.dumps(F32x2).encode() + b"}", bytes(8))
    assert _header_error(tmp_path, blob) == (
        f"tensor {repr(name)!r}: tensor name is not valid Unicode text"
    )


def test_header_limits_are_inclusive(tmp_path):
    """A dimension of 2**63 − 1 and an offset of 2**64 − 1 are in range; a zero-size U8 tensor
    of 2**63 − 1 rows still fits numpy's limit."""
    path = tmp_path / "edge.safetensors"
    path.write_bytes(
        encode({"t": {"dtype": "U8", "shape": [2**63 - 1, 0], "data_offsets": [0, 0]}})
    )
    info = weights.read_header(path)["t"]
    assert (info.shape, info.nbytes) == ((2**63 - 1, 0), 0)
    top = 2**64 - 1
    far = {"t": {**F32x2, "data_offsets": [top, top]}}
    want = f"tensor 't': gap of {top} bytes before data_offsets [{top}, {top}]"
    assert _header_error(tmp_path, encode(far)) == want


def test_dtype_refusals_exact(tmp_path):
    with pytest.raises(CheckpointError) as err:
        weights.numpy_dtype("F4")
    assert str(err.value) == "dtype 'F4': it packs 4-bit values, which numpy cannot lay out"
    with pytest.raises(CheckpointError) as err:
        weights.numpy_dtype("F33")
    assert str(err.value) == (
        f"dtype 'F33': unknown safetensors dtype; expected one of {list(weights.DTYPES)}"
    )
    path = tmp_path / "x.safetensors"
    path.write_bytes(bytes(8) + np.array([1.5, -2.0], "<f4").tobytes())
    info = weights.TensorInfo("t", path, "X1", (2,), 8, 8)
    with pytest.raises(CheckpointError) as err:
        weights.read_tensor(info)
    assert str(err.value) == (
        f"{path}: tensor 't': cannot read dtype 'X1' as numpy: unknown safetensors dtype; "
        f"expected one of {list(weights.DTYPES)}"
    )


def test_read_tensor_checks_its_tensor_info(tmp_path):
    """Offset 8 (right after the length) is the first valid one; the byte count must match."""
    path = tmp_path / "x.safetensors"
    path.write_bytes(bytes(8) + np.array([1.5, -2.0], "<f4").tobytes())
    got = weights.read_tensor(weights.TensorInfo("t", path, "F32", (2,), 8, 8))
    assert got.tolist() == [1.5, -2.0]
    for offset, nbytes in ((7, 8), (8, 4)):
        with pytest.raises(CheckpointError) as err:
            weights.read_tensor(weights.TensorInfo("t", path, "F32", (2,), offset, nbytes))
        assert str(err.value) == (
            f"{path}: tensor 't': TensorInfo holds {nbytes} bytes at {offset}, needs 8"
        )


def test_writer_is_byte_identical_to_the_reference_library(tmp_path):
    """Same header (compact JSON, UTF-8 names and metadata, space padding), same data order."""
    tensors = {
        "b.ü": np.arange(6, dtype=np.float32).reshape(2, 3),
        "a": np.arange(3, dtype=np.int8),
        "c": np.ones(2, np.float64),
        "d": np.asfortranarray(np.arange(6, dtype=">i2").reshape(2, 3)),
    }
    meta = {"ké": "vé"}  # one key: the reference library keeps metadata in a hash map
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    weights.write_safetensors(ours, tensors, meta)
    safetensors.numpy.save_file(
        {k: np.ascontiguousarray(v, v.dtype.newbyteorder("<")) for k, v in tensors.items()},
        theirs,
        metadata=meta,
    )
    assert ours.read_bytes() == theirs.read_bytes()
    assert oct(ours.stat().st_mode & 0o777) == "0o644"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ours.safetensors", "theirs.safetensors"]


def test_writer_refusals_exact(tmp_path):
    path = tmp_path / "x.safetensors"
    with pytest.raises(ValueError) as err:
        weights.write_safetensors(path, {"__metadata__": np.zeros(1)})
    assert (
        str(err.value)
        == "tensor name '__metadata__' must be a Unicode string other than __metadata__"
    )
    for bad in ({"k": 1}, {1: "v"}, ["k"]):
        with pytest.raises(TypeError) as err:
            weights.write_safetensors(path, {"t": np.zeros(1)}, bad)
        assert str(err.value) == f"metadata must map str to str, got {bad!r}"
    with pytest.raises(TypeError) as err:
        weights.write_safetensors(path, {"t": [1.0]})
    assert str(err.value) == "tensor 't' must be a numpy array, got list"
    assert not path.exists() and list(tmp_path.iterdir()) == []


def test_more_header_errors_exact(tmp_path):
    ones = [1] * 64
    ok = tmp_path / "ok.safetensors"
    ok.write_bytes(encode({"t": {"dtype": "F32", "shape": ones, "data_offsets": [0, 4]}}, bytes(4)))
    assert weights.read_header(ok)["t"].shape == tuple(ones)
    cases = [
        (
            encode({"t": {"dtype": "F32", "shape": ones + [1], "data_offsets": [0, 4]}}, bytes(4)),
            "tensor 't': shape has 65 dimensions; at most 64 are supported",
        ),
        (
            encode({"t": {**F32x2, "data_offsets": [8, 0]}}, bytes(8)),
            "tensor 't': data_offsets [8, 0] end before they begin",
        ),
        (
            encode({"t": F32x2, "u": {**F32x2, "data_offsets": [12, 20]}}, bytes(20)),
            "tensor 'u': gap of 4 bytes before data_offsets [12, 20]",
        ),
        (bytes(8), "header is not valid JSON: Expecting value: line 1 column 1 (char 0)"),
        (bytes(7), "file is 7 bytes, too short for the 8-byte header length"),
        (
            encode({}, length=100_000_001),
            "header length 100000001 exceeds the format's limit of 100000000",
        ),
        (encode(b'{"t": NaN}'), "header is not valid JSON: NaN is not JSON"),
    ]
    for blob, message in cases:
        assert _header_error(tmp_path, blob) == message
    at_limit = encode({}, length=100_000_000)  # within the limit, but past the end of the file
    assert _header_error(tmp_path, at_limit) == (
        "header length 100000000 runs past the end of the 10-byte file"
    )


def test_minus_zero_and_deep_nesting_and_counts_exact(tmp_path):
    """ "-0" is no unsigned integer (as in the reference parser); nesting past Python's limit is
    refused by name; the trailing-bytes message counts the data section."""
    minus_zero = encode(b'{"t": {"dtype": "F32", "shape": [-0], "data_offsets": [0, 0]}}')
    assert _header_error(tmp_path, minus_zero) == (
        "tensor 't': shape must be a list of integers in [0, 2**63), got [-0.0]"
    )
    deep = encode(b"[" * 100_000 + b"]" * 100_000)
    assert _header_error(tmp_path, deep) == "header nests too deeply"
    assert _header_error(tmp_path, encode({"t": F32x2}, bytes(9))) == (
        "tensors cover 8 bytes but the data after the header is 9 bytes"
    )
    path = tmp_path / "f4.safetensors"
    path.write_bytes(encode({"t": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}}, b"a"))
    with pytest.raises(CheckpointError) as err:
        weights.read_tensor(weights.read_header(path)["t"])
    assert str(err.value) == (
        f"{path}: tensor 't': cannot read dtype 'F4' as numpy: it packs 4-bit values, which "
        "numpy cannot lay out"
    )
