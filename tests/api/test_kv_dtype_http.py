"""Reuse at --kv-cache-dtype int8 and int4 over HTTP, on torch and MLX and tiny models whose heads are 64
wide (groups of 64 divide them): llama, qwen3, gemma3 (sliding layers' rings) and a hybrid (qwen3_next:
Gated DeltaNet layers, whose recurrent states stay in full precision, beside attention stored quantized),
each on both backends and at both storages among them. A prefix cache hit, n choices, requests sharing a
prefix while one runs, a named session's next turn and a restart served from the disk tier each answer as
the same request with reuse off (another cache_salt: nothing to reuse), token for token. A restart at
another storage reads none of the files. At int8, speculative decoding (a scripted drafter; a verify pass's
rejected drafts rolled back in the stored rows) keeps the greedy text of a daemon without it.

With --batch-invariant, the same on a llama of the default model's widths (hidden 576, heads of 64, MLP 1536;
random weights), where the kernels' order of summation changes with a pass's shapes: there reuse is exact
because every path computes a position's keys and values bit for bit alike (tests/backends/test_batch_invariant.py,
test_mlx_batch_invariant.py)."""

from __future__ import annotations

import asyncio

import pytest

from http_daemon import metrics, reuse_off, serving
from kvfork.backends import create_backend
from scripted_drafts import ScriptedDrafts
from tiny_hybrid_models import write_hybrid_model
from tiny_models import REAL_WIDTHS, write_model

CHAT = "/v1/chat/completions"
SYSTEM = "read the file and search the code for the error in the test then write the answer " * 24
OTHER = "open the shared agent cache and list every long prompt token the server sent first " * 24
ENGINE = dict(prefix_cache_entries=2, prefix_cache_disk_bytes=1 << 30)
REAL = "llama-576"  # a llama of the default model's widths (tiny_models.REAL_WIDTHS), served with --batch-invariant

pytestmark = pytest.mark.usefixtures("disk_beats_prefill")  # api/conftest.py: restoring is worth it


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """A function arch -> folder of a tiny model with heads 64 wide, each written once."""
    made: dict[str, str] = {}

    def get(arch: str) -> str:
        if arch not in made:
            folder = tmp_path_factory.mktemp(f"wide-{arch}")
            made[arch] = str(write_hybrid_model(folder, arch, head_dim=64) if arch == "qwen3_next"
                             else write_model(folder, "llama", **REAL_WIDTHS) if arch == REAL
                             else write_model(folder, arch, head_dim=64))
        return made[arch]

    return get


@pytest.fixture(scope="module")
def wide_llama(wide) -> str:
    return wide("llama")


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def chat(system: str, text: str) -> list[dict]:
    return [{"role": "system", "content": system}, *user(text)]


async def ask(http, daemon, messages: list[dict], salt: str = "", **extra) -> tuple[list[str], int]:
    """Each choice's text, and the prompt tokens reused; a salt puts the request in a scope of its own."""
    body = {"messages": messages, "temperature": 0, "max_tokens": 12, "ignore_eos": True, **extra}
    if salt:
        body.update(reuse_off(salt))
    async with http.post(daemon.url + CHAT, json=body) as r:
        assert r.status == 200, await r.text()
        reply = await r.json()
    return [c["message"]["content"] for c in reply["choices"]], reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def daemon_at(model: str, backend: str, dtype: str, batch_invariant: bool = False):
    return serving(model, create_backend(backend), engine=dict(ENGINE, kv_cache_dtype=dtype,
                                                                batch_invariant=batch_invariant))


# (arch, backend, storage, another storage): every arch on both backends, at int8 on one and int4 on the other
CASES = [("llama", "torch", "int8", "int4"), ("llama", "torch", "int4_per_token_head", "int8"),
         ("llama", "mlx", "int8", "int4"), ("llama", "mlx", "int4", "int8"),
         ("qwen3", "torch", "int4", "int8"), ("qwen3", "mlx", "int8", "int4"),
         ("gemma3", "torch", "int8", "int4"), ("gemma3", "mlx", "int4", "int8"),
         ("qwen3_next", "torch", "int8", "int4"), ("qwen3_next", "mlx", "int4", "int8"),
         (REAL, "torch", "int8", "int4"), (REAL, "torch", "int4", "int8"), (REAL, "mlx", "int8", "int4")]
# A sliding layer's ring keeps only its last window, so a prompt that forks from a cached one before its end
# (another last message) or from a running one cannot start from it; a whole prompt again can.
SLIDING = {"gemma3"}


@pytest.mark.parametrize("arch,backend,dtype,other", CASES)
async def test_reuse_answers_as_reuse_off_at_a_quantized_storage(http, wide, kvfork_home, arch, backend, dtype, other):
    asked, model, forks, invariant = chat(SYSTEM, "now fix it"), wide(arch), arch not in SLIDING, arch == REAL
    async with daemon_at(model, backend, dtype, invariant) as daemon:
        assert daemon.engine.info.kv_dtype.startswith(dtype[:4])
        await ask(http, daemon, chat(SYSTEM, "first read it"))
        cold, reused = await ask(http, daemon, asked, salt="hit")
        assert reused == 0
        hit, reused = await ask(http, daemon, asked)  # from the first prompt's (a hybrid: its checkpoint at SYSTEM)
        assert hit == cold and (reused > 0 or not forks)
        again, reused = await ask(http, daemon, asked)  # the whole prompt
        assert reused > 0 and again == cold
        choices, _ = await ask(http, daemon, asked, n=3)
        assert choices == cold * 3  # choices 1 and 2 start from clones of choice 0's prompt

        together = [chat(OTHER, "one"), chat(OTHER, "two, at length")]
        alone = [(await ask(http, daemon, m, salt=f"run{i}", max_tokens=24))[0] for i, m in enumerate(together)]
        both = await asyncio.gather(*(ask(http, daemon, m, max_tokens=24) for m in together))
        assert [texts for texts, _ in both] == alone
        assert max(reused for _, reused in both) > 0 or not forks  # one followed, cloned or hit the other's prefix

        # one token: the session holds the prompt alone, which the next turn extends whatever that token's text
        first, _ = await ask(http, daemon, chat(SYSTEM, "a turn"), session_id="agent", max_tokens=1)
        turn = [*chat(SYSTEM, "a turn"), {"role": "assistant", "content": first[0]}, *user("and the next")]
        cold_turn, _ = await ask(http, daemon, turn, salt="turn")
        warm_turn, reused = await ask(http, daemon, turn, session_id="agent")
        assert reused > 0 and warm_turn == cold_turn  # the named session's state
    async with daemon_at(model, backend, dtype, invariant) as daemon:  # a restart: the files are the prefix cache
        restored, reused = await ask(http, daemon, asked)
        assert reused > 0 and restored == cold
        assert daemon.engine.stats().on_disk > 0
    async with daemon_at(model, backend, other, invariant) as daemon:  # another storage: another fingerprint
        _, reused = await ask(http, daemon, asked)
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
