"""Reuse at --kv-cache-dtype int8 and int4 over HTTP, on torch and MLX and a tiny llama whose heads are 64
wide (groups of 64 divide them): a prefix cache hit, n choices, requests sharing a prefix while one runs, a
named session's next turn and a restart served from the disk tier each answer as the same request with
reuse off (another cache_salt: nothing to reuse), token for token. A restart at another storage reads
none of the files. At int8, speculative decoding (a scripted drafter; a verify pass's rejected drafts
rolled back in the stored rows) keeps the greedy text of a daemon without it."""

from __future__ import annotations

import asyncio

import pytest

from http_daemon import metrics, serving
from kvfork.backends import create_backend
from scripted_drafts import ScriptedDrafts
from tiny_models import write_model

CHAT = "/v1/chat/completions"
SYSTEM = "read the file and search the code for the error in the test then write the answer " * 24
OTHER = "open the shared agent cache and list every long prompt token the server sent first " * 24
ENGINE = dict(prefix_cache_entries=2, prefix_cache_disk_bytes=1 << 30)

pytestmark = pytest.mark.usefixtures("disk_beats_prefill")  # api/conftest.py: restoring is worth it


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory) -> str:
    return str(write_model(tmp_path_factory.mktemp("wide-llama"), "llama", head_dim=64))


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


async def ask(http, daemon, messages: list[dict], salt: str = "", **extra) -> tuple[list[str], int]:
    """Each choice's text, and the prompt tokens reused; a salt puts the request in a scope of its own."""
    body = {"messages": messages, "temperature": 0, "max_tokens": 12, "ignore_eos": True, **extra}
    if salt:
        body["cache_salt"] = f"reuse-off-{salt}".ljust(16, "-")
    async with http.post(daemon.url + CHAT, json=body) as r:
        assert r.status == 200, await r.text()
        reply = await r.json()
    return [c["message"]["content"] for c in reply["choices"]], reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def daemon_at(model: str, backend: str, dtype: str):
    return serving(model, create_backend(backend), engine=dict(ENGINE, kv_cache_dtype=dtype))


@pytest.mark.parametrize("backend,dtype,other", [("torch", "int8", "int4"), ("torch", "int4_per_token_head", "int8"),
                                                 ("mlx", "int8", "int4"), ("mlx", "int4", "int8")])
async def test_reuse_answers_as_reuse_off_at_a_quantized_storage(http, wide_llama, kvfork_home, backend, dtype, other):
    asked = SYSTEM + "now fix it"
    async with daemon_at(wide_llama, backend, dtype) as daemon:
        assert daemon.engine.info.kv_dtype.startswith(dtype[:4])
        await ask(http, daemon, user(SYSTEM + "first read it"))
        cold, reused = await ask(http, daemon, user(asked), salt="hit")
        assert reused == 0
        hit, reused = await ask(http, daemon, user(asked))
        assert reused > 0 and hit == cold  # the prefix cache
        choices, _ = await ask(http, daemon, user(asked), n=3)
        assert choices == cold * 3  # choices 1 and 2 start from clones of choice 0's prompt

        together = [user(OTHER + "one"), user(OTHER + "two, at length")]
        alone = [(await ask(http, daemon, m, salt=f"run{i}", max_tokens=24))[0] for i, m in enumerate(together)]
        both = await asyncio.gather(*(ask(http, daemon, m, max_tokens=24) for m in together))
        assert [texts for texts, _ in both] == alone
        assert max(reused for _, reused in both) > 0  # one followed, cloned or hit the other's prefix

        first, _ = await ask(http, daemon, user(SYSTEM + "a turn"), session_id="agent")
        turn = [*user(SYSTEM + "a turn"), {"role": "assistant", "content": first[0]}, *user("and the next")]
        cold_turn, _ = await ask(http, daemon, turn, salt="turn")
        warm_turn, reused = await ask(http, daemon, turn, session_id="agent")
        assert reused > 0 and warm_turn == cold_turn  # the named session's state
    async with daemon_at(wide_llama, backend, dtype) as daemon:  # a restart: the files are the prefix cache
        restored, reused = await ask(http, daemon, user(asked))
        assert reused > 0 and restored == cold
        assert daemon.engine.stats().on_disk > 0
    async with daemon_at(wide_llama, backend, other) as daemon:  # another storage: another fingerprint
        _, reused = await ask(http, daemon, user(asked))
        assert reused == 0


@pytest.mark.parametrize("backend", ["torch", "mlx"])
async def test_greedy_text_at_int8_is_the_same_with_speculation_on(http, wide_llama, backend):
    prompts = [user("the capital of France"), user("a list of colours: red, green")]
    texts = {}
    for drafts in (None, ScriptedDrafts()):  # the drafter's second round drafts from what it wrote
        speculative = "off" if drafts is None else "suffix"
        engine = dict(prefix_cache_entries=0, kv_cache_dtype="int8", speculative=speculative)
        async with serving(wide_llama, create_backend(backend), load=False, engine=engine) as daemon:
            if drafts is not None:
                daemon.engine.drafts = drafts
            await daemon.load()
            rounds = 1 if drafts is None else 2
            texts[drafts is None] = [(await ask(http, daemon, m, max_tokens=24))[0] for m in prompts * rounds]
            read = await metrics(http, daemon.url)
    drafted, accepted = (sum(v for k, v in read.items() if k.startswith(f"kvfork_spec_{kind}_tokens_total"))
                         for kind in ("drafted", "accepted"))
    assert drafted > accepted > 0  # drafts were rejected, so rolled back
    assert texts[False] == texts[True] * 2
