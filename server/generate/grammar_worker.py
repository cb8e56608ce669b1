"""A process that tries grammars before the daemon builds them, so one that compiles too long is killed.

llguidance bounds each decoding step (server/generate/grammar.py passes its LLParserLimits), but building a
matcher for some schemas (thousands of optional properties) grows faster than their size, and a
thread cannot be stopped. So the daemon first builds each new grammar here, with the same limits,
under --grammar-compile-timeout: past it this process is killed (and another started for the next
grammar), and the request gets a 400; a grammar built here in time is built again in the daemon,
where it takes the same bounded time. A grammar that crashes llguidance crashes only this process.
The process runs at the lowest CPU priority (NICENESS): while it compiles, every other tenant's decode keeps
its core, and the compile gets what they leave.

Wire: 4-byte little-endian lengths, each followed by that much JSON. First the setup
{"tokenizer": <tokenizer.json text>, "vocab_size", "eos", "limits": {...}}, answered {"ready": true};
then a grammar per message {"grammar": text}, answered {"error": text or null}.
"""

from __future__ import annotations

import json
import os
import struct
import sys
from typing import Any, BinaryIO

NICENESS = 19  # the lowest priority: a compile takes the CPU the daemon's threads leave


def read_message(stream: BinaryIO) -> Any:
    head = stream.read(4)
    if len(head) < 4:
        return None
    (size,) = struct.unpack("<I", head)
    return json.loads(stream.read(size))


def write_message(stream: BinaryIO, message: Any) -> None:
    data = json.dumps(message).encode()
    stream.write(struct.pack("<I", len(data)) + data)
    stream.flush()


def main() -> None:
    os.nice(NICENESS)
    import llguidance
    import numpy as np

    source, sink = sys.stdin.buffer, sys.stdout.buffer
    setup = read_message(source)
    tokenizer = llguidance.LLTokenizer(setup["tokenizer"], n_vocab=setup["vocab_size"], eos_token=setup["eos"])
    limits = llguidance.LLParserLimits(**setup["limits"])
    mask = np.zeros((setup["vocab_size"] + 31) // 32, dtype=np.int32)
    write_message(sink, {"ready": True})
    while (message := read_message(source)) is not None:
        matcher = llguidance.LLMatcher(tokenizer, message["grammar"], log_level=0, limits=limits)
        if not matcher.is_error():  # the first mask builds the lexer: part of the cost
            matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        write_message(sink, {"error": matcher.get_error() if matcher.is_error() else None})


if __name__ == "__main__":
    main()
