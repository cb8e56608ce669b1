"""Every tool-call family over HTTP, on tiny models whose templates teach its markup (family_models.py):
a streamed call in the OpenAI, Anthropic and Responses shapes, parallel calls, the reasoning split,
broken markup as content, and a tool round trip whose second prompt reuses the first prompt and call."""

from __future__ import annotations

import json

import pytest

from agent_server import CLAUDE_TOOL, WEATHER, user
from family_models import FAMILIES, model_for
from http_daemon import serving
from scripted_backend import EOS, ScriptedBackend
from kvfork.server.generate.grammar import auto_constrained

NAMES = (*FAMILIES, "harmony")
REASONING = "The user wants the weather."
HARMONY_CALL = ('<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "CITY"}'
                '<|call|>')


def replies(name: str) -> dict[str, str]:
    """What the scripted model writes, by the last user turn ("tool": after a tool result)."""
    if name == "harmony":
        call = HARMONY_CALL.replace("CITY", "Paris")
        return {
            "weather?": f"<|channel|>analysis<|message|>{REASONING}<|end|><|start|>assistant<|channel|>commentary"
                        f"<|message|>Let me check.<|end|>{call}",
            "two calls": "<|channel|>analysis<|message|>Two.<|end|>" + call + HARMONY_CALL.replace("CITY", "Oslo"),
            "broken": "<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant to=functions.get_weather"
                      "<|channel|>commentary json<|message|>{not json<|call|>",
            "tool": "<|channel|>analysis<|message|>Sunny.<|end|><|start|>assistant<|channel|>final<|message|>"
                    "It is sunny in Paris.<|return|>",
        }
    family = FAMILIES[name]
    (opening, closing), (wrap_open, wrap_close) = family.thinking, family.wrap
    call = wrap_open + family.call_text("get_weather", {"city": "Paris"}) + wrap_close
    two = (wrap_open + family.call_text("get_weather", {"city": "Paris"}) + family.joiner
           + family.call_text("get_weather", {"city": "Oslo"}, 1) + wrap_close)
    return {
        "weather?": f"{opening}\n{REASONING}\n{closing}\n\nLet me check.\n{call}",
        "two calls": two,
        "broken": wrap_open + family.call.split("{{")[0] + "<<not a call" + wrap_close,
        "tool": "It is sunny in Paris.",
    }


def split(name: str, text: str) -> tuple[str, str]:
    """(history, the turn being written) of a decoded sequence."""
    if name == "harmony":
        last = max(text.rfind("<|start|>user"), text.rfind("<|start|>functions."))
        at = text.find("<|start|>assistant", last)
        return (text[:at], text[at + len("<|start|>assistant"):]) if at >= 0 else (text, "\0")
    at = text.rfind("<|im_start|>assistant\n")
    return (text[:at], text[at + len("<|im_start|>assistant\n"):]) if at >= 0 else (text, "\0")


def last_turn(name: str, history: str) -> str:
    if name == "harmony":
        if history.rfind("<|start|>functions.") > history.rfind("<|start|>user"):
            return "tool"
        return history.rsplit("<|start|>user<|message|>", 1)[-1].split("<|end|>", 1)[0]
    if history.rfind("<|im_start|>tool\n") > history.rfind("<|im_start|>user\n"):
        return "tool"
    return history.rsplit("<|im_start|>user\n", 1)[-1].split("<|im_end|>", 1)[0]


class FamilyScript:
    """Writes the family's reply for the last user turn, token by token, through the real tokenizer,
    keeping each prompt it sees."""

    def __init__(self, name: str, folder: str):
        from transformers import AutoTokenizer

        self.name, self.tokenizer, self.replies = name, AutoTokenizer.from_pretrained(folder), replies(name)
        self.prompts: list[str] = []

    def __call__(self, sequence) -> int:
        text = self.tokenizer.decode(list(sequence), skip_special_tokens=False)
        history, written = split(self.name, text)
        target = self.replies.get(last_turn(self.name, history), "Plain answer.")
        if not target.startswith(written):
            return 3  # a prefill chunk that ends mid-prompt: its token is never used
        if not written:
            self.prompts.append(text)
        missing = target[len(written):]
        return self.tokenizer.encode(missing, add_special_tokens=False)[0] if missing else EOS


@pytest.fixture(params=NAMES)
async def family(request, tiny_model_dir, tmp_path):
    name = request.param
    folder = str(model_for(name, tiny_model_dir("llama"), tmp_path / name))
    script = FamilyScript(name, folder)
    async with serving(folder, ScriptedBackend(script=script), served_model_name=["tiny"]) as d:
        yield name, d, script


async def test_calls_reasoning_and_round_trip(family, sdk):
    name, d, script = family
    oai = sdk.openai(d, api_key="none")
    content, reasoning, calls, finish = "", "", {}, None
    async for chunk in await oai.chat.completions.create(model="tiny", messages=user("weather?"), tools=[WEATHER],
                                                          stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        reasoning += getattr(delta, "reasoning_content", None) or ""
        for d_call in delta.tool_calls or ():
            calls.setdefault(d_call.index, [d_call.function.name, ""])[1] += d_call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert (reasoning, content, finish) == (REASONING, "Let me check.", "tool_calls")
    assert [(n, json.loads(a)) for n, a in calls.values()] == [("get_weather", {"city": "Paris"})]

    two = await oai.chat.completions.create(model="tiny", messages=user("two calls"), tools=[WEATHER])
    assert [json.loads(c.function.arguments)["city"] for c in two.choices[0].message.tool_calls] == ["Paris", "Oslo"]

    broken = await oai.chat.completions.create(model="tiny", messages=user("broken"), tools=[WEATHER], max_tokens=64)
    if name != "harmony" and auto_constrained(name, d.state.tokenizer.specials):
        # the grammar holds a call the model opens to the schema: the broken markup is never written
        assert broken.choices[0].finish_reason == "length"
        assert "<<not a call" not in (broken.choices[0].message.content or "")
    else:  # markup the model broke is its text, as content
        assert broken.choices[0].finish_reason == "stop" and broken.choices[0].message.tool_calls is None
        assert ("not json" if name == "harmony" else "<<not a call") in broken.choices[0].message.content

    first = await oai.chat.completions.create(model="tiny", messages=user("weather?"), tools=[WEATHER])
    message = first.choices[0].message
    prompt = script.prompts[-1]
    history = user("weather?") + [message.model_dump(exclude_none=True),
                                  {"role": "tool", "tool_call_id": message.tool_calls[0].id, "name": "get_weather",
                                   "content": "sunny"}]
    second = await oai.chat.completions.create(model="tiny", messages=history, tools=[WEATHER])
    assert second.choices[0].message.content == "It is sunny in Paris."
    # the second prompt is the first prompt, then the reply as the model wrote it (the call re-renders to its
    # text): the whole first prompt comes from the cache
    assert script.prompts[-1].startswith(prompt + replies(name)["weather?"])
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens


async def test_anthropic_and_responses_shapes(family, sdk):
    name, d, _ = family
    claude = sdk.anthropic(d, api_key="none")
    async with claude.messages.stream(model="tiny", max_tokens=200, messages=user("weather?"),
                                      tools=[CLAUDE_TOOL]) as stream:
        done = await stream.get_final_message()
    blocks = [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None) or b.input) for b in done.content]
    assert blocks == [("thinking", REASONING), ("text", "Let me check."), ("tool_use", {"city": "Paris"})]
    assert done.stop_reason == "tool_use"
    oai = sdk.openai(d, api_key="none")
    response = await oai.responses.create(model="tiny", input="weather?",
                                          tools=[{"type": "function", **WEATHER["function"]}])
    kinds = [item.type for item in response.output]
    assert kinds == ["reasoning", "message", "function_call"]
    assert json.loads(response.output[2].arguments) == {"city": "Paris"}
