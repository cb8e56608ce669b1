"""Images over HTTP on a text-only model, in each API's shape with the official clients: an image in a user's
message is a 400 naming the model; one inside a tool result is given to the model as one line of text naming
its media type and size (count_tokens counts that line, /metrics counts the image) and the session goes on,
unless `--images refuse`; bad images are 400s naming their flag, before any work."""

from __future__ import annotations

import base64
import io

import aiohttp
import anthropic
import openai
import pytest
import pytest_asyncio
from PIL import Image

from agent_server import WEATHER, agent_model, reply  # noqa: F401
from http_daemon import metrics, serving
from scripted_replies import scripted

pytestmark = pytest.mark.asyncio(loop_scope="module")
ALLOWED = "images.example.com"  # never resolved: a text-only model fetches nothing
LIMITS = dict(max_images=3, max_image_pixels=100_000, max_body_bytes=256 * 1024, allowed_media_domains=[ALLOWED])
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
CLAUDE_TOOL = {"name": "get_weather", "description": "Weather in a city",
               "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}


def picture(width: int = 64, height: int = 40, form: str = "PNG") -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 90)).save(out, form)
    return out.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


PNG = data_url(picture())
LINE = "[image/png image, 64x40 pixels: not shown, this model reads text only]"


def image_part(url: str = PNG) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def chat_tool_result(*parts: dict) -> list[dict]:
    """A chat history whose tool result holds `parts` (chat's image_url parts in a tool message)."""
    return [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "call_1", "content": list(parts)}]


def claude_tool_result(*content: dict) -> list[dict]:
    return [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                               "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": list(content)}]}]


def claude_image(data: bytes = picture(), media_type: str = "image/png") -> dict:
    return {"type": "image", "source": {"type": "base64", "media_type": media_type,
                                        "data": base64.b64encode(data).decode()}}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def daemon(agent_model):  # noqa: F811
    async with serving(agent_model, scripted(agent_model, reply), served_model_name=["tiny"], **LIMITS) as d:
        yield d


@pytest_asyncio.fixture(loop_scope="module")
async def oai(daemon):
    async with openai.AsyncOpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0) as client:
        yield client


@pytest_asyncio.fixture(loop_scope="module")
async def claude(daemon):
    async with anthropic.AsyncAnthropic(base_url=daemon.url, api_key="unused", max_retries=0) as client:
        yield client


async def replaced(daemon) -> float:
    async with aiohttp.ClientSession() as http:
        return sum(v for k, v in (await metrics(http, daemon.url)).items()
                   if k.startswith("kvfork_images_replaced_total"))


async def test_chat_refuses_an_image_in_a_user_message_naming_the_model(oai):
    content = [{"type": "text", "text": "what is this?"}, image_part()]
    with pytest.raises(openai.BadRequestError) as e:
        await oai.chat.completions.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": content}])
    error = e.value.body
    assert error["code"] == "unsupported_content" and error["param"] == "messages[0].content[1]"
    assert "'tiny' reads text only" in error["message"]


async def test_chat_gives_a_tool_results_image_as_a_line_of_text(oai, daemon):
    before = await replaced(daemon)
    answer = await oai.chat.completions.create(model="tiny", max_tokens=20, tools=[WEATHER],
                                              messages=chat_tool_result(image_part(), {"type": "text", "text": "ok"}))
    assert answer.choices[0].message.content == "It is sunny in Paris."  # the session goes on
    as_text = await oai.chat.completions.create(model="tiny", max_tokens=1, tools=[WEATHER], messages=chat_tool_result(
        {"type": "text", "text": LINE}, {"type": "text", "text": "ok"}))
    assert answer.usage.prompt_tokens == as_text.usage.prompt_tokens  # what the model saw: that line
    assert await replaced(daemon) == before + 1


async def test_an_image_url_is_refused_unless_its_domain_is_allowed_and_never_fetched(oai, daemon):
    with pytest.raises(openai.BadRequestError) as e:
        await oai.chat.completions.create(model="tiny", max_tokens=4, tools=[WEATHER],
                                          messages=chat_tool_result(image_part("https://elsewhere.example/a.png")))
    assert "--allowed-media-domains" in e.value.body["message"] and e.value.body["param"] == "messages[2].content[0]"
    allowed = f"https://{ALLOWED}/shot.png"
    with pytest.raises(openai.BadRequestError) as e:  # a user's image: refused without fetching it
        await oai.chat.completions.create(model="tiny", max_tokens=4,
                                          messages=[{"role": "user", "content": [image_part(allowed)]}])
    assert "reads text only" in e.value.body["message"]
    answer = await oai.chat.completions.create(model="tiny", max_tokens=20, tools=[WEATHER],
                                              messages=chat_tool_result(image_part(allowed)))
    assert answer.choices[0].message.content == "It is sunny in Paris."


async def test_messages_refuse_a_user_image_and_replace_one_in_a_tool_result(claude):
    with pytest.raises(anthropic.BadRequestError) as e:
        await claude.messages.create(model="tiny", max_tokens=4, messages=[
            {"role": "user", "content": [claude_image(), {"type": "text", "text": "what is this?"}]}])
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert "'tiny' reads text only" in e.value.body["error"]["message"]
    messages = claude_tool_result(claude_image(), {"type": "text", "text": "ok"})
    answer = await claude.messages.create(model="tiny", max_tokens=20, tools=[CLAUDE_TOOL], messages=messages)
    assert answer.content[0].text == "It is sunny in Paris."
    counted = await claude.messages.count_tokens(model="tiny", tools=[CLAUDE_TOOL], messages=messages)
    as_text = await claude.messages.count_tokens(model="tiny", tools=[CLAUDE_TOOL], messages=claude_tool_result(
        {"type": "text", "text": LINE}, {"type": "text", "text": "ok"}))
    prompt = answer.usage.input_tokens + answer.usage.cache_read_input_tokens  # Anthropic's input_tokens: uncached
    assert counted.input_tokens == as_text.input_tokens == prompt


async def test_responses_refuse_a_user_image_and_replace_one_in_a_function_output(oai):
    image = {"type": "input_image", "image_url": PNG}
    with pytest.raises(openai.BadRequestError) as e:
        await oai.responses.create(model="tiny", max_output_tokens=4, input=[
            {"role": "user", "content": [{"type": "input_text", "text": "what is this?"}, image]}])
    assert "'tiny' reads text only" in e.value.body["message"]
    history = [{"role": "user", "content": "weather?"},
               {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
               {"type": "function_call_output", "call_id": "call_1", "output": [image]}]
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}]
    answer = await oai.responses.create(model="tiny", max_output_tokens=20, tools=tools, input=history)
    assert answer.output_text == "It is sunny in Paris."


@pytest.mark.parametrize("content, flag", [
    ([image_part()] * 4, "--max-images"),
    ([image_part(data_url(picture(400, 300)))], "--max-image-pixels"),
    ([image_part(data_url(picture(form="BMP"), "image/bmp"))], "image/png, image/jpeg"),
    ([image_part(data_url(picture(form="BMP")))], "not a PNG, JPEG, WebP or GIF image"),
    ([image_part(data_url(picture()[:60]))], "cannot be decoded"),
    ([image_part("data:image/png;base64,@@@@")], "not base64"),
    ([image_part("data:image/png,rawbytes")], "base64"),
    ([image_part("file:///etc/passwd")], "data URL"),
])
async def test_a_bad_image_is_a_400_naming_what_is_wrong(oai, content, flag):
    with pytest.raises(openai.BadRequestError) as e:
        await oai.chat.completions.create(model="tiny", max_tokens=4, tools=[WEATHER],
                                          messages=chat_tool_result(*content))
    assert flag in e.value.body["message"], e.value.body


async def test_a_data_url_over_the_body_limit_is_a_413_naming_its_flag(daemon):
    huge = "data:image/png;base64," + "A" * LIMITS["max_body_bytes"]
    async with aiohttp.ClientSession() as http:
        async with http.post(daemon.url + "/v1/messages", json={
                "model": "tiny", "max_tokens": 4, "messages": claude_tool_result(claude_image())[:2] + [
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [
                        {"type": "image", "source": {"type": "url", "url": huge}}]}]}]}) as r:
            assert r.status == 413 and "--max-body-bytes" in (await r.json())["error"]["message"]


async def test_images_refuse_makes_a_tool_results_image_a_400(agent_model):  # noqa: F811
    async with serving(agent_model, scripted(agent_model, reply), served_model_name=["tiny"], images="refuse") as d:
        async with openai.AsyncOpenAI(base_url=d.url + "/v1", api_key="unused", max_retries=0) as oai:
            with pytest.raises(openai.BadRequestError) as e:
                await oai.chat.completions.create(model="tiny", max_tokens=4, tools=[WEATHER],
                                                  messages=chat_tool_result(image_part()))
    assert "inside a tool result" in e.value.body["message"] and e.value.body["code"] == "unsupported_content"
