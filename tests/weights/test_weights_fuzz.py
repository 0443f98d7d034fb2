"""Fuzzing: mutated safetensors headers and shard indexes either load exactly as the
`safetensors` library reads them or raise CheckpointError -- never another exception, a hang,
or a read outside the file.

The header test asserts it ran at least FUZZ_EXAMPLES cases and the folder test
FUZZ_EXAMPLES // 2 (2,000 headers + 1,000 folders by default; `WEIGHTS_FUZZ_EXAMPLES=N`, or
`HYPOTHESIS_PROFILE=long` for 20,000 + 10,000, for a longer run).
"""

import contextlib
import json
import math
import os
import re
import signal
import tempfile
from pathlib import Path

import numpy as np
import safetensors
from hypothesis import given, settings
from hypothesis import strategies as st

import weights
from weights import CheckpointError

FUZZ_EXAMPLES = int(
    os.environ.get(
        "WEIGHTS_FUZZ_EXAMPLES",
        20_000 if os.environ.get("HYPOTHESIS_PROFILE") == "long" else 2_000,
    )
)
CASE_SECONDS = 5  # one case reads a few hundred bytes; anything near this is a hang
# Stricter than the reference library, on purpose (docs/weights.md): duplicate JSON keys
# (it silently keeps one), more than 64 dimensions, a dimension >= 2**63, or zero-size shapes
# whose other dimensions times the element size reach 2**63 (numpy cannot hold them).
STRICTER = re.compile(
    r"duplicate key|at most 64 are supported|integers in \[0, 2\*\*63\)|too large for numpy"
)

CODES = sorted(weights.DTYPES)
FUZZ_SETTINGS = settings(max_examples=FUZZ_EXAMPLES)


@contextlib.contextmanager
def time_limit(seconds: float):
    def expire(signum, frame):
        raise TimeoutError(f"case still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# ------------------------------------------------------------------ valid files

tensor_names = st.sampled_from(
    ["w", "model.a.weight", "b.0.bias", "ünï.čödé", "x y", ""]
) | st.text(max_size=6)
weird_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**65), 2**65)
    | st.floats(allow_nan=False)
    | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3)
    ),
    max_leaves=6,
)


@st.composite
def valid_layout(draw):
    """(header pairs in random order, data bytes): offsets tile the data in a random order."""
    entries = []
    for name in draw(st.lists(tensor_names, max_size=5, unique=True)):
        if name == "__metadata__":
            continue
        code = draw(st.sampled_from(CODES))
        shape = list(draw(st.lists(st.integers(0, 4), max_size=3)))
        if weights.DTYPES[code][0] < 8:  # F4 / F6: whole bytes need 4 elements at a time
            shape = [*shape, 4]
        nbytes = math.prod(shape) * weights.DTYPES[code][0] // 8
        data = draw(st.binary(min_size=nbytes, max_size=nbytes))
        if code == "BOOL":
            data = bytes(b & 1 for b in data)
        entries.append((name, code, shape, data))
    order = draw(st.permutations(range(len(entries))))
    header, blob = [], b""
    for i in order:
        name, code, shape, data = entries[i]
        header.append(
            [
                name,
                {"dtype": code, "shape": shape, "data_offsets": [len(blob), len(blob) + len(data)]},
            ]
        )
        blob += data
    header = draw(st.permutations(header))
    meta = draw(st.none() | st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=2))
    if meta is not None:
        header.insert(draw(st.integers(0, len(header))), ["__metadata__", meta])
    return [list(p) for p in header], blob


def is_pairs(header) -> bool:
    return isinstance(header, list) and all(
        isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) for p in header
    )


def encode_header(header) -> bytes:
    """Pairs -> JSON object text keeping duplicates; anything else -> its JSON."""
    if is_pairs(header):
        body = ",".join(f"{json.dumps(k)}:{json.dumps(v)}" for k, v in header)
        return ("{" + body + "}").encode("utf-8", "surrogatepass")
    return json.dumps(header).encode()


def encode_file(header_bytes: bytes, data: bytes, pad: int) -> bytes:
    raw = header_bytes + b" " * pad
    return len(raw).to_bytes(8, "little") + raw + data


# -------------------------------------------------------------- header mutations


def _pick(draw, header) -> list | None:
    tensors = [p for p in header if p[0] != "__metadata__" and isinstance(p[1], dict)]
    return draw(st.sampled_from(tensors)) if tensors else None


def _near(value) -> st.SearchStrategy:
    base = value if isinstance(value, int) else 0
    return (
        st.integers(-9, 9).map(lambda d: base + d)
        | st.sampled_from([0, -1, 2**32, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 10**30])
        | weird_json
    )


def mutate_header(draw, header: list) -> list:
    kind = draw(
        st.sampled_from(
            [
                "dtype",
                "dim",
                "ndim",
                "shape",
                "offset",
                "offsets",
                "swap",
                "drop_key",
                "extra_key",
                "entry",
                "remove",
                "add",
                "duplicate",
                "metadata",
                "top",
                "rename",
            ]
        )
    )
    if not is_pairs(header):
        return header
    entry = _pick(draw, header)
    if kind == "top":
        return draw(weird_json)
    if kind == "metadata":
        header.append(["__metadata__", draw(weird_json)])
        return header
    if kind == "add" or entry is None:
        begin = draw(st.integers(0, 40))
        header.append(
            [
                draw(tensor_names),
                {
                    "dtype": draw(st.sampled_from(CODES)),
                    "shape": draw(st.lists(st.integers(0, 3), max_size=2)),
                    "data_offsets": [begin, begin + draw(st.integers(0, 16))],
                },
            ]
        )
        return header
    info = entry[1]
    if kind == "dtype":
        info["dtype"] = draw(
            st.sampled_from(CODES) | st.sampled_from(["f32", "F8", "BF32"]) | weird_json
        )
    elif kind == "dim" and isinstance(info.get("shape"), list) and info["shape"]:
        i = draw(st.integers(0, len(info["shape"]) - 1))
        info["shape"][i] = draw(_near(info["shape"][i]))
    elif kind == "ndim" and isinstance(info.get("shape"), list):
        extra = draw(st.sampled_from([1, 2, 70]))
        info["shape"] = info["shape"][:-1] if draw(st.booleans()) else info["shape"] + [1] * extra
    elif kind == "shape":
        info["shape"] = draw(weird_json)
    elif kind == "offset" and isinstance(info.get("data_offsets"), list) and info["data_offsets"]:
        i = draw(st.integers(0, len(info["data_offsets"]) - 1))
        info["data_offsets"][i] = draw(_near(info["data_offsets"][i]))
    elif kind == "offsets":
        info["data_offsets"] = draw(st.lists(st.integers(0, 40), max_size=3) | weird_json)
    elif kind == "swap":
        other = _pick(draw, header)
        info["data_offsets"], other[1]["data_offsets"] = (
            other[1].get("data_offsets"),
            info.get("data_offsets"),
        )
    elif kind == "drop_key":
        info.pop(draw(st.sampled_from(["dtype", "shape", "data_offsets"])), None)
    elif kind == "extra_key":
        info[draw(st.text(max_size=4))] = draw(weird_json)
    elif kind == "entry":
        entry[1] = draw(weird_json)
    elif kind == "remove":
        header.remove(entry)
    elif kind == "duplicate":
        header.insert(draw(st.integers(0, len(header))), json.loads(json.dumps(entry)))
    elif kind == "rename":
        entry[0] = draw(
            st.sampled_from([p[0] for p in header]) | st.just("__metadata__") | tensor_names
        )
    return header


HEADER_TEXTS = [
    b"",
    b"[" * 100_000,
    b'{"a":' + b"1" * 5000 + b"}",
    b"\xef\xbb\xbf{}",
    b'{"a":NaN}',
    b'{"\\ud800":{"dtype":"U8","shape":[],"data_offsets":[0,0]}}',
    b'{"a":{"dtype":"U8","shape":[1e0],"data_offsets":[0,1]}}',
    b'{"a":{"dtype":"U8","shape":[true],"data_offsets":[0,1]}}',
    b'{"a":{"dtype":"U8","shape":[-0],"data_offsets":[0,0]}}',
    b"\xc3\x28",
    b"{} trailing",
    b"\t\n{}\r ",
]


def mutate_bytes(draw, blob: bytes) -> bytes:
    n = int.from_bytes(blob[:8], "little")
    kind = draw(
        st.sampled_from(["length", "flip", "truncate", "append", "insert", "delete", "text", "pad"])
    )
    if kind == "length":
        value = draw(
            _near(n).filter(lambda v: isinstance(v, int) and 0 <= v < 2**64)
            | st.sampled_from([max(0, len(blob) - 8), len(blob), 100_000_001])
        )
        return value.to_bytes(8, "little") + blob[8:]
    if kind == "truncate":
        return blob[: draw(st.integers(0, len(blob)))]
    if kind == "append":
        return blob + draw(st.binary(min_size=1, max_size=16))
    if kind == "text":
        text = draw(st.sampled_from(HEADER_TEXTS) | st.binary(max_size=40))
        return encode_file(text, blob[8 + n :] if 8 + n <= len(blob) else b"", 0)
    if kind == "pad":
        return encode_file(
            blob[8 : 8 + n].rstrip(b" ")
            + draw(st.sampled_from([b"\t", b"\n", b"\x00", b"x", b"  "])),
            blob[8 + n :],
            0,
        )
    lo, hi = 8, max(8, min(len(blob), 8 + n))
    at = draw(st.integers(lo, hi))
    if kind == "flip":
        for _ in range(draw(st.integers(1, 4))):
            at = draw(st.integers(0, len(blob) - 1)) if blob else 0
            blob = blob[:at] + bytes([draw(st.integers(0, 255))]) + blob[at + 1 :]
        return blob
    if kind == "insert":
        return blob[:at] + draw(st.binary(min_size=1, max_size=8)) + blob[at:]
    return blob[:at] + blob[at + draw(st.integers(1, 8)) :]


@st.composite
def mutated_files(draw) -> bytes:
    header, data = draw(valid_layout())
    for _ in range(draw(st.integers(0, 3))):
        header = mutate_header(draw, header)
    blob = encode_file(encode_header(header), data, draw(st.integers(0, 7)))
    for _ in range(draw(st.integers(0, 2))):
        blob = mutate_bytes(draw, blob)
    return blob


# ------------------------------------------------------------------ the oracles


def reference_read(blob: bytes) -> dict | None:
    try:
        return dict(safetensors.deserialize(blob))
    except safetensors.SafetensorError:
        return None


def check_file(path: Path, blob: bytes) -> str:
    """Load `path` (holding `blob`); assert it matches the reference library or is refused."""
    theirs = reference_read(blob)
    try:
        with time_limit(CASE_SECONDS):
            infos = weights.read_header(path)
            arrays = {
                n: weights.read_tensor(i)
                for n, i in infos.items()
                if weights.DTYPES[i.dtype][1] is not None
            }
    except CheckpointError as e:
        assert str(path) in str(e), e
        if theirs is not None:
            assert STRICTER.search(str(e)), (
                f"the reference library loads this file, we refused: {e}"
            )
        return "refused"
    assert theirs is not None, "accepted a file the reference library refuses"
    assert set(infos) == set(theirs)
    n = int.from_bytes(blob[:8], "little")
    for name, info in infos.items():
        ref = theirs[name]
        assert (info.dtype, list(info.shape)) == (ref["dtype"], ref["shape"])
        assert 8 + n <= info.offset and info.offset + info.nbytes <= len(blob), "outside the data"
        assert blob[info.offset : info.offset + info.nbytes] == bytes(ref["data"])
        if name in arrays:
            assert arrays[name].reshape(-1).view(np.uint8).tobytes() == bytes(ref["data"])
    return "loaded"


def test_fuzzed_headers_load_exactly_or_raise_checkpoint_error():
    outcomes = {"loaded": 0, "refused": 0}

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "fuzz.safetensors"

        @FUZZ_SETTINGS
        @given(blob=mutated_files())
        def one_case(blob):
            path.write_bytes(blob)
            outcomes[check_file(path, blob)] += 1

        one_case()
    assert sum(outcomes.values()) >= FUZZ_EXAMPLES, outcomes
    assert min(outcomes.values()) > FUZZ_EXAMPLES // 20, outcomes  # both sides exercised


# ------------------------------------------------------------ folders and indexes

BASE = {
    "model.embed.weight": np.arange(12, dtype=np.float32).reshape(3, 4),
    "model.layers.0.q.weight": np.arange(6, dtype=np.int64).reshape(2, 3),
    "model.layers.0.q.input_min": np.array(-1.5, np.float32),
    "model.layers.1.norm.weight": np.arange(5, dtype=np.int16),
    "model.empty": np.zeros((0, 3), np.float64),
}


def shard_blob(names) -> bytes:
    """A valid shard from BASE, encoded here (not by the code under test)."""
    pairs, data = [], b""
    for name in names:
        raw = BASE[name].tobytes()
        code = weights.dtype_code(BASE[name].dtype)
        offsets = [len(data), len(data) + len(raw)]
        pairs.append(
            [name, {"dtype": code, "shape": list(BASE[name].shape), "data_offsets": offsets}]
        )
        data += raw
    return encode_file(encode_header(pairs), data, 0)


BAD_SHARD_NAMES = [
    "../m/model-1.safetensors",
    "/etc/hostname",
    "a/../../x.safetensors",
    "..",
    ".",
    "",
    "./",
    "C:\\x.safetensors",
    "sub\\x.safetensors",
    "missing.safetensors",
    "model-1.safetensors/",
    "config.json",
    "model.safetensors.index.json",
    "blobs",
    "/dev/zero",
]


@st.composite
def folder_plans(draw):
    """{relative path: bytes | ("link", target) | ("fifo",) | ("dir",)}, index pairs, config."""
    n_shards = draw(st.integers(1, 3))
    owner = {name: draw(st.integers(0, n_shards - 1)) for name in sorted(BASE)}
    files, weight_map = {}, []
    for i in range(n_shards):
        names = [n for n in sorted(BASE) if owner[n] == i]
        if names:
            files[f"model-{i + 1}.safetensors"] = shard_blob(names)
            weight_map += [[n, f"model-{i + 1}.safetensors"] for n in names]
    if draw(st.booleans()):  # the HF cache layout: every shard a link into ../../blobs
        for rel in list(files):
            files[f"../../blobs/{rel}.blob"] = files[rel]
            files[rel] = ("link", f"../../blobs/{rel}.blob")
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    config = b'{"model_type": "fuzz"}'
    if draw(st.integers(0, 9)) == 0:  # single-file layout
        files = {"model.safetensors": shard_blob(sorted(BASE))}
        index = None
    return files, index, config


def mutate_folder(draw, files: dict, index, config: bytes):
    kind = draw(
        st.sampled_from(
            [
                "name",
                "drop",
                "add",
                "duplicate",
                "weight_map",
                "index",
                "no_index",
                "delete",
                "dir",
                "fifo",
                "dangling",
                "device",
                "swap",
                "dup_tensor",
                "corrupt",
                "config",
                "subfolder",
                "both",
            ]
        )
    )
    shards = sorted(k for k in files if not k.startswith("../"))
    wm = (
        index["weight_map"]
        if isinstance(index, dict) and is_pairs(index.get("weight_map"))
        else None
    )
    shard = draw(st.sampled_from(shards)) if shards else None
    if kind == "name" and wm:
        draw(st.sampled_from(wm))[1] = draw(st.sampled_from(BAD_SHARD_NAMES + shards) | weird_json)
    elif kind == "drop" and wm:
        wm.remove(draw(st.sampled_from(wm)))
    elif kind == "add" and wm:
        wm.append(
            [
                draw(st.sampled_from(sorted(BASE)) | tensor_names),
                draw(st.sampled_from(shards + ["x"])),
            ]
        )
    elif kind == "duplicate" and wm:
        pair = draw(st.sampled_from(wm))
        wm.append([pair[0], draw(st.sampled_from(shards + [pair[1]]))])
    elif kind == "weight_map" and isinstance(index, dict):
        index["weight_map"] = draw(weird_json)
    elif kind == "index":
        index = draw(weird_json | st.binary(max_size=20))
    elif kind == "no_index":
        index = None
    elif kind == "delete" and shard:
        del files[shard]
    elif kind in ("dir", "fifo") and shard:
        files[shard] = (kind,)
    elif kind == "dangling" and shard:
        files[shard] = ("link", "../nowhere.safetensors")
    elif kind == "device" and shard:
        files[shard] = ("link", "/dev/zero")
    elif kind == "swap" and len(shards) > 1:
        a, b = draw(st.permutations(shards))[:2]
        files[a], files[b] = files[b], files[a]
    elif kind == "dup_tensor" and shard and isinstance(files[shard], bytes):
        files[shard] = shard_blob(sorted(BASE))
    elif kind == "corrupt" and shard:
        target = (
            files[shard][1][6:]
            if isinstance(files[shard], tuple) and files[shard][0] == "link"
            else shard
        )
        if isinstance(files.get(target), bytes):
            files[target] = mutate_bytes(draw, files[target])
    elif kind == "config":
        config = draw(st.sampled_from([b"", b"[1]", b"{", b'{"a": 1, "a": 2}', b"\xff", None]))
    elif kind == "subfolder" and shard and wm:
        files["sub/" + shard] = files.pop(shard)
        for pair in wm:
            if pair[1] == shard:
                pair[1] = "sub/" + shard
    elif kind == "both":
        files["model.safetensors"] = shard_blob(sorted(BASE)[:2])
    return files, index, config


def materialize(root: Path, files: dict, index, config) -> Path:
    folder = root / "snapshots" / "rev"
    folder.mkdir(parents=True)
    for rel, content in files.items():
        path = Path(os.path.normpath(folder / rel))
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        elif content[0] == "link":
            path.symlink_to(content[1])
        elif content[0] == "fifo":
            os.mkfifo(path)
        else:
            path.mkdir()
    if index is not None:
        raw = index if isinstance(index, bytes) else json.dumps(index).encode()
        if isinstance(index, dict) and is_pairs(index.get("weight_map")):
            raw = b'{"weight_map": ' + encode_header(index["weight_map"]) + b"}"
        (folder / "model.safetensors.index.json").write_bytes(raw)
    if config is not None:
        (folder / "config.json").write_bytes(config)
    return folder


def check_folder(folder: Path) -> str:
    """Open `folder`: the files as the reference library reads them, or CheckpointError."""
    try:
        with time_limit(CASE_SECONDS):
            ckpt = weights.open_checkpoint(folder)
            arrays = {n: ckpt.read(n) for n in ckpt.tensors}
    except CheckpointError as e:
        assert str(folder) in str(e), e
        return "refused"
    assert ckpt.config == json.loads((folder / "config.json").read_text())
    single = folder / "model.safetensors"
    if os.path.lexists(single):
        expected = dict.fromkeys(reference_read(single.read_bytes()), single)
    else:
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        expected = {n: Path(os.path.normpath(folder / f)) for n, f in index["weight_map"].items()}
    assert set(ckpt.tensors) == set(expected)
    blobs = {}
    for name, info in ckpt.tensors.items():
        assert info.file == expected[name]
        assert os.path.commonpath([folder, info.file]) == str(folder), "shard outside the folder"
        blob = blobs.setdefault(info.file, info.file.read_bytes())
        ref = reference_read(blob)
        assert ref is not None, f"accepted {info.file}, which the reference library refuses"
        assert (info.dtype, list(info.shape)) == (ref[name]["dtype"], ref[name]["shape"])
        assert info.offset + info.nbytes <= len(blob), "outside the file"
        assert arrays[name].reshape(-1).view(np.uint8).tobytes() == bytes(ref[name]["data"])
    assert sum(len(reference_read(b)) for b in blobs.values()) == len(ckpt.tensors)
    return "loaded"


def test_fuzzed_folders_load_exactly_or_raise_checkpoint_error():
    outcomes = {"loaded": 0, "refused": 0}

    @settings(max_examples=FUZZ_EXAMPLES // 2)
    @given(plan=folder_plans(), data=st.data())
    def one_case(plan, data):
        files, index, config = plan
        for _ in range(data.draw(st.integers(0, 2))):
            files, index, config = mutate_folder(data.draw, files, index, config)
        with tempfile.TemporaryDirectory() as tmp:
            outcomes[check_folder(materialize(Path(tmp), files, index, config))] += 1

    one_case()
    assert sum(outcomes.values()) >= FUZZ_EXAMPLES // 2, outcomes
    assert min(outcomes.values()) > FUZZ_EXAMPLES // 40, outcomes
