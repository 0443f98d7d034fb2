"""Safetensors files read header-first: validated index, byte offsets, lazy per-tensor reads.

A safetensors file is an 8-byte little-endian header length N, N bytes of UTF-8 JSON
(`{"__metadata__": {str: str}, name: {"dtype", "shape", "data_offsets": [begin, end]}}`),
then the data section, which the tensors must tile exactly: sorted by offset, each begins
where the previous ends and the last ends at the end of the file. The header is
untrusted input, so every field is checked before any offset is used.
"""

import errno
import json
import math
import mmap
import os
import stat
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import ml_dtypes
import numpy as np

from weights.errors import CheckpointError

# The reference implementation refuses headers above this size; so do we.
MAX_HEADER_BYTES = 100_000_000
# numpy arrays have at most this many axes.
MAX_NDIM = 64
MAX_DIM = 2**63 - 1

# dtype code -> (bits per element, numpy dtype or None for sub-byte codes numpy cannot lay out).
DTYPES: dict[str, tuple[int, np.dtype | None]] = {
    "BOOL": (8, np.dtype(np.bool_)),
    "F4": (4, None),
    "F6_E2M3": (6, None),
    "F6_E3M2": (6, None),
    "U8": (8, np.dtype("u1")),
    "I8": (8, np.dtype("i1")),
    "F8_E5M2": (8, np.dtype(ml_dtypes.float8_e5m2)),
    "F8_E4M3": (8, np.dtype(ml_dtypes.float8_e4m3fn)),
    "F8_E8M0": (8, np.dtype(ml_dtypes.float8_e8m0fnu)),
    "F8_E4M3FNUZ": (8, np.dtype(ml_dtypes.float8_e4m3fnuz)),
    "F8_E5M2FNUZ": (8, np.dtype(ml_dtypes.float8_e5m2fnuz)),
    "I16": (16, np.dtype("<i2")),
    "U16": (16, np.dtype("<u2")),
    "F16": (16, np.dtype("<f2")),
    "BF16": (16, np.dtype(ml_dtypes.bfloat16)),
    "I32": (32, np.dtype("<i4")),
    "U32": (32, np.dtype("<u4")),
    "F32": (32, np.dtype("<f4")),
    "C64": (64, np.dtype("<c8")),
    "F64": (64, np.dtype("<f8")),
    "I64": (64, np.dtype("<i8")),
    "U64": (64, np.dtype("<u8")),
}
_CODES = {dt: code for code, (_, dt) in DTYPES.items() if dt is not None}


def _why_not(code: str) -> str:
    if code not in DTYPES:
        return f"unknown safetensors dtype; expected one of {list(DTYPES)}"
    return f"it packs {DTYPES[code][0]}-bit values, which numpy cannot lay out"


def numpy_dtype(code: str) -> np.dtype:
    """The numpy dtype of a safetensors dtype code ("BF16" -> ml_dtypes.bfloat16).

    Sub-byte codes (F4, F6_*) raise: their bytes are still indexed (offset, nbytes).
    """
    dt = DTYPES.get(code, (0, None))[1]
    if dt is None:
        raise CheckpointError(f"dtype {code!r}: {_why_not(code)}")
    return dt


def dtype_code(dtype: np.dtype) -> str:
    """The safetensors dtype code of a numpy dtype (either byte order)."""
    dt = np.dtype(dtype)
    if dt.byteorder == ">":
        dt = dt.newbyteorder("<")
    if dt not in _CODES:
        raise TypeError(f"numpy dtype {dtype} has no safetensors code; supported: {list(_CODES)}")
    return _CODES[dt]


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes lie: `offset` is absolute in `file` (8 + N + data_offsets[0])."""

    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def np_dtype(self) -> np.dtype:
        return numpy_dtype(self.dtype)


def _fail(path, message: str, tensor: str | None = None) -> NoReturn:
    where = f"{path}" if tensor is None else f"{path}: tensor {tensor!r}"
    raise CheckpointError(f"{where}: {message}")


def open_regular(path: Path):
    """Open `path` for binary reading, refusing anything but a regular file.

    O_NONBLOCK keeps a FIFO from blocking the open; regular files ignore it.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        kind = "a broken symbolic link" if os.path.islink(path) else "missing"
        _fail(path, f"file is {kind}")
    except OSError as e:
        _fail(path, f"cannot open: {e.strerror}")
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        _fail(path, "not a regular file")
    return os.fdopen(fd, "rb")


def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _unique_keys(pairs: list) -> dict:
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _parse_int(text: str):
    # "-0" is no unsigned integer to the reference parser; a float fails every size check.
    return -0.0 if text == "-0" else int(text)


def parse_json(path, raw: bytes, what: str, *, strict: bool = True):
    """JSON from UTF-8 bytes, errors as CheckpointError.

    `strict`: no NaN/Infinity, no duplicate keys (which copy wins is ambiguous), as the
    reference parser; otherwise Python's reading, which is how transformers reads config.json.
    """
    hooks = (
        {"object_pairs_hook": _unique_keys, "parse_constant": _reject_constant} if strict else {}
    )
    try:
        return json.loads(raw.decode("utf-8"), parse_int=_parse_int, **hooks)
    except UnicodeDecodeError as e:
        _fail(path, f"{what} is not UTF-8 ({e.reason} at byte {e.start})")
    except RecursionError:
        _fail(path, f"{what} nests too deeply")
    except ValueError as e:
        _fail(path, f"{what} is not valid JSON: {e}")


def _is_uint(x, limit: int) -> bool:
    return type(x) is int and 0 <= x <= limit


def _valid_text(s) -> bool:
    """A str that UTF-8 can encode (JSON escapes can smuggle in lone surrogates)."""
    if not isinstance(s, str):
        return False
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _byte_length(path, name: str, code: str, shape: tuple[int, ...], stored: int) -> int:
    """dtype x shape in bytes, checked against the stored length without building huge ints."""
    bits = DTYPES[code][0]
    extent = max(bits // 8, 1)
    for d in shape:
        extent *= max(d, 1)
        if extent > MAX_DIM:
            # numpy refuses this even with a zero dimension; the reference library allows it
            _fail(path, f"{code} shape {list(shape)} is too large for numpy", name)
    nelem = 0 if 0 in shape else 1
    for d in shape:
        nelem *= d
        if nelem * bits > 8 * stored:
            _fail(
                path,
                f"{code} shape {list(shape)} needs more than the {stored} bytes data_offsets span",
                name,
            )
    if nelem * bits % 8:
        _fail(path, f"{code} shape {list(shape)} is not a whole number of bytes", name)
    if nelem * bits != 8 * stored:
        _fail(
            path,
            f"data_offsets span {stored} bytes; {code} {list(shape)} needs {nelem * bits // 8}",
            name,
        )
    return stored


def _entry(path, name, entry) -> tuple[str, tuple[int, ...], int, int]:
    """Validate one header entry -> (dtype, shape, begin, end)."""
    if not _valid_text(name):
        _fail(path, "tensor name is not valid Unicode text", repr(name))
    if not isinstance(entry, dict):
        _fail(path, f"entry must be an object, got {type(entry).__name__}", name)
    for key in ("dtype", "shape", "data_offsets"):
        if key not in entry:
            _fail(path, f"entry has no {key!r}", name)
    code, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(code, str) or code not in DTYPES:
        _fail(path, f"unknown dtype {code!r}; expected one of {list(DTYPES)}", name)
    if not isinstance(shape, list) or not all(_is_uint(d, MAX_DIM) for d in shape):
        _fail(path, f"shape must be a list of integers in [0, 2**63), got {shape!r:.200}", name)
    if len(shape) > MAX_NDIM:
        _fail(path, f"shape has {len(shape)} dimensions; at most {MAX_NDIM} are supported", name)
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_uint(o, 2**64 - 1) for o in offsets)
    ):
        _fail(path, f"data_offsets must be [begin, end] byte offsets, got {offsets!r:.200}", name)
    begin, end = offsets
    if end < begin:
        _fail(path, f"data_offsets [{begin}, {end}] end before they begin", name)
    return code, tuple(shape), begin, end


def _open_header(path: Path) -> tuple[dict, int, int]:
    """-> (parsed header, header length N, file size) after the length and JSON checks."""
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        if size < 8:
            _fail(path, f"file is {size} bytes, too short for the 8-byte header length")
        n = int.from_bytes(f.read(8), "little")
        if n > MAX_HEADER_BYTES:
            _fail(path, f"header length {n} exceeds the format's limit of {MAX_HEADER_BYTES}")
        if 8 + n > size:
            _fail(path, f"header length {n} runs past the end of the {size}-byte file")
        raw = f.read(n)
    if len(raw) != n:
        _fail(path, "file shrank while its header was read")
    header = parse_json(path, raw, "header")
    if not isinstance(header, dict):
        _fail(path, f"header must be a JSON object, got {type(header).__name__}")
    return header, n, size


def read_header(path) -> dict[str, TensorInfo]:
    """Index one safetensors file from its header alone, ordered by offset.

    `path` is made absolute but symbolic links are kept, so `TensorInfo.file` stays
    inside the folder it was found in. Raises CheckpointError naming the file and tensor.
    """
    return _read_file_header(path)[0]


def read_metadata(path) -> dict[str, str]:
    """The header's `__metadata__` (str -> str; empty if absent), validated like `read_header`."""
    return _read_file_header(path)[1]


def _read_file_header(path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    path = Path(os.path.abspath(path))
    header, n, size = _open_header(path)
    meta = header.pop("__metadata__", None)
    if meta is not None and not (
        isinstance(meta, dict) and all(_valid_text(k) and _valid_text(v) for k, v in meta.items())
    ):
        _fail(path, f"__metadata__ must map strings to strings, got {meta!r:.200}")
    entries = sorted(
        ((_entry(path, name, e), name) for name, e in header.items()),
        key=lambda t: (t[0][2], t[0][3], t[1]),
    )
    infos, covered, previous = {}, 0, None
    for (code, shape, begin, end), name in entries:
        if begin < covered:
            _fail(path, f"data_offsets [{begin}, {end}] overlap tensor {previous!r}", name)
        if begin > covered:
            _fail(
                path, f"gap of {begin - covered} bytes before data_offsets [{begin}, {end}]", name
            )
        _byte_length(path, name, code, shape, end - begin)
        infos[name] = TensorInfo(name, path, code, shape, 8 + n + begin, end - begin)
        covered, previous = end, name
    if 8 + n + covered != size:
        _fail(
            path,
            f"tensors cover {covered} bytes but the data after the header is {size - 8 - n} bytes",
        )
    return infos, meta or {}


def _readable(info: TensorInfo) -> np.dtype:
    """The numpy dtype of a tensor `info` describes consistently, or CheckpointError."""
    if DTYPES.get(info.dtype, (0, None))[1] is None:
        _fail(
            info.file,
            f"cannot read dtype {info.dtype!r} as numpy: {_why_not(info.dtype)}",
            info.name,
        )
    dt = info.np_dtype
    want = math.prod(info.shape) * dt.itemsize
    if info.nbytes != want or info.offset < 8:
        _fail(
            info.file,
            f"TensorInfo holds {info.nbytes} bytes at {info.offset}, needs {want}",
            info.name,
        )
    return dt


def _shrunk(info: TensorInfo, size: int) -> NoReturn:
    _fail(info.file, f"file is {size} bytes, shorter than when its header was read", info.name)


def _data_spans(fd: int, start: int, end: int) -> list[tuple[int, int]]:
    """The spans of [start, end) of file `fd` that hold data (`SEEK_DATA`/`SEEK_HOLE`); a
    file system that cannot tell has one span, all of it."""
    spans, at = [], start
    try:
        while at < end:
            data = os.lseek(fd, at, os.SEEK_DATA)
            if data >= end:
                break
            at = min(os.lseek(fd, data, os.SEEK_HOLE), end)
            spans.append((data, at))
    except OSError as e:  # ENXIO: no data after `at`; EINVAL: holes not reported
        if e.errno != errno.ENXIO:
            return [(start, end)]
    return spans


def pread_into(f, info: TensorInfo, buffer: np.ndarray, offset: int) -> None:
    """Fill the bytes `buffer` (a uint8 array) from file offset `offset` of the open file `f`
    holding tensor `info`. A hole of a sparse file reads as zeros: it is zeroed here, not
    read, since the kernel's page cache zero-fills a hole at about 0.6 GB/s on this host
    (a 31B layer of a sparse checkpoint took 1.5 s of system time a read)."""
    fd, end, at = f.fileno(), offset + len(buffer), offset
    if end > os.fstat(fd).st_size:  # a hole past the end is no hole: the file shrank
        _shrunk(info, os.fstat(fd).st_size)
    for a, b in _data_spans(fd, offset, end) + [(end, end)]:
        buffer[at - offset : a - offset] = 0
        view, done = memoryview(buffer[a - offset : b - offset]), 0
        while done < b - a:  # Linux reads at most 2 GiB per call
            n = os.preadv(fd, [view[done:]], a + done)
            if n == 0:
                _shrunk(info, os.fstat(fd).st_size)
            done += n
        at = b


def read_tensor(
    info: TensorInfo, *, mapped: bool = True, out: np.ndarray | None = None,
    stage: np.ndarray | None = None,
):  # fmt: skip
    """One tensor, bit-exact: memory-mapped read-only (pages are read when touched), or with
    mapped=False read into a private buffer (no page of the file stays mapped: touched pages
    of a mapping count in the process's resident memory until the mapping goes): `out` when
    given (a C-contiguous array of the tensor's dtype and shape, reused from tensor to
    tensor, so no fresh page is touched), else a new one. stage (a uint8 array of at least
    one element's bytes) with `out`: out may be of another dtype, the tensor's bytes are read
    len(stage) at a time into stage and cast into out (a bfloat16 expert table of 1 GB read
    as float32 through 64 MiB, not through a second buffer of the whole)."""
    dt = _readable(info)
    if stage is not None and (
        out is None or stage.dtype != np.uint8 or stage.ndim != 1 or len(stage) < dt.itemsize
    ):
        raise ValueError(
            f"{info.name}: stage {stage.dtype}{list(stage.shape)} needs `out` and one dimension "
            f"of uint8, at least {dt.itemsize} bytes"
        )
    if out is not None:
        mapped = False
        same = out.dtype == dt or stage is not None
        if not same or out.shape != tuple(info.shape) or not out.flags.c_contiguous:
            raise ValueError(
                f"{info.name}: out is {out.dtype}{list(out.shape)}, needs a C-contiguous "
                f"{dt}{list(info.shape)} (another dtype: with a uint8 stage)"
            )
    if info.nbytes == 0:
        return np.zeros(info.shape, dt) if out is None else out
    with open_regular(info.file) as f:
        st = os.fstat(f.fileno())
        if info.offset + info.nbytes > st.st_size:
            # Mapping past the end would fault (SIGBUS) on first touch.
            _shrunk(info, st.st_size)
        if stage is not None:
            return _staged(f, info, dt, out, stage)
        if not mapped:
            out = np.empty(info.shape, dt) if out is None else out
            pread_into(f, info, out.reshape(-1).view(np.uint8), info.offset)
            return out
        mapping = _map_file(f, st)
    count = math.prod(info.shape)
    return np.frombuffer(mapping, dt, count, info.offset).reshape(info.shape)


def _staged(f, info: TensorInfo, dt: np.dtype, out: np.ndarray, stage: np.ndarray):
    """`read_tensor` into `out` through `stage`: whole elements at a time, each cast."""
    flat, step = out.reshape(-1), len(stage) // dt.itemsize
    for a in range(0, flat.size, step):
        n = min(step, flat.size - a)
        held = stage[: n * dt.itemsize]
        pread_into(f, info, held, info.offset + a * dt.itemsize)
        flat[a : a + n] = held.view(dt)
    return out


# Open mappings by file identity. Each mmap holds a file descriptor, so one per file (kept
# alive by the arrays viewing it) instead of one per tensor keeps a 2,000-tensor tree
# under the descriptor limit.
_MAPPINGS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _map_file(f, st: os.stat_result) -> mmap.mmap:
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    mapping = _MAPPINGS.get(key)
    if mapping is None:
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        _MAPPINGS[key] = mapping
    return mapping
