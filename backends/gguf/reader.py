"""Read a GGUF file: metadata as plain values, tensors as memory-mapped arrays dequantized to float32.

The header is parsed here, over a memory map, and trusts nothing in it: every count (keys, tensors,
an array's items, a string's bytes) is checked against the bytes left before anything is read, so
a 100-byte file declaring 2^40 items is refused at once; a numeric array is one numpy view, a string
array one pass of `struct` over the map (an 8 MB vocabulary in 0.36 s; the package's reader made two
arrays per string, 40 s). A metadata array holds at most `MAX_ARRAY_ITEMS` items and a string array
takes at most `MAX_STRING_ARRAY_BYTES`: transformers builds the tokenizer from them item by item (26 MB
of tokens took 11 s), so past those bounds, far above any model's vocabulary, the start is refused.
Arrays of arrays, which llama.cpp refuses too, are refused rather than followed. The `gguf` package
names the types and dequantizes (`gguf.quants`). Every fault a user can meet (not a GGUF, a truncated
or inconsistent one, a split file, a quantisation the package cannot dequantize, a key of the wrong
type) is an `UnservableGGUF` whose message is one sentence naming what is wrong.
"""

from __future__ import annotations

import re
import struct
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, quants
from gguf.quants import quant_shape_to_byte_shape

_SPLIT = re.compile(r"-\d{5}-of-\d{5}\.gguf$")
_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
_ALIGNMENT = 32  # GGUF's default, unless general.alignment says otherwise
_SCALARS = {GGUFValueType.UINT8: "u1", GGUFValueType.INT8: "i1", GGUFValueType.UINT16: "u2",
            GGUFValueType.INT16: "i2", GGUFValueType.UINT32: "u4", GGUFValueType.INT32: "i4",
            GGUFValueType.FLOAT32: "f4", GGUFValueType.UINT64: "u8", GGUFValueType.INT64: "i8",
            GGUFValueType.FLOAT64: "f8", GGUFValueType.BOOL: "?"}
# tensor types whose data is an array of plain numbers (the others are blocks of bytes)
_PLAIN = {GGMLQuantizationType.F16: "f2", GGMLQuantizationType.F32: "f4", GGMLQuantizationType.F64: "f8",
          GGMLQuantizationType.I8: "i1", GGMLQuantizationType.I16: "i2", GGMLQuantizationType.I32: "i4",
          GGMLQuantizationType.I64: "i8"}
_LENGTH = struct.Struct("<Q")
# 4 times the largest vocabulary (Gemma 3's 262,144 tokens) and 3.5 times the longest merges (Llama 3's 280,147)
MAX_ARRAY_ITEMS = 1 << 20
# several times the largest string array, Llama 3's merges (a few MB with their 8-byte lengths)
MAX_STRING_ARRAY_BYTES = 32 << 20


class UnservableGGUF(ValueError):
    """A GGUF kvfork cannot serve; the message says what is missing."""


@dataclass(frozen=True)
class Tensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # innermost dimension first, as the GGUF lists them
    n_elements: int
    data: np.ndarray  # a view of the memory-mapped file


@dataclass(frozen=True)
class GGUFFile:
    path: Path
    meta: dict[str, Any]
    tensors: dict[str, Tensor]  # by GGUF name, in file order

    @property
    def arch(self) -> str:
        arch = self.meta.get("general.architecture", "")
        return arch if isinstance(arch, str) else ""

    def key(self, name: str, default: Any = None, kind: Any = None) -> Any:
        """An architecture key: key('context_length') reads 'llama.context_length' in a llama file;
        with `kind` (int, float, str, bool or list[...]), a value of another type is refused."""
        return self.value(f"{self.arch}.{name}", default, kind)

    def value(self, name: str, default: Any = None, kind: Any = None) -> Any:
        """The metadata value `name` (`default` when absent), refused unless it is a `kind`."""
        found = self.meta.get(name, default)
        if kind is not None and found is not None and not _is(found, kind):
            raise UnservableGGUF(f"the GGUF's {name} is {_kind_name(found)} where kvfork reads {_kind_name(kind)}")
        return found


def _is(value: Any, kind: Any) -> bool:
    if typing.get_origin(kind) is list:  # an array holds one type: its first item stands for all
        if not isinstance(value, list) or not value:
            return isinstance(value, list)
        value, kind = value[0], typing.get_args(kind)[0]
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, kind) and (kind is bool or not isinstance(value, bool))


_NAMES = {int: ("an integer", "integers"), float: ("a number", "numbers"), str: ("a string", "strings"),
          bool: ("a boolean", "booleans")}


def _kind_name(kind: Any) -> str:
    """'an integer', 'a list of strings', ... for a kind, or for a value (its kind)."""
    if not isinstance(kind, type) and typing.get_origin(kind) is not list:  # a value
        kind = list[type(kind[0])] if isinstance(kind, list) and kind else type(kind)
    if typing.get_origin(kind) is list:
        return f"a list of {_NAMES.get(typing.get_args(kind)[0], ('', 'values'))[1]}"
    return _NAMES.get(kind, (f"a {kind.__name__}",))[0]


class _Header:
    """A cursor over the file's bytes; every count is checked against the bytes left before it is read."""

    def __init__(self, data: np.ndarray, name: str):
        self.data, self.view, self.name, self.offset = data, memoryview(data), name, 0

    def left(self) -> int:
        return len(self.view) - self.offset

    def take(self, n: int, what: str) -> memoryview:
        if n > self.left():
            raise UnservableGGUF(f"{self.name} ends inside its {what}: the file is cut short or not a GGUF")
        self.offset += n
        return self.view[self.offset - n:self.offset]

    def scalar(self, code: str, what: str) -> Any:
        dtype = np.dtype("<" + code)
        return np.frombuffer(self.take(dtype.itemsize, what), dtype)[0].item()

    def count(self, item_bytes: int, what: str) -> int:
        """A u64 count of items of at least `item_bytes` each, refused when the bytes left cannot hold them."""
        n = self.scalar("u8", f"count of {what}")
        if n * item_bytes > self.left():
            raise UnservableGGUF(f"{self.name} declares {n} {what}, more than its remaining {self.left()} bytes "
                                 "can hold")
        return n

    def string(self, what: str) -> str:
        return _text(self.take(self.count(1, f"bytes of {what}"), what), what)

    def value(self, kind: int, key: str) -> Any:
        if kind == GGUFValueType.STRING:
            return self.string(key)
        if kind in _SCALARS:
            return self.scalar(_SCALARS[GGUFValueType(kind)], key)
        if kind != GGUFValueType.ARRAY:
            raise UnservableGGUF(f"the GGUF's {key} has value type {kind}, which GGUF does not define")
        item = self.scalar("u4", key)
        if item == GGUFValueType.STRING:
            return self.strings(key)
        if item in _SCALARS:
            dtype = np.dtype("<" + _SCALARS[GGUFValueType(item)])
            n = self.items(dtype.itemsize, key)
            return np.frombuffer(self.take(n * dtype.itemsize, key), dtype).tolist()
        if item == GGUFValueType.ARRAY:
            raise UnservableGGUF(f"the GGUF's {key} is an array of arrays, which no GGUF model holds "
                                 "(llama.cpp refuses them too)")
        raise UnservableGGUF(f"the GGUF's {key} is an array of value type {item}, which GGUF does not define")

    def items(self, item_bytes: int, key: str, noun: str = "items") -> int:
        """An array's count of items (`count`), refused past MAX_ARRAY_ITEMS."""
        n = self.count(item_bytes, f"{noun} in {key}")
        if n > MAX_ARRAY_ITEMS:
            raise UnservableGGUF(f"the GGUF's {key} holds {n:,} items; kvfork reads at most {MAX_ARRAY_ITEMS:,} "
                                 "(4 times the largest vocabulary)")
        return n

    def strings(self, key: str) -> list[str]:
        """An array of strings: one pass over the map, each length checked against the bytes left, the array's
        bytes against MAX_STRING_ARRAY_BYTES."""
        n = self.items(_LENGTH.size, key, "strings")  # each at least its 8-byte length
        view, offset = self.view, self.offset
        end = min(len(self.view), offset + MAX_STRING_ARRAY_BYTES)
        out, unpack = [], _LENGTH.unpack_from
        try:
            for _ in range(n):
                if offset + _LENGTH.size > end:
                    break
                (size,) = unpack(view, offset)
                offset += _LENGTH.size + size
                if offset > end:
                    break
                out.append(str(view[offset - size:offset], "utf-8"))
        except UnicodeDecodeError:
            raise UnservableGGUF(f"the GGUF's {key} holds a string that is not UTF-8 text") from None
        if len(out) < n and end < len(view):
            raise UnservableGGUF(f"the GGUF's {key} takes more than {MAX_STRING_ARRAY_BYTES >> 20} MiB; kvfork reads "
                                 "at most that (4 times the largest vocabulary)")
        if len(out) < n:
            raise UnservableGGUF(f"{self.name} ends inside its {key}: the file is cut short or not a GGUF")
        self.offset = offset
        return out


def _text(raw: memoryview, what: str) -> str:
    try:
        return str(raw, "utf-8")
    except UnicodeDecodeError:
        raise UnservableGGUF(f"the GGUF's {what} is not UTF-8 text") from None


def read_gguf(path: Path) -> GGUFFile:
    """The file's metadata and tensor index (tensor data stays memory-mapped until dequantized)."""
    if _SPLIT.search(path.name):
        raise UnservableGGUF(f"{path.name} is one part of a split GGUF, which kvfork does not read; "
                             "merge the parts into one file first (llama.cpp's `llama-gguf-split --merge`)")
    try:
        data = np.memmap(path, mode="r") if path.stat().st_size else np.zeros(0, np.uint8)
    except (OSError, ValueError) as e:
        raise UnservableGGUF(f"{path.name} could not be read ({e.strerror if isinstance(e, OSError) else e})") \
            from None
    header = _Header(data, path.name)
    if header.left() < 8 or bytes(header.take(4, "magic")) != _MAGIC:
        raise UnservableGGUF(f"{path.name} is not a GGUF file (it does not start with GGUF)")
    version = header.scalar("u4", "version")
    if version & 0xFFFF == 0:
        raise UnservableGGUF(f"{path.name} is a big-endian GGUF, which kvfork does not read")
    if version not in _VERSIONS:
        raise UnservableGGUF(f"{path.name} is GGUF version {version}; kvfork reads versions 2 and 3")
    n_tensors = header.count(24, "tensors")  # a tensor's entry: name length, dims, type and offset
    meta = _metadata(header, header.count(12, "metadata keys"))  # a key: its length, a type, a value
    return GGUFFile(path, meta, _tensors(header, n_tensors, meta))


def _metadata(header: _Header, n: int) -> dict[str, Any]:
    meta: dict[str, Any] = {}
    for _ in range(n):
        key = header.string("metadata key")
        if key in meta:
            raise UnservableGGUF(f"the GGUF states {key} twice")
        meta[key] = header.value(header.scalar("u4", key), key)
    return meta


def _tensors(header: _Header, n: int, meta: dict[str, Any]) -> dict[str, Tensor]:
    entries = []
    for _ in range(n):
        name = header.string("tensor name")
        n_dims = header.scalar("u4", name)
        if n_dims > _MAX_DIMS:
            raise UnservableGGUF(f"the GGUF's tensor {name} has {n_dims} dimensions; ggml allows {_MAX_DIMS}")
        shape = tuple(header.scalar("u8", name) for _ in range(n_dims))
        entries.append((name, shape, header.scalar("u4", name), header.scalar("u8", name)))
    alignment = meta.get("general.alignment", _ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise UnservableGGUF("the GGUF's general.alignment is not a power of two")
    start = -(-header.offset // alignment) * alignment
    tensors: dict[str, Tensor] = {}
    for name, shape, raw_type, offset in entries:
        if name in tensors:
            raise UnservableGGUF(f"the GGUF holds tensor {name} twice")
        tensors[name] = _tensor(header, name, shape, raw_type, start + offset)
    return tensors


def _tensor(header: _Header, name: str, shape: tuple[int, ...], raw_type: int, at: int) -> Tensor:
    try:
        kind = GGMLQuantizationType(raw_type)
    except ValueError:
        raise UnservableGGUF(f"the GGUF's tensor {name} has type {raw_type}, which ggml does not define") from None
    block, block_bytes = GGML_QUANT_SIZES[kind]
    n_elements = int(np.prod(shape, dtype=object)) if shape else 1
    if shape and shape[0] % block:
        raise UnservableGGUF(f"the GGUF's tensor {name} has rows of {shape[0]} values, not whole {kind.name} "
                             f"blocks of {block}")
    n_bytes = n_elements // block * block_bytes
    if at + n_bytes > len(header.view):
        raise UnservableGGUF(f"the GGUF's tensor {name} lies past the end of the file: the file is cut short")
    rows = tuple(reversed(shape))
    if kind in _PLAIN:
        data = np.frombuffer(header.data, np.dtype("<" + _PLAIN[kind]), n_elements, at).reshape(rows)
    else:
        data = np.frombuffer(header.data, np.uint8, n_bytes, at).reshape(quant_shape_to_byte_shape(rows, kind))
    return Tensor(name, kind, shape, n_elements, data)


def dequantized(tensor: Tensor) -> np.ndarray:
    """A tensor's float32 values in Hugging Face (row-major) shape: the GGUF lists dimensions innermost first."""
    try:
        values = quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise UnservableGGUF(f"tensor {tensor.name} is stored as {tensor.tensor_type.name}, a quantisation the gguf "
                             "package cannot dequantize") from None
    return np.ascontiguousarray(values, dtype=np.float32).reshape([int(n) for n in reversed(tensor.shape)])
