"""The default model (converted SmolLM2-135M) on the torch backend: the same greedy tokens
as mlx-lm for a handful of short chats, and the Paris answer."""

from __future__ import annotations

import pytest

mx = pytest.importorskip("mlx.core", exc_type=ImportError)
mlx_lm = pytest.importorskip("mlx_lm", exc_type=ImportError)
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from kvfork.backends.base import SamplerState, SamplingParams  # noqa: E402
from kvfork.backends.torch.backend import TorchBackend  # noqa: E402
from kvfork.backends import default_model  # noqa: E402

QUESTIONS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue? One sentence.",
)
STEPS = 16

pytestmark = pytest.mark.default_model


@pytest.fixture(scope="module")
def both():
    folder = str(default_model.ensure_default_model())
    reference, tokenizer = mlx_lm.load(folder)
    backend = TorchBackend("cpu")
    backend.load(folder, "float32")
    return reference, tokenizer, backend


def _chat(tokenizer, question: str) -> list[int]:
    tokens = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
    assert len(tokens) < 100
    return list(tokens)


def _mlx_greedy(reference, prompt: list[int]) -> list[int]:
    cache = make_prompt_cache(reference)
    logits = reference(mx.array([prompt]), cache=cache)[0, -1]
    out = []
    for _ in range(STEPS):
        out.append(int(mx.argmax(logits)))
        logits = reference(mx.array([[out[-1]]]), cache=cache)[0, -1]
    return out


def _torch_greedy(backend: TorchBackend, prompt: list[int]) -> list[int]:
    session, state = backend.open_session(), SamplerState(SamplingParams(), prompt=prompt)
    logits = backend.prefill([session], [prompt])
    for _ in range(STEPS):
        logits = backend.decode([session], [backend.sample(logits, [state])[0].token])
    backend.release(session)
    return state.output


@pytest.mark.parametrize("question", QUESTIONS)
def test_same_greedy_tokens_as_mlx_lm(both, question):
    reference, tokenizer, backend = both
    prompt = _chat(tokenizer, question)
    assert _torch_greedy(backend, prompt) == _mlx_greedy(reference, prompt)


def test_answers_paris(both):
    _, tokenizer, backend = both
    answer = tokenizer.decode(_torch_greedy(backend, _chat(tokenizer, QUESTIONS[0])))
    assert "Paris" in answer
