"""Read a GGUF file with the `gguf` package: metadata as plain values, tensors dequantized to float32.

Any backend reads a file this way (numpy only, no MLX). Every fault a user can meet
(not a GGUF, a split file, a quantisation the package cannot dequantize) is an
`UnservableGGUF` whose message is one sentence naming what is missing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor, quants

_SPLIT = re.compile(r"-\d{5}-of-\d{5}\.gguf$")


class UnservableGGUF(ValueError):
    """A GGUF kvfork cannot serve; the message says what is missing."""


@dataclass(frozen=True)
class GGUFFile:
    path: Path
    meta: dict[str, Any]
    tensors: dict[str, ReaderTensor]  # by GGUF name, in file order

    @property
    def arch(self) -> str:
        return self.meta.get("general.architecture", "")

    def key(self, name: str, default: Any = None) -> Any:
        """An architecture key: key('context_length') reads 'llama.context_length' in a llama file."""
        return self.meta.get(f"{self.arch}.{name}", default)


def read_gguf(path: Path) -> GGUFFile:
    """The file's metadata and tensor index (tensor data stays memory-mapped until dequantized)."""
    if _SPLIT.search(path.name):
        raise UnservableGGUF(f"{path.name} is one part of a split GGUF, which kvfork does not read; "
                             "merge the parts into one file first (llama.cpp's `llama-gguf-split --merge`)")
    try:
        reader = GGUFReader(path)
    except (ValueError, OSError, IndexError) as e:
        raise UnservableGGUF(f"{path.name} is not a GGUF file the gguf package can read ({e})") from None
    meta = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    return GGUFFile(path, meta, {t.name: t for t in reader.tensors})


def dequantized(tensor: ReaderTensor) -> np.ndarray:
    """A tensor's float32 values in Hugging Face (row-major) shape: the GGUF lists dimensions innermost first."""
    kind = GGMLQuantizationType(tensor.tensor_type)
    try:
        values = quants.dequantize(tensor.data, kind)
    except NotImplementedError:
        raise UnservableGGUF(f"tensor {tensor.name} is stored as {kind.name}, a quantisation the gguf "
                             "package cannot dequantize") from None
    return np.ascontiguousarray(values, dtype=np.float32).reshape([int(n) for n in reversed(tensor.shape)])
