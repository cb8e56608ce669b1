"""`kvfork smoke`: active prefix reuse on a real model, end to end, in a few minutes.

1. Start the daemon with reuse at a low threshold.
2. Send a request whose prompt is 1,000 tokens or more (the donor).
3. When it streams its first token, send a second one sharing its prompt
   except the last message (the recipient).
4. Report reused against prompt tokens: all but the new tail is expected.
5. On a second daemon with reuse and the prefix cache off, send both again
   (fresh prefills): the recipient's tokens, and the donor's, must be the same.
Exits 1 if either check fails, 2 if the smoke itself cannot run.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path

import aiohttp

from kvfork.tools.bench import paired
from kvfork.tools.bench.client import Record, Target, request_body, stream_chat
from kvfork.tools.bench.serve import ServerFailed, exit_on_sigterm, metric_total, scrape_metrics
from kvfork.tools.bench.text import tool_definitions, words


def conversation(prompt_tokens: int, seed: int) -> tuple[list[dict], list[dict]]:
    """Two chats sharing every message but the last."""
    rng = random.Random(seed)
    shared = [
        {"role": "system", "content": tool_definitions(rng, prompt_tokens)},
        {"role": "user", "content": f"Task: {words(rng, 30)}"},
        {"role": "assistant", "content": f"Calling tool_1: {words(rng, 12)}"},
    ]
    donor = shared + [{"role": "user", "content": f"Tool result: {words(rng, 40)}"}]
    recipient = shared + [{"role": "user", "content": f"Sub-task: {words(rng, 25)}"}]
    return donor, recipient


def chat_ids(model: str, messages: list[dict]) -> list[int]:
    """The prompt's token ids, as the server's chat template makes them."""
    from transformers import AutoTokenizer

    out = AutoTokenizer.from_pretrained(model).apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def shared_length(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


async def donor_then_recipient(base_url: str, donor: list[dict], recipient: list[dict], max_tokens: int,
                               together: bool) -> tuple[Record, Record]:
    """Together: the recipient goes out on the donor's first token. Otherwise one after the other."""
    t0 = time.monotonic()
    target = Target(base_url)
    first_token = asyncio.Event()
    rec_d, rec_r = Record("donor", "donor", "lead"), Record("recipient", "recipient", "recipient")
    async with aiohttp.ClientSession() as http:
        body_d = request_body(donor, max_tokens, None, logprobs=True)
        body_r = request_body(recipient, max_tokens // 4, None, logprobs=True)
        task = asyncio.create_task(stream_chat(http, target, rec_d, body_d, t0, first_token.set))
        if together:
            waiter = asyncio.create_task(first_token.wait())
            await asyncio.wait([task, waiter], return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
        else:
            await task
        await stream_chat(http, target, rec_r, body_r, t0)
        await task
    return rec_d, rec_r


def _pass(label: str, mode: str, args, model: str, donor, recipient, together: bool, extra: tuple[str, ...] = ()):
    contender = paired.kvfork_contender(mode, model, args.threshold, [*args.server_arg, *extra])
    with contender.make(Path(args.out) / f"smoke-{label}.log") as srv:
        before = scrape_metrics(srv.base_url)
        recs = asyncio.run(donor_then_recipient(srv.base_url, donor, recipient, args.max_tokens, together))
        after = scrape_metrics(srv.base_url)
    delta = paired.counter_delta(before, after)
    sources = {src: metric_total(delta, paired.REUSED, source=src) for src in ("donor", "cache")}
    for rec in recs:
        if not rec.ok:
            raise ServerFailed(f"{label}: the {rec.call_id} request failed: {rec.error}")
    return recs, sources


def _same(a: Record, b: Record) -> tuple[bool, str]:
    if a.tokens and b.tokens:
        return a.tokens == b.tokens, f"{len(a.tokens)} tokens (compared one by one)"
    return a.text == b.text, "text (the server sent no per-token logprobs)"


def run(args) -> int:
    model = args.model or paired.default_model()
    donor, recipient = conversation(args.prompt_tokens, args.seed)
    ids_d, ids_r = chat_ids(model, donor), chat_ids(model, recipient)
    shared = shared_length(ids_d, ids_r)
    print(f"smoke: model {model}; donor prompt {len(ids_d)} tokens, recipient {len(ids_r)}, shared {shared}")
    if len(ids_d) < 1000:
        print("smoke: the donor prompt is under 1,000 tokens; raise --prompt-tokens", file=sys.stderr)
        return 2
    (on_d, on_r), sources = _pass("reuse-on", "on", args, model, donor, recipient, together=True)
    # The reference computes every token itself: no donor and no prefix cache.
    (off_d, off_r), _ = _pass("fresh", "off", args, model, donor, recipient, together=False,
                              extra=("--prefix-cache-entries", "0"))

    donor_end = on_d.send_s + on_d.e2e_s
    overlapped = on_r.send_s < donor_end
    expected = shared - (len(ids_r) - on_r.prompt_tokens)  # the server's count, should it differ from ours
    reused = on_r.cached_tokens or 0
    reuse_ok = overlapped and reused >= expected
    print(f"reuse: recipient reused {reused} of {on_r.prompt_tokens} prompt tokens; "
          f"new tail {on_r.prompt_tokens - reused} (expected {on_r.prompt_tokens - expected})"
          + "".join(f"; the server counted {n:,.0f} reused from {src}" for src, n in sources.items() if n))
    if not overlapped:
        print("  the donor finished before the recipient was sent: no active reuse was possible "
              "(raise --max-tokens)")
    same_r, how_r = _same(on_r, off_r)
    same_d, how_d = _same(on_d, off_d)
    print(f"exactness: recipient vs fresh prefill: {'same' if same_r else 'DIFFERENT'} {how_r}; "
          f"donor vs fresh: {'same' if same_d else 'DIFFERENT'} {how_d}")
    print(f"TTFT: recipient {on_r.ttft_s:.2f}s with reuse, {off_r.ttft_s:.2f}s fresh; donor {on_d.ttft_s:.2f}s")
    fresh = not (off_r.cached_tokens or off_d.cached_tokens)
    if not fresh:
        print("  the reference reused tokens: it was not a fresh prefill")
    ok = reuse_ok and fresh and same_r and same_d
    print("smoke: PASS" if ok else "smoke: FAIL")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvfork smoke", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model folder (default: the default model, fetched if needed)")
    ap.add_argument("--threshold", type=int, default=64, help="--active-prefix-reuse-min-tokens (default: 64)")
    ap.add_argument("--prompt-tokens", type=int, default=1200, help="size of the shared system prompt, about")
    ap.add_argument("--max-tokens", type=int, default=96, help="the donor's output; the recipient gets a quarter")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--server-arg", action="append", default=[], metavar="ARG", help="extra daemon flag, repeatable")
    ap.add_argument("--out", default="out/smoke", help="where the daemons' logs go")
    args = ap.parse_args(argv)
    exit_on_sigterm()
    try:
        return run(args)
    except ServerFailed as e:
        print(f"smoke: could not run: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
