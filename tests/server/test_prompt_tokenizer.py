"""Prompts through the tokenizer layer: one BOS, template arguments passed through, work off the loop."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading

import pytest

from kvfork.server.guard.errors import ApiError
from kvfork.server.text.tokenizer import PromptTokenizer

TEMPLATE = (
    "{{ bos_token }}{% if tools %}TOOLS:{{ tools[0]['function']['name'] }}\n{% endif %}"
    "{% if enable_thinking %}THINK\n{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'tool' and not m.get('tool_call_id') %}"
    "{{ raise_exception('tool message without tool_call_id') }}{% endif %}"
    "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


@pytest.fixture(scope="module")
def bos_tokenizer(tiny_model_dir, tmp_path_factory) -> PromptTokenizer:
    """The tiny tokenizer, made to add a BOS on encode, with a template that also writes one."""
    from tokenizers import Tokenizer, processors

    folder = tmp_path_factory.mktemp("bos")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{tiny_model_dir('llama')}/{name}", folder / name)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    bos = tok.token_to_id("<|endoftext|>")
    tok.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", bos)])
    tok.save(str(folder / "tokenizer.json"))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.update(bos_token="<|endoftext|>", chat_template=TEMPLATE)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return PromptTokenizer.load(str(folder))


def bos_id(t: PromptTokenizer) -> int:
    return t.tokenizer.convert_tokens_to_ids("<|endoftext|>")


async def test_chat_prompt_has_one_bos(bos_tokenizer):
    ids = await bos_tokenizer.chat([{"role": "user", "content": "the city"}])
    assert ids[0] == bos_id(bos_tokenizer) and ids.count(bos_id(bos_tokenizer)) == 1
    assert bos_tokenizer.decode(ids).endswith("user: the city\nassistant:")  # add_generation_prompt


async def test_text_prompt_gets_bos_once_whether_or_not_it_carries_one(bos_tokenizer):
    plain = await bos_tokenizer.text("the city")
    carried = await bos_tokenizer.text("<|endoftext|>the city")
    assert plain == carried and plain.count(bos_id(bos_tokenizer)) == 1


async def test_tools_and_template_kwargs_reach_the_template(bos_tokenizer):
    tools = [{"type": "function", "function": {"name": "read_file", "parameters": {}}}]
    ids = await bos_tokenizer.chat([{"role": "user", "content": "hi"}], tools, {"enable_thinking": True})
    text = bos_tokenizer.decode(ids)
    assert "TOOLS:read_file\n" in text and "THINK\n" in text
    plain = bos_tokenizer.decode(await bos_tokenizer.chat([{"role": "user", "content": "hi"}]))
    assert "TOOLS" not in plain and "THINK" not in plain


async def test_a_history_the_template_rejects_is_a_400_naming_messages(bos_tokenizer):
    with pytest.raises(ApiError) as e:
        await bos_tokenizer.chat([{"role": "tool", "content": "result"}])
    assert e.value.status == 400 and e.value.param == "messages"


async def test_long_prompts_are_tokenized_off_the_loop(tiny_model_dir):
    tokenizer = PromptTokenizer.load(tiny_model_dir("llama"))
    threads: list[str] = []
    encode = tokenizer.encode_text
    tokenizer.encode_text = lambda text, tok=None: threads.append(threading.current_thread().name) or encode(text, tok)
    short = await tokenizer.text("the city")
    long = await tokenizer.text("the city " * 1000)
    assert short and len(long) > 1000
    assert threads[0] == threading.main_thread().name and threads[1].startswith("kvfork-tokenize")


async def test_message_ends_are_where_each_earlier_message_ends_in_the_prompt(bos_tokenizer):
    """GenerateRequest.boundaries: the conversation cut after each earlier message encodes to a prefix of
    the prompt (the system block included); only the last `last` are asked for; a cut that is no prefix
    of the prompt marks none."""
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"},
                {"role": "assistant", "content": "hi"}, {"role": "user", "content": "what is two and two"}]
    prompt = await bos_tokenizer.chat(messages, tools)
    ends = await bos_tokenizer.message_ends(messages, tools, None, prompt, 8)
    assert len(ends) == 3 and all(0 < end < len(prompt) for end in ends)
    for cut, end in zip((1, 2, 3), ends):
        text = bos_tokenizer.render(messages[:cut], tools, {}).removesuffix("assistant:")
        assert prompt[:end] == bos_tokenizer.encode_rendered_text(text)
    assert await bos_tokenizer.message_ends(messages, tools, None, prompt, 2) == ends[1:]
    other = await bos_tokenizer.chat([{"role": "system", "content": "be long"}, *messages[1:]], tools)
    assert await bos_tokenizer.message_ends(messages, tools, None, other, 8) == ()  # not this prompt's prefix


LOOPING = ("{% if messages[0]['content'] == 'loop' %}{% for i in range(100000) %}{% for j in range(LOOPS) %}"
           "{% endfor %}{% endfor %}{% endif %}{{ messages[0]['content'] }}")


async def test_a_template_render_runs_off_the_loop_and_is_cut_at_its_time_limit(tiny_model_dir):
    """A short message into a template that loops (a GGUF from the hub brings its own): the render runs on a
    worker thread, is interrupted past --template-timeout with a 400, and the worker renders the next."""
    from transformers import AutoTokenizer

    template = LOOPING.replace("LOOPS", "100000")  # 10^10 steps: hours, on any machine
    tokenizer = PromptTokenizer(AutoTokenizer.from_pretrained(tiny_model_dir("llama")), template, render_timeout=0.2)
    threads: list[str] = []
    render = tokenizer.render
    tokenizer.render = lambda *args: threads.append(threading.current_thread().name) or render(*args)
    try:
        assert await tokenizer.render_chat([{"role": "user", "content": "hi"}]) == "hi"
        with pytest.raises(ApiError) as e:  # bounded: a render the limit failed to cut fails the test
            await asyncio.wait_for(tokenizer.render_chat([{"role": "user", "content": "loop"}]), 60)
        assert e.value.status == 400 and e.value.code == "template_timeout" and "--template-timeout" in e.value.message
        assert await tokenizer.render_chat([{"role": "user", "content": "after"}]) == "after"
        assert all(name.startswith("kvfork-tokenize") for name in threads)
    finally:
        tokenizer.close()
