"""The one binary container of the HTTP API: a safetensors file (https://huggingface.co/docs/safetensors).

Layout (the safetensors format, nothing added)::

    8 bytes      N, little-endian unsigned: the header's length
    N bytes      a JSON object: {name: {"dtype", "shape", "data_offsets": [begin, end]}, ...,
                 "__metadata__": {"flowgrpo": "<a JSON document, as a string>"}}, padded with spaces
    the rest     every tensor's bytes, C order, little-endian, at its offsets from the start of this part

Language-neutral (readers exist for Python, Rust, C++, JavaScript), self-describing (dtype and shape per
tensor, bf16 carried as its own bytes), and never a pickle. Tensors are laid out largest element first,
so that each starts at a multiple of its element size and :func:`unpack` can view it in place.

:func:`pack` copies each tensor once, into the buffer it returns; :func:`unpack` copies nothing: its
tensors are views of the buffer it was given (keep the buffer; it must be writable, a ``bytearray``).
It checks what an untrusted body could get wrong (lengths, offsets, holes, dtypes) and raises
:class:`WireFormatError` naming it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

import torch

# The safetensors names of the dtypes this service sends or takes.
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}

# The key of this service's JSON document in the header's __metadata__ (safetensors metadata is str -> str).
METADATA_KEY = "flowgrpo"
# A header longer than this is refused before it is parsed (safetensors' own readers cap it at 100 MB).
MAX_HEADER_BYTES = 100 * 2**20


class WireFormatError(ValueError):
    """A body that is not a well-formed container; the message says what is wrong."""


def pack(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, Any] | None) -> bytearray:
    """The container holding `tensors` (any device; copied once, to the CPU) and `metadata` (JSON-able; None:
    a plain safetensors file without this service's document).

    Raises:
        WireFormatError: a tensor's dtype has no safetensors name here.
    """
    for name, tensor in tensors.items():
        if tensor.dtype not in DTYPE_NAMES:
            raise WireFormatError(f"tensor {name!r}: dtype {tensor.dtype} is not one of {sorted(DTYPES)}")
    order = sorted(tensors, key=lambda name: (-tensors[name].element_size(), name))
    header: dict[str, Any] = {}
    if metadata is not None:
        header["__metadata__"] = {METADATA_KEY: json.dumps(metadata, separators=(",", ":"), allow_nan=False)}
    offset = 0
    for name in order:
        tensor = tensors[name]
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": DTYPE_NAMES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # so the data starts 8-byte aligned
    buffer = bytearray(8 + len(encoded) + offset)
    buffer[:8] = len(encoded).to_bytes(8, "little")
    start = 8 + len(encoded)
    buffer[8:start] = encoded
    view = memoryview(buffer)
    for name in order:
        begin, end = header[name]["data_offsets"]
        if end > begin:
            source = tensors[name].detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
            torch.frombuffer(view[start + begin:start + end], dtype=torch.uint8).copy_(source)
    return buffer


def unpack(buffer: bytes | bytearray | memoryview) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors by name, the metadata document) of a container; the tensors view `buffer` (a writable one:
    a read-only buffer such as ``bytes`` is copied once first).

    Raises:
        WireFormatError: truncated, a header that is not the format's JSON, an unknown dtype, a shape
            that does not match its byte range, ranges outside the data, overlapping or leaving holes.
    """
    view = memoryview(buffer).cast("B")
    if view.readonly:  # torch views only writable memory: a bytes object costs one copy
        view = memoryview(bytearray(view))
    if len(view) < 8:
        raise WireFormatError(f"the body is {len(view)} bytes; a safetensors file starts with an 8-byte header length")
    length = int.from_bytes(view[:8], "little")
    if length > MAX_HEADER_BYTES or 8 + length > len(view):
        raise WireFormatError(f"the header length {length} exceeds the body ({len(view)} bytes): truncated, or not "
                              "safetensors")
    try:
        header = json.loads(bytes(view[8:8 + length]))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WireFormatError(f"the header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise WireFormatError("the header is not a JSON object")
    metadata = _metadata(header.pop("__metadata__", None))
    data = view[8 + length:]
    tensors: dict[str, torch.Tensor] = {}
    ranges = []
    for name, entry in header.items():
        dtype, shape, begin, end = _entry(name, entry)
        size = math.prod(shape) * _itemsize(dtype)
        if end - begin != size:
            raise WireFormatError(f"tensor {name!r}: shape {shape} of {DTYPE_NAMES[dtype]} is {size} bytes, its "
                                  f"data_offsets span {end - begin}")
        if end > len(data):
            raise WireFormatError(f"tensor {name!r}: data_offsets end at {end}, past the {len(data)} bytes of data "
                                  "(truncated?)")
        ranges.append((begin, end, name))
        tensors[name] = _view(data, dtype, shape, begin, end)
    covered = 0
    for begin, end, name in sorted(ranges):
        if begin != covered:
            raise WireFormatError(f"tensor {name!r} starts at byte {begin}, where {covered} was expected (tensors "
                                  "overlap or leave a hole)")
        covered = end
    if covered != len(data):
        raise WireFormatError(f"{len(data) - covered} bytes after the last tensor")
    return tensors, metadata


def _metadata(raw: Any) -> dict[str, Any]:
    if raw is None:
        return {}
    if not isinstance(raw, dict) or not all(isinstance(v, str) for v in raw.values()):
        raise WireFormatError("__metadata__ must map strings to strings")
    if METADATA_KEY not in raw:
        return {}
    try:
        document = json.loads(raw[METADATA_KEY])
    except json.JSONDecodeError as exc:
        raise WireFormatError(f"__metadata__[{METADATA_KEY!r}] is not JSON: {exc}") from None
    if not isinstance(document, dict):
        raise WireFormatError(f"__metadata__[{METADATA_KEY!r}] must be a JSON object")
    return document


def _entry(name: str, entry: Any) -> tuple[torch.dtype, list[int], int, int]:
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise WireFormatError(f"tensor {name!r}: an entry has exactly dtype, shape and data_offsets")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in DTYPES:
        raise WireFormatError(f"tensor {name!r}: dtype {dtype!r} is not one of {sorted(DTYPES)}")
    if not isinstance(shape, list) or not all(_natural(d) for d in shape):
        raise WireFormatError(f"tensor {name!r}: shape must be a list of non-negative integers; got {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_natural(o) for o in offsets)
            and offsets[0] <= offsets[1]):
        raise WireFormatError(f"tensor {name!r}: data_offsets must be [begin, end] with 0 <= begin <= end; "
                              f"got {offsets!r}")
    return DTYPES[dtype], shape, offsets[0], offsets[1]


def _natural(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _view(data: memoryview, dtype: torch.dtype, shape: list[int], begin: int, end: int) -> torch.Tensor:
    """The tensor at data[begin:end], in place; a copy only where another writer left it misaligned."""
    if end == begin:
        return torch.empty(shape, dtype=dtype)
    flat = torch.frombuffer(data[begin:end], dtype=torch.uint8)
    if flat.data_ptr() % _itemsize(dtype):
        flat = flat.clone()
    return flat.view(dtype).reshape(shape)
