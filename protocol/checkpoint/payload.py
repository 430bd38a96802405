"""The raw payload: a deterministic safetensors file of the full model state, produced without copies.

The payload is laid out by us rather than by `safetensors.save_file`, so that
  * it is deterministic: tensors sorted by name, header JSON with sorted keys, padded to 8 bytes, so the
    same state always gives the same bytes (a requirement for xor-delta: same layout, same offsets);
  * it streams: `PayloadLayout.read_into(offset, buf)` fills any byte range straight from the tensors'
    memory or from source files (os.preadv), so packing never materializes the whole payload;
  * tied weights survive: tensors sharing one storage (e.g. lm_head.weight = embed_tokens.weight) are
    written once and recorded in `__metadata__["prime_node.aliases"]` (JSON {alias: target});
    `load_payload` re-ties them. Standard safetensors readers simply see the target name.
Only safetensors is ever read (no pickle). torch is imported only by the functions that take tensors.
"""
from __future__ import annotations

import bisect
import functools
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Union

from .errors import CheckpointError

if TYPE_CHECKING:  # pragma: no cover
    import torch

ALIASES_KEY = "prime_node.aliases"
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors library's own limit
MAX_METADATA_VALUE = 1024 * 1024

# safetensors dtype code -> (bytes per element, torch dtype name)
DTYPES: dict[str, tuple[int, str]] = {
    "BOOL": (1, "bool"), "U8": (1, "uint8"), "I8": (1, "int8"),
    "F8_E5M2": (1, "float8_e5m2"), "F8_E4M3": (1, "float8_e4m3fn"),
    "I16": (2, "int16"), "U16": (2, "uint16"), "F16": (2, "float16"), "BF16": (2, "bfloat16"),
    "I32": (4, "int32"), "U32": (4, "uint32"), "F32": (4, "float32"),
    "I64": (8, "int64"), "U64": (8, "uint64"), "F64": (8, "float64"),
}
_TORCH_TO_CODE = {name: code for code, (_, name) in DTYPES.items()}

PayloadSource = Union[bytes, bytearray, memoryview, str, os.PathLike[str]]


@dataclass(frozen=True)
class TensorInfo:
    dtype: str  # safetensors code, e.g. "BF16"
    shape: tuple[int, ...]
    begin: int  # offsets relative to the data section (as in the safetensors header)
    end: int


@dataclass(frozen=True)
class SafetensorsHeader:
    header_size: int  # 8 + JSON length: where the data section starts in the file
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]

    @property
    def aliases(self) -> dict[str, str]:
        raw = self.metadata.get(ALIASES_KEY)
        if raw is None:
            return {}
        try:
            aliases = json.loads(raw)
        except ValueError:
            raise CheckpointError("bad_payload", f"metadata {ALIASES_KEY} is not JSON") from None
        if not isinstance(aliases, dict) or not all(
                isinstance(k, str) and isinstance(v, str) and v in self.tensors and k not in self.tensors
                for k, v in aliases.items()):
            raise CheckpointError("bad_payload", f"metadata {ALIASES_KEY} must map new names to stored tensors")
        return aliases


def parse_header(prefix: bytes, file_size: int, *, what: str = "payload") -> SafetensorsHeader:
    """Validate a safetensors header given the file's first bytes (at least the whole header).

    Checks what a hostile file could get wrong: header length, JSON shape, known dtypes, sizes matching
    shapes, offsets inside the file, no overlaps, and a data section covered exactly.
    """
    if file_size < 8 or len(prefix) < 8:
        raise CheckpointError("bad_payload", f"{what} is too short to be safetensors")
    n = int.from_bytes(prefix[:8], "little")
    if n > MAX_HEADER_BYTES or 8 + n > file_size:
        raise CheckpointError("bad_payload", f"{what}: safetensors header length {n} is impossible")
    if len(prefix) < 8 + n:
        raise CheckpointError("bad_payload", f"{what}: header truncated")
    try:
        doc = json.loads(bytes(prefix[8:8 + n]))
    except (ValueError, UnicodeDecodeError):
        raise CheckpointError("bad_payload", f"{what}: safetensors header is not JSON") from None
    if not isinstance(doc, dict):
        raise CheckpointError("bad_payload", f"{what}: safetensors header is not an object")
    metadata = doc.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and len(v) <= MAX_METADATA_VALUE for k, v in metadata.items()):
        raise CheckpointError("bad_payload", f"{what}: __metadata__ must map strings to strings")
    data_size = file_size - 8 - n
    tensors: dict[str, TensorInfo] = {}
    for name, info in doc.items():
        try:
            dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise CheckpointError("bad_payload", f"{what}: tensor {name!r} has a malformed entry") from None
        if dtype not in DTYPES:
            raise CheckpointError("bad_payload", f"{what}: tensor {name!r} has unsupported dtype {dtype!r}")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise CheckpointError("bad_payload", f"{what}: tensor {name!r} has a bad shape")
        if not (type(begin) is int and type(end) is int and 0 <= begin <= end <= data_size):
            raise CheckpointError("bad_payload", f"{what}: tensor {name!r} lies outside the file")
        if end - begin != math.prod(shape) * DTYPES[dtype][0]:
            raise CheckpointError("bad_payload", f"{what}: tensor {name!r} size does not match its shape")
        tensors[name] = TensorInfo(dtype, tuple(shape), begin, end)
    pos = 0
    for name, t in sorted(tensors.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
        if t.begin != pos:
            raise CheckpointError("bad_payload", f"{what}: tensor {name!r} overlaps or leaves a gap")
        pos = t.end
    if pos != data_size:
        raise CheckpointError("bad_payload", f"{what}: data section has {data_size - pos} unaccounted bytes")
    return SafetensorsHeader(8 + n, tensors, metadata)


def read_header_file(path: str | os.PathLike[str]) -> SafetensorsHeader:
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else 0
        rest = f.read(min(n, MAX_HEADER_BYTES, max(size - 8, 0)))
    return parse_header(head + rest, size, what=str(path))


def encode_header(entries: list[tuple[str, str, tuple[int, ...], int]], metadata: Mapping[str, str]) -> bytes:
    """Header bytes for tensors `(name, dtype_code, shape, nbytes)` laid out in the given order."""
    doc: dict[str, Any] = {}
    if metadata:
        doc["__metadata__"] = dict(metadata)
    pos = 0
    for name, dtype, shape, nbytes in entries:
        doc[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
        pos += nbytes
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
    text += b" " * (-(8 + len(text)) % 8)  # data section 8-byte aligned, as safetensors itself does
    return len(text).to_bytes(8, "little") + text


# --- layouts: where each byte of the payload comes from --------------------------------------------
@dataclass
class _Segment:
    offset: int  # in the payload
    length: int
    fill: Callable[[int, memoryview], None]  # (offset within segment, destination) -> fills destination


@dataclass
class PayloadLayout:
    """A payload described as segments; nothing is copied until `read_into` is asked for a range."""

    header: bytes
    segments: list[_Segment]
    total_size: int
    dtype: str  # torch name of the dtype holding most bytes ("bfloat16", ...)
    _starts: list[int] = field(default_factory=list)
    _closers: list[Callable[[], None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._starts = [s.offset for s in self.segments]

    def read_into(self, offset: int, dest: memoryview) -> None:
        """Fill `dest` with payload bytes [offset, offset + len(dest))."""
        end = offset + len(dest)
        if offset < 0 or end > self.total_size:
            raise ValueError("range outside the payload")
        i = max(bisect.bisect_right(self._starts, offset) - 1, 0)
        pos = offset
        while pos < end:
            seg = self.segments[i]
            take = min(end, seg.offset + seg.length) - pos
            if take > 0:
                seg.fill(pos - seg.offset, dest[pos - offset:pos - offset + take])
                pos += take
            i += 1

    def to_bytes(self) -> bytes:
        buf = bytearray(self.total_size)
        self.read_into(0, memoryview(buf))
        return bytes(buf)

    def close(self) -> None:
        for close in self._closers:
            close()
        self._closers.clear()

    def __enter__(self) -> "PayloadLayout":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _memory_fill(src: memoryview) -> Callable[[int, memoryview], None]:
    def fill(at: int, dest: memoryview) -> None:
        dest[:] = src[at:at + len(dest)]
    return fill


def _file_fill(fd: int, file_offset: int) -> Callable[[int, memoryview], None]:
    def fill(at: int, dest: memoryview) -> None:
        done = 0
        while done < len(dest):
            n = os.preadv(fd, [dest[done:]], file_offset + at + done)
            if n <= 0:
                raise CheckpointError("io_error", "source file shrank while packing")
            done += n
    return fill


def _build(header: bytes, parts: list[tuple[int, Callable[[int, memoryview], None]]],
           bytes_by_dtype: dict[str, int]) -> PayloadLayout:
    segments = [_Segment(0, len(header), _memory_fill(memoryview(header)))]
    pos = len(header)
    for nbytes, fill in parts:
        if nbytes:
            segments.append(_Segment(pos, nbytes, fill))
            pos += nbytes
    main = max(bytes_by_dtype.items(), key=lambda kv: kv[1])[0] if bytes_by_dtype else "uint8"
    return PayloadLayout(header, segments, pos, DTYPES[main][1])


def layout_from_state(state: Mapping[str, "torch.Tensor"]) -> PayloadLayout:
    """Layout of a state dict (CPU or not; made contiguous per tensor). Tied tensors become aliases."""
    import torch

    entries, parts, aliases = [], [], {}
    by_dtype: dict[str, int] = {}
    seen: dict[tuple[Any, ...], str] = {}
    for name in sorted(state):
        t = state[name]
        if not isinstance(t, torch.Tensor):
            raise CheckpointError("bad_payload", f"state entry {name!r} is not a tensor")
        t = t.detach()
        code = _TORCH_TO_CODE.get(str(t.dtype).removeprefix("torch."))
        if code is None:
            raise CheckpointError("bad_payload", f"tensor {name!r} has unsupported dtype {t.dtype}")
        if t.numel() and t.device.type != "meta":
            # Same storage, offset, shape and strides: one tensor under two names (tied weights).
            key = (t.device.type, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
                   t.stride(), t.dtype)
            if key in seen:
                aliases[name] = seen[key]
                continue
            seen[key] = name
        flat = t.cpu().contiguous().reshape(-1).view(torch.uint8)
        view = flat.numpy().data if flat.numel() else memoryview(b"")
        entries.append((name, code, tuple(t.shape), len(view)))
        parts.append((len(view), _memory_fill(view)))
        by_dtype[code] = by_dtype.get(code, 0) + len(view)
    metadata = {"format": "pt"}
    if aliases:
        metadata[ALIASES_KEY] = json.dumps(aliases, sort_keys=True, separators=(",", ":"))
    return _build(encode_header(entries, metadata), parts, by_dtype)


def model_files(source: str | os.PathLike[str]) -> list[Path]:
    """The safetensors files of a model: the file itself, or every *.safetensors in a model directory."""
    path = Path(source)
    if path.is_file():
        if path.suffix != ".safetensors":
            raise CheckpointError("bad_payload", f"{path} is not a .safetensors file (only safetensors is read)")
        return [path]
    if not path.is_dir():
        raise CheckpointError("bad_payload", f"{path} does not exist")
    files = sorted(p for p in path.glob("*.safetensors") if p.is_file())
    if not files:
        extra = " (pickle .bin weights are not read; convert to safetensors)" if any(path.glob("*.bin")) else ""
        raise CheckpointError("bad_payload", f"no .safetensors weights in {path}{extra}")
    return files


def layout_from_files(source: str | os.PathLike[str]) -> PayloadLayout:
    """Layout of a .safetensors file or a (possibly sharded) HF model directory, read with os.preadv."""
    entries, parts = [], []
    metadata: dict[str, str] = {}
    by_dtype: dict[str, int] = {}
    found: dict[str, tuple[TensorInfo, int, int]] = {}
    fds: list[int] = []
    try:
        for path in model_files(source):
            header = read_header_file(path)
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            fds.append(fd)
            for key, value in header.metadata.items():
                metadata.setdefault(key, value)
            for name, info in header.tensors.items():
                if name in found:
                    raise CheckpointError("bad_payload", f"tensor {name!r} appears in two weight files")
                found[name] = (info, fd, header.header_size)
        for name in sorted(found):
            info, fd, data_start = found[name]
            nbytes = info.end - info.begin
            entries.append((name, info.dtype, info.shape, nbytes))
            parts.append((nbytes, _file_fill(fd, data_start + info.begin)))
            by_dtype[info.dtype] = by_dtype.get(info.dtype, 0) + nbytes
        metadata.setdefault("format", "pt")
        layout = _build(encode_header(entries, metadata), parts, by_dtype)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    layout._closers.extend(functools.partial(os.close, fd) for fd in fds)
    return layout


def open_layout(source: Any) -> PayloadLayout:
    """A layout from a state dict, a .safetensors file, or a model directory."""
    if isinstance(source, (str, os.PathLike)):
        return layout_from_files(source)
    if isinstance(source, Mapping):
        return layout_from_state(source)
    raise CheckpointError("bad_payload", f"cannot pack a {type(source).__name__}; give a state dict or a path")


def serialize_state(state: Mapping[str, "torch.Tensor"]) -> bytes:
    """Deterministic safetensors bytes of `state` (sorted names, tied tensors stored once)."""
    return layout_from_state(state).to_bytes()


def load_payload(payload: PayloadSource) -> dict[str, "torch.Tensor"]:
    """Tensors of a payload (bytes or a .safetensors path), with tied names re-tied. Safetensors only."""
    from safetensors.torch import load, load_file

    if isinstance(payload, (bytes, bytearray, memoryview)):
        data = bytes(payload)
        header = parse_header(data, len(data))
        tensors = load(data)
    else:
        header = read_header_file(payload)
        tensors = load_file(os.fspath(payload))
    for alias, target in header.aliases.items():
        tensors[alias] = tensors[target]
    return tensors
