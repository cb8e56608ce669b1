"""Cost of parsing replies for reasoning and tool calls, per streamed delta.

    python -m kvfork.tools.output_parser_bench

A reply with a reasoning block, some content and one long tool call (a file
write), fed in 4-character deltas (about a token each) through the same
output parser the chat and Messages routes use; the best of 5 runs; in Hermes'
markup, GLM's (read by mlx-lm's parser) and gpt-oss's Harmony.
"""

from __future__ import annotations

import json
import time

from kvfork.server.generate.chat_output import ModelFormats, collect

TOOLS = [{"type": "function", "function": {"name": "write", "parameters": {"type": "object", "properties": {
    "path": {"type": "string"}, "content": {"type": "string"}}}}}]
BODY = "def f(x):\n    return x + 1\n" * 300
THOUGHT = "step by step " * 400


def replies() -> dict[str, tuple[str, str]]:
    """family -> (the template text the parsers are chosen from, a reply: reasoning, content, one long call)."""
    call = json.dumps({"name": "write", "arguments": {"path": "a.py", "content": BODY}})
    glm = (f"<tool_call>write\n<arg_key>path</arg_key>\n<arg_value>a.py</arg_value>\n<arg_key>content</arg_key>\n"
           f"<arg_value>{BODY}</arg_value>\n</tool_call>")
    harmony = (f"<|channel|>analysis<|message|>{THOUGHT}<|end|><|start|>assistant<|channel|>commentary<|message|>"
               "Writing it.<|end|><|start|>assistant to=functions.write<|channel|>commentary json<|message|>"
               + json.dumps({"path": "a.py", "content": BODY}) + "<|call|>")
    return {
        "hermes": ("<think> <tool_call>",
                   f"<think>\n{THOUGHT}\n</think>\n\nWriting it.\n<tool_call>\n{call}\n</tool_call>"),
        "glm47": ("<think> <tool_call> <arg_key>", f"<think>\n{THOUGHT}\n</think>\n\nWriting it.\n{glm}"),
        "harmony": ("<|channel|> <|message|>", harmony),
    }


def main(argv: list[str] | None = None) -> int:
    for family, (template, reply) in replies().items():
        pieces = [reply[i : i + 4] for i in range(0, len(reply), 4)]
        best = float("inf")
        formats = ModelFormats.resolve("auto", "auto", template)  # once per model, as the daemon does at load
        for _ in range(5):
            start = time.perf_counter()
            parser = formats.parser("assistant\n", TOOLS)
            events = [event for piece in pieces for event in parser.feed(piece)] + parser.finish()
            best = min(best, time.perf_counter() - start)
        out = collect(events)
        assert out.reasoning and out.content == "Writing it." and len(out.tool_calls) == 1, family
        # GLM's reference parser strips a value's surrounding whitespace
        assert json.loads(out.tool_calls[0].arguments)["content"].strip() == BODY.strip(), family
        print(f"{family}: {len(pieces)} deltas ({len(reply)} chars: reasoning, content, a {len(BODY)}-char call): "
              f"{best * 1e3:.1f} ms, {best / len(pieces) * 1e6:.2f} us per delta")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
