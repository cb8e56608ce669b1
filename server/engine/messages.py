"""What the control loop and the runner thread say to each other.

Two lock-free deques, one each way. Commands run in the order they were sent, so
a snapshot the loop evicts after naming it in a `Start` is cloned before it is
released. Sessions are named by the runner's session ids (`sid`), never handed
over as objects: only the runner calls into the backend.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvfork.backends.base import BlockStats, ModelInfo, Sampled, SamplingParams
from kvfork.backends.device_memory import DeviceMemory
from kvfork.server.engine.api import Constraint

# ---- control loop -> runner ----


@dataclass
class Choice:
    """One more choice over a request's prompt: it starts from a clone of the request's session at the
    prompt's full length and samples its first token from the prompt's last logits row."""

    rid: int
    sampling: SamplingParams


@dataclass
class Start:
    """Put a request in an inference slot.

    The runner starts it from `resume` (a session it takes over, already holding
    `resume_at` prompt tokens), else from the first of `clone_from` (sid, upto)
    the backend agrees to clone, else from an empty session.

    With `donor` (rid, upto), it starts from a clone of `[0, upto)` of that running
    request's session or not at all: a refused clone comes back as a CloneDone
    without a session, and the loop starts the request again the normal way. The
    clone and the start are one command, so the recipient's tail runs in the very
    next step, with no round trip through the control loop between them.
    """

    rid: int
    prompt: list[int]
    sampling: SamplingParams
    max_tokens: int
    stop_ids: frozenset[int]
    capture: bool  # snapshot the prompt before the first decode (its bytes are reserved: Admission.has_capture)
    keep_session: bool  # a named session: hand the session back at the end instead of releasing it
    resume: int | None = None
    resume_at: int = 0
    clone_from: list[tuple[int, int]] = field(default_factory=list)
    choices: list[Choice] = field(default_factory=list)  # n > 1: the other choices, opened when the prompt is in
    constraint: Constraint | None = None  # the grammar its tokens must follow, or None
    donor: tuple[int, int] | None = None
    keep_at: tuple[int, ...] = ()  # positions its session keeps the recurrent state at (Backend.keep_at)
    scope: str = ""  # whose drafts corpus it reads and adds to (drafts.Drafts.open): its tenant and cache_salt
    images: tuple[Any, ...] = ()  # backends.vision.ImageInput: its prompt's images, encoded past what it reuses


@dataclass
class Cancel:
    rid: int


@dataclass
class Finish:
    rid: int  # the daemon matched a stop string: end as "stop"


@dataclass
class CloneDonor:
    """Clone `[0, upto)` of a running request's session for a follower.

    As soon as the donor has committed `upto`: its prefill chunks stop there and
    the clone runs before the donor writes again, so a sliding window still holds
    what the clone needs. A Cancel of the recipient drops the order. (A clone of
    what a donor has already computed goes with the recipient's Start instead.)
    """

    rid: int  # the recipient
    donor: int
    upto: int
    order: int = 0  # the recipient's arrival order (a gone donor's heir is chosen by it)


@dataclass
class Pause:
    """The request gives its slot up: it leaves the batch, its session, sampler and grammar kept as they are."""

    rid: int


@dataclass
class Unpause:
    """A paused request decodes on from where it stopped."""

    rid: int


@dataclass
class ReleaseSessions:
    """Release these sessions. The runner counts the ReleaseSessions it has run (`Ledger.releases`), so the
    loop knows when the blocks they wrote that others still read have reached the pool."""

    sids: list[int]


@dataclass
class Spill:
    """Export a prefix-cache entry's session to the host for the disk tier, then release it."""

    key: Any  # the loop's name for the entry, sent back with its state
    sid: int


@dataclass
class LoadState:
    """Load a state read from the disk tier into a new session for a parked request (its bytes are held)."""

    rid: int
    state: Any  # backends.base.SavedState, already cut to the tokens it serves


@dataclass
class StopRunner:
    pass


# ---- runner -> control loop ----


@dataclass
class Loaded:
    info: ModelInfo
    device: DeviceMemory  # what the device reports, the loaded weights included (memory_plan.py)


@dataclass
class Started:
    rid: int
    reused: int  # prompt tokens the start did not have to prefill
    clone_index: int | None  # which `clone_from` candidate served it, if one did
    refused: list[str] = field(default_factory=list)  # reasons, for the candidates tried before it
    clone_s: float = 0.0  # how long the clone that served it took
    encoded: int = 0  # images the vision tower ran for at its start (Backend.encode_images)


@dataclass
class Token:
    rid: int
    sampled: Sampled


@dataclass
class Captured:
    rid: int
    tokens: list[int]
    sid: int | None  # None: the backend refused the snapshot, or it failed
    nbytes: int = 0
    failed: bool = False  # the snapshot raised (not a refusal): counted apart
    kept: tuple[int, ...] = ()  # the snapshot's recurrent checkpoints (moved from the request's session)


@dataclass(frozen=True)
class Ledger:
    """What the backend holds, as of one moment on the runner thread: sent after a step (following its
    StepStats), after commands that ran while no step did, and inside an `Ended` (after its session was
    released). The loop's byte view is derived from the last one it read (ledger.LoopLedger)."""

    live_sessions: int = 0  # sessions open (Backend.live_sessions)
    total_bytes: int = 0  # bytes of KV state they hold, each counted once (Backend.total_bytes)
    pooled_bytes: int = 0  # blocks whose writer was released that others still read (Backend.pooled_bytes)
    releases: int = 0  # ReleaseSessions commands run so far: their blocks others read are in `pooled_bytes`
    blocks: BlockStats | None = None  # a backend with blocks (Backend.block_stats)


@dataclass
class Ended:
    rid: int
    reason: str  # stop / length / cancelled / error
    prefilled: int
    generated: int
    error: str | None = None
    sid: int | None = None  # a kept (named) session
    held: list[int] = field(default_factory=list)  # the tokens it has committed
    nbytes: int = 0  # the kept session's own bytes (Backend.session_bytes)
    frees: int = 0  # what releasing the kept session would free (Backend.release_frees)
    ledger: Ledger | None = None  # once its session was released (what others read of it pooled); None: none was
    grammar_failed: bool = False  # the error is its grammar's (api.DoneEvent.grammar_failed)
    speculated: dict[str, tuple[int, int]] = field(default_factory=dict)  # draft source -> (drafted, accepted)


@dataclass
class CloneDone:
    rid: int
    sid: int | None  # None: refused, or the donor left
    upto: int = 0  # tokens the session holds (less than asked when a leaving donor handed over what it had)
    reason: str = ""  # why there is no session
    seconds: float = 0.0  # how long the clone took


@dataclass
class Exported:
    key: Any
    state: Any | None  # backends.base.SavedState; None: the export failed (the session is released anyway)


@dataclass
class StateLoaded:
    rid: int
    sid: int | None  # None: the load failed
    upto: int = 0
    seconds: float = 0.0


@dataclass
class StepStats:
    """A step's timing and every running request's progress; the step's `Ledger` follows it."""

    committed: dict[int, int]  # every running request's committed prompt+output position
    step_s: float
    backend_s: float
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    kept: dict[int, tuple[int, ...]] = field(default_factory=dict)  # recurrent checkpoints held, where any


@dataclass
class Died:
    error: str
    refused: bool = False  # the backend refused a setting at load (base.KVStorageRefused)
