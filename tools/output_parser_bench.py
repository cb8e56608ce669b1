"""Cost of parsing replies for reasoning and tool calls, per streamed delta.

    python -m kvfork.tools.output_parser_bench

A reply with a reasoning block, some content and one long tool call (a file
write), fed in 4-character deltas (about a token each) through the same
output parser the chat and Messages routes use; the best of 5 runs.
"""

from __future__ import annotations

import json
import time

from kvfork.server.chat_output import collect, output_parser

TEMPLATE = "<think> <tool_call>"  # what the parsers are chosen from: reasoning + Hermes calls
TOOLS = [{"type": "function", "function": {"name": "write", "parameters": {"type": "object", "properties": {}}}}]


def main(argv: list[str] | None = None) -> int:
    body = "def f(x):\n    return x + 1\n" * 300
    call = json.dumps({"name": "write", "arguments": {"path": "a.py", "content": body}})
    reply = "<think>\n" + "step by step " * 400 + "\n</think>\n\nWriting it.\n<tool_call>\n" + call + "\n</tool_call>"
    pieces = [reply[i : i + 4] for i in range(0, len(reply), 4)]
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        parser = output_parser("auto", "auto", TEMPLATE, "assistant\n", TOOLS)
        events = [event for piece in pieces for event in parser.feed(piece)] + parser.finish()
        best = min(best, time.perf_counter() - start)
    out = collect(events)
    assert out.reasoning and out.content == "Writing it." and len(out.tool_calls) == 1
    print(f"{len(pieces)} deltas ({len(reply)} chars: reasoning, content, a {len(body)}-char call): "
          f"{best * 1e3:.1f} ms, {best / len(pieces) * 1e6:.2f} us per delta")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
