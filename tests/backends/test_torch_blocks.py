"""Clone by reference on the torch backend (backends/torch/kv.py): blocks shared below a clone's `upto`,
reference counts, writes that never reach a shared block, and answers equal to a cold session's."""

from __future__ import annotations

import os

import numpy as np
import pytest

import backend_fixtures
from backend_fixtures import assert_close, assert_greedy_close, lent
from kvfork.backends.torch import kv
from kvfork.backends.torch.backend import TorchBackend
from tolerance import Kind

DEVICE = os.environ.get("KVFORK_DEVICE", "cpu")
B = kv.BLOCK_TOKENS


def load(folder: str, mode: str = "share") -> TorchBackend:
    b = TorchBackend(DEVICE)
    b.set_clone_mode(mode)  # type: ignore[arg-type]
    return backend_fixtures.load(b, folder)


@pytest.fixture
def llama(request, tiny_model_dir) -> TorchBackend:
    """A loaded float32 backend (backend_fixtures.lent), cloning by reference."""
    yield from lent(request, ("torch", "llama", DEVICE), lambda: load(tiny_model_dir("llama")))


def tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 500, n).tolist()


def greedy(b: TorchBackend, logits) -> list[int]:
    return b.to_numpy(logits).argmax(-1).tolist()


def test_a_clone_reads_the_whole_blocks_below_it_and_owns_one(llama):
    kv_cost, before = llama.info.kv, llama.total_bytes()
    donor = llama.open_session()
    llama.prefill([donor], [tokens(1, 700)])
    clone = llama.clone(donor, 700)
    (read, end), = clone.table.reads
    assert read is donor.table.own and end == 2 * B  # the donor's store, not a copy
    assert llama.session_bytes(clone) == B * kv_cost.full_bytes_per_token  # the partial block's, copied
    assert llama.session_bytes(clone) == kv_cost.bytes_for(700, shared=kv_cost.shared(700), start=700)
    stats = llama.block_stats()
    assert (stats.blocks, stats.shared) == (3 + 1, 2)
    assert stats.saved_bytes == 2 * llama.pool.block_bytes
    llama.release(donor)
    llama.release(clone)
    assert llama.total_bytes() == before and not llama.pool.stores


def test_a_block_shared_by_n_sessions_is_freed_after_the_last(llama):
    before = llama.total_bytes()
    donor = llama.open_session()
    llama.prefill([donor], [tokens(2, 700)])
    store = donor.table.own
    clones = [llama.clone(donor, 700 - i) for i in range(3)]
    assert llama.block_stats().saved_bytes == 3 * 2 * llama.pool.block_bytes
    llama.release(donor)  # its store is read by three: pooled, counted once
    assert llama.pooled_bytes() == store.nbytes and store.id in llama.pool.stores
    own = llama.session_bytes(clones[0])
    assert llama.total_bytes() == before + store.nbytes + 3 * own
    assert [llama.release_frees(c) for c in clones] == [own] * 3  # the others still read the store
    llama.release(clones[0])
    llama.release(clones[1])
    assert llama.release_frees(clones[2]) == own + store.nbytes  # the last reader
    assert store.id in llama.pool.stores
    llama.release(clones[2])
    assert store.id not in llama.pool.stores and llama.pooled_bytes() == 0 and llama.total_bytes() == before


def test_copy_mode_copies_it_all(tiny_model_dir):
    b = load(tiny_model_dir("llama"), "copy")
    assert not b.info.kv.shares and b.info.kv.shared(700) == 0
    donor = b.open_session()
    b.prefill([donor], [tokens(3, 700)])
    clone = b.clone(donor, 700)
    assert clone.table.reads == [] and b.session_bytes(clone) == b.info.kv.bytes_for(700, start=700)
    assert b.block_stats().shared == 0


def test_a_read_store_is_frozen_not_copied_when_its_writer_grows(llama):
    """The donor writes past its store while a clone reads it: a new store takes its next positions;
    the shared one stays where it is, and the donor holds exactly what a session of its length costs."""
    donor = llama.open_session()
    llama.prefill([donor], [tokens(4, 700)])
    clone = llama.clone(donor, 600)
    shared = donor.table.own
    pointers = [t.data_ptr() for t in shared.keys]
    llama.prefill([donor], [tokens(5, 200)])  # 900: past the store's 768
    assert donor.table.reads == [(shared, 768)] and donor.table.own.base == 768
    assert [t.data_ptr() for t in shared.keys] == pointers
    assert llama.session_bytes(donor) == llama.info.kv.bytes_for(900)
    llama.release(donor)
    llama.release(clone)
    assert not llama.pool.stores


def cold(b: TorchBackend, prompt: list[int], chunk: int, steps: int) -> tuple[list[int], list[np.ndarray]]:
    """Greedy tokens, and the logits each was picked from, of a session that computes everything itself."""
    s = b.open_session()
    for at in range(0, len(prompt), chunk):
        logits = b.prefill([s], [prompt[at:at + chunk]])
    out, seen = [], []
    for _ in range(steps):
        seen.append(b.to_numpy(logits)[0])
        out.append(greedy(b, logits)[0])
        logits = b.decode([s], [out[-1]])
    b.release(s)
    return out, seen


def together(b: TorchBackend, donor_prompt: list[int], upto: int, tail: list[int], steps: int):
    """A donor prefills, a clone at `upto` gets `tail` and both decode greedily in the same passes
    (the donor writing past the blocks the clone reads). Returns each one's tokens, and the logits
    each was picked from."""
    donor = b.open_session()
    for at in range(0, len(donor_prompt), 300):
        donor_logits = b.prefill([donor], [donor_prompt[at:at + 300]])
    clone = b.clone(donor, upto)
    got = {"donor": ([], []), "clone": ([], [])}
    next_donor = greedy(b, donor_logits)[0]
    got["donor"][0].append(next_donor)
    got["donor"][1].append(b.to_numpy(donor_logits)[0])
    logits = b.prefill([donor, clone], [[next_donor], tail])
    for step in range(steps):
        rows = b.to_numpy(logits)
        picks = rows.argmax(-1).tolist()
        for i, name in enumerate(("donor", "clone")):
            if name == "donor" and step == steps - 1:
                continue
            got[name][0].append(picks[i])
            got[name][1].append(rows[i])
        logits = b.decode([donor, clone], picks)
    b.release(donor)
    b.release(clone)
    return got


HYBRIDS = ("qwen3_5", "qwen3_5_moe", "qwen3_next")


@pytest.mark.numeric
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3", *HYBRIDS])
@pytest.mark.parametrize("mode", ["share", "copy"])
def test_a_clone_and_its_donor_give_what_each_computes_alone(arch, mode, tiny_model_dir, tiny_hybrid_dir):
    """Each keeps writing after the clone, in the same passes: neither sees the other's writes, and
    each one's greedy tokens and logits equal a cold session's (tolerance.py)."""
    b = load(tiny_hybrid_dir(arch) if arch in HYBRIDS else tiny_model_dir(arch), mode)
    prompt, tail, steps = tokens(6, 600), tokens(7, 45), 12
    got = together(b, prompt, 600, tail, steps)
    # the donor: its prompt, then its own tokens
    assert_greedy_close(b, got["donor"], cold(b, prompt, 300, steps), Kind.BLOCKS, context=600 + steps)
    # the clone: the donor's prompt and its tail, then its own tokens
    assert_greedy_close(b, got["clone"], cold(b, prompt + tail, 300, steps), Kind.BLOCKS, context=645 + steps)
    assert b.live_sessions() == 0 and not b.pool.stores


@pytest.mark.numeric
def test_a_clone_of_a_clone_reads_three_runs(llama):
    """A clone of a grown clone reads the first donor's blocks and the middle one's, and decodes over
    three runs (attention.decode_runs) to the answers of a cold session."""
    prompt = tokens(8, 1000)
    first = llama.open_session()
    llama.prefill([first], [prompt[:700]])
    middle = llama.clone(first, 600)
    llama.prefill([middle], [prompt[600:1000]])  # grows its own store from 512 (nobody reads it yet)
    last = llama.clone(middle, 900)
    assert [(s.base, end) for s, end in last.table.reads] == [(0, 512), (512, 768)]
    logits = llama.decode([last], [prompt[900]])
    for t in prompt[901:905]:
        logits = llama.decode([last], [t])
    s = llama.open_session()
    want = llama.prefill([s], [prompt[:905]])
    assert_close(llama, logits, want, Kind.BLOCKS, context=905)
    for x in (first, middle, last, s):
        llama.release(x)
    assert not llama.pool.stores


def test_a_failed_clone_holds_nothing(tiny_model_dir, monkeypatch):
    """The ring copy fails after the clone's blocks were taken: they are given back (gemma3: rings)."""
    b = load(tiny_model_dir("gemma3"))
    donor = b.open_session()
    b.prefill([donor], [tokens(9, 600)])
    before, stores = b.total_bytes(), set(b.pool.stores)

    def broken(self, upto):
        raise RuntimeError("no memory")

    monkeypatch.setattr(kv.RingKV, "copy_prefix", broken)
    with pytest.raises(RuntimeError):
        b.clone(donor, 600)
    assert b.total_bytes() == before and set(b.pool.stores) == stores
    assert all(not s.readers for s in b.pool.stores.values()) and b.live_sessions() == 1


@pytest.mark.numeric
@pytest.mark.parametrize("gathered", ["short", "long"])
def test_a_group_sharing_a_prefix_decodes_as_each_alone(llama, monkeypatch, gathered):
    """Cascade: decode rows that read the same blocks (the donor, which reads them in its one run, among
    them) read them once for the group (one product of all their queries), merged with each row's own
    keys by log-sum-exp, read in one padded batch (short) or row by row (long): the logits each gets alone."""
    from kvfork.backends.torch import attention

    calls = []
    real = attention.cascade
    monkeypatch.setattr(attention, "cascade", lambda *a: calls.append(len(a[1])) or real(*a))
    if gathered == "long":
        monkeypatch.setattr(attention, "GATHERED_TOKENS", 0)
    prompt = tokens(10, 700)
    donor = llama.open_session()
    llama.prefill([donor], [prompt])
    uptos, picks = [700, 697, 694, 691, 700], [5, 6, 7, 8, 9]
    clones = [llama.clone(donor, upto) for upto in uptos[:4]]
    together = llama.to_numpy(llama.decode(clones + [donor], picks))
    assert calls and calls[0] == 5  # one group of five, in every full layer
    alone = []
    for upto, pick in zip(uptos, picks):  # the donor's own step too: a clone holding what it held
        again = llama.clone(donor, upto)
        alone.append(llama.to_numpy(llama.decode([again], [pick]))[0])
        llama.release(again)
    assert_close(llama, together, np.array(alone), Kind.BLOCKS, context=701)
    for s in (donor, *clones):
        llama.release(s)
