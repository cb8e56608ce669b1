"""Every reuse operation of the backend interface, run on one model: in one process (the reference),
or on 2 ranks (this file as a script, under a launcher), rank 0 through its LockstepBackend.

    python tests/distributed_scenario.py BACKEND OUT_DIR FOLDER [FOLDER ...]

Each rank writes OUT_DIR/rank<r>.json: per model folder, what it holds (weight bytes, KV bytes per
token, a session's bytes, live sessions at the end) and, on rank 0, every call's logits and sampled
tokens, or the error its load raised. The test (cluster/test_distributed_backends.py) compares rank 0's
record with the reference's.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from kvfork.backends.base import Backend, CloneRefused, SamplerState, SamplingParams


def prompt(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 500, n)]


class Record:
    def __init__(self, backend: Backend):
        self.b, self.steps = backend, []

    def run(self, what: str, sessions: list, logits: Any) -> list[int]:
        """Keep a call's logits and the greedy tokens rank 0 samples from them (the next decode's rows)."""
        picks = self.b.sample(logits, [SamplerState(SamplingParams()) for _ in sessions])
        tokens = [p.token for p in picks]
        self.steps.append({"what": what, "logits": np.asarray(self.b.to_numpy(logits), np.float32).tolist(),
                           "tokens": tokens})
        return tokens

    def clone(self, what: str, session, upto: int):
        try:
            clone = self.b.clone(session, upto)
        except CloneRefused as refusal:
            self.steps.append({"what": what, "refused": refusal.reason})
            return None
        self.steps.append({"what": what, "position": clone.position})
        return clone


def scenario(b: Backend) -> dict:
    """open, keep_at, chunked and batched prefill, clones (at the position, mid-prompt or at a checkpoint),
    move_checkpoints, batched decode, a release mid-way (a cancel), export and import."""
    r = Record(b)
    a, c = prompt(70, 1), prompt(48, 1) + prompt(20, 2)
    s1 = b.open_session()
    b.keep_at(s1, [20, 40])  # checkpoints of the recurrent state (nothing to keep elsewhere)
    r.run("prefill 0-30", [s1], b.prefill([s1], [a[:30]]))
    r.run("prefill 30-48", [s1], b.prefill([s1], [a[30:48]]))
    s2 = r.clone("clone at 48 (its position)", s1, 48)
    r.run("prefill both tails", [s1, s2], b.prefill([s1, s2], [a[48:], c[48:]]))
    s5 = r.clone("clone at 40 (mid-prompt, or a checkpoint)", s1, 40)
    b.move_checkpoints(s1, s2)
    s6 = r.clone("clone at 20 (a moved checkpoint)", s2, 20)
    tokens = r.run("first tokens", [s1, s2], b.prefill([s1, s2], [[a[-1]], [c[-1]]]))
    for step in range(4):
        tokens = r.run(f"decode {step}", [s1, s2], b.decode([s1, s2], tokens))
    s3 = r.clone("clone at its position", s2, s2.position)
    b.release(s1)  # a cancelled request
    tokens = r.run("decode after a release", [s2, s3], b.decode([s2, s3], [tokens[1], tokens[1]]))
    saved = b.export_state(s3)
    s4 = b.import_state(saved)
    b.release(s3)
    for step in range(2):
        tokens = r.run(f"decode an imported state {step}", [s2, s4], b.decode([s2, s4], tokens))
    held = {"session_bytes": b.session_bytes(s2), "saved_bytes": saved.nbytes}
    for s in (s2, s4, s5, s6):
        if s is not None:
            b.release(s)
    return {"steps": r.steps, **held, "live_after": b.live_sessions(), "total_after": b.total_bytes()}


def weight_bytes(backend: Backend) -> int:
    """Bytes of the model's weights as this process holds them."""
    model = backend.model  # type: ignore[attr-defined]
    if type(backend).__name__ == "TorchBackend":  # parameters, and the packed copies of linear layers
        from kvfork.backends.torch.packed_linear import PackedLinear

        packed = sum(m.packed.numel() * 4 for m in model.modules() if isinstance(m, PackedLinear))
        return packed + sum(p.numel() * p.element_size() for p in model.parameters())
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def figures(backend: Backend) -> dict:
    return {"weight_bytes": weight_bytes(backend), "kv_bytes_per_token": backend.info.kv.full_bytes_per_token,
            "state_bytes": backend.info.kv.state_bytes}


def main(argv: list[str]) -> int:
    from kvfork.backends.lockstep import join
    from kvfork.backends.lockstep.follower import Follower
    from kvfork.backends.lockstep.leader import LockstepBackend

    name, out, folders = argv[0], Path(argv[1]), argv[2:]
    ranks = join(name)
    report: dict[str, Any] = {}
    for folder in folders:
        if ranks.rank == 0:
            leader = LockstepBackend(ranks.backend, ranks.channel, timeout=300)
            try:
                leader.load(folder, "float32")
            except ValueError as e:
                report[folder] = {"error": str(e)}
                continue
            report[folder] = {**scenario(leader), **figures(ranks.backend)}
            leader.stop("next model")
        else:
            follower = Follower(ranks.backend, ranks.channel)
            try:
                follower.run()
            except ValueError as e:  # the load refused, as on rank 0
                report[folder] = {"error": str(e)}
                continue
            report[folder] = {**figures(ranks.backend), "live_after": follower.open_at_stop}
        ranks.backend = type(ranks.backend)(*_same_place(ranks))  # a fresh backend for the next model
    (out / f"rank{ranks.rank}.json").write_text(json.dumps(report))
    ranks.close()
    return 0


def _same_place(ranks) -> tuple:
    b = ranks.backend
    return (b.group,) if ranks.framework == "mlx" else (str(b.device), b.shards)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
