"""The backend interface every kvfork backend implements.

Every call, `load` included, runs on one thread: the engine's runner. A backend never needs locks of its own.

Sessions hold the KV state of one token sequence. `position` is the number of tokens committed to that state.
The engine decides chunking and batching; the backend runs what it is asked to, in as few passes as it can.

Sliding-window rule (every backend obeys it, `clone_refusal` states it):
  a sliding layer of window W keeps a ring of the last `capacity = W` positions it was written (a backend may
  transiently hold more, never less). A query at position p attends keys [p - W + 1, p], so a clone at `upto` needs
  the layer to still hold [max(0, upto - W + 1), upto). With capacity W, a snapshot taken at prompt length L can serve
  a clone at L - 1, so an identical prompt sent again is served from it. A donor that has moved on further than that
  has overwritten what the clone needs, and the clone is refused.

Recurrent rule (every backend obeys it, `clone_positions` states it):
  a recurrent layer (Gated DeltaNet, Mamba, short convolution) keeps one fixed-size state, that of the session's
  position. The state at 1,000 cannot give the state at 900, so a session with such layers can be cloned at its
  position, or at a checkpoint: a position where `keep_at` asked the backend to keep a copy of the recurrent state
  (`Session.kept`), each costing `ModelInfo.kv.state_bytes`.

Saved-state rule (the disk tier's, `export_state` / `import_state` state it):
  a session's state leaves the device as host arrays in one layout for every backend, layer by layer in model order: a
  full layer its keys and values for positions [0, position), a sliding layer those it holds, [first, position), a
  recurrent layer its state arrays (held at `position` only). Keys and values are [kv_heads, tokens, head_dim] in
  temporal order, in the model's dtype (bfloat16 as its uint16 bits: numpy has none), or as the backend stores them
  under --kv-cache-dtype (`KVStorage`; its `label` is in the disk tier's fingerprint, so a file of another storage is
  never read). A state imported is a new session that clones and runs exactly as the one exported would have;
  checkpoints stay behind.
"""

from __future__ import annotations

import abc
import enum
from dataclasses import dataclass, field
from typing import Any, Collection, Container, Literal, Sequence

import numpy as np

from kvfork.backends.device_memory import DeviceMemory, cpu_memory
from kvfork.backends.vision import ImageInput, ImageReader
from kvfork.backends.vision.keys import IMAGE_KEY_BASE


class CloneRefused(Exception):
    """A clone that cannot reproduce `[0, upto)`. A refusal changes nothing."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason  # short label, used as a metrics label


class RowState(enum.Enum):
    """What a failed batched call did to one of its sessions."""

    UNTOUCHED = "untouched"  # state exactly as before the call: safe to run again
    COMMITTED = "committed"  # its tokens are in the state; `BatchFailed.logits` has its row, or None
    CORRUPT = "corrupt"  # partly written: the session must never be read again


class BatchFailed(Exception):
    """Fault contract of `prefill` and `decode`: a call that fails after it may have changed state raises this,
    saying per session what it did. (A ValueError from `check_inputs` means every session is untouched.) Anything
    else a backend raises is a bug, and the engine treats every session of that call as corrupt.

    `logits`, when not None, has one row per session of the call, in call order; only the rows of COMMITTED
    sessions are valid, so a runner can go on with them without computing anything twice. A COMMITTED session's
    `position` has advanced; an UNTOUCHED one's has not.
    """

    def __init__(self, cause: BaseException, rows: Sequence[RowState], logits: Any = None):
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.cause, self.rows, self.logits = cause, list(rows), logits


@dataclass(frozen=True)
class LayerAttention:
    kind: Literal["full", "sliding", "recurrent"]
    window: int | None = None  # tokens, for sliding layers


@dataclass(frozen=True)
class SavedLayer:
    """One layer of a SavedState (the saved-state rule): `arrays` are numpy arrays, (keys, values)
    of positions [first, first + tokens) for attention layers, the state's own for recurrent ones."""

    kind: Literal["full", "sliding", "recurrent"]
    arrays: tuple[np.ndarray, ...]
    first: int = 0


@dataclass(frozen=True)
class SavedState:
    """A session's state on the host (the saved-state rule): what the disk tier writes and reads."""

    position: int
    layers: tuple[SavedLayer, ...]
    # M-RoPE's (slot, shift) pairs (backends/torch/images.py): where the next position is not the slot
    rope_shifts: tuple[tuple[int, int], ...] = ()

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for layer in self.layers for a in layer.arrays)

    def prefix(self, upto: int) -> SavedState:
        """The state of [0, upto), for a clone at `upto` (clone_refusal has admitted it): full layers
        drop their tail; sliding ones what lies past `upto`; a recurrent state only serves its own position."""
        if upto == self.position:
            return self
        if not 0 < upto < self.position or any(layer.kind == "recurrent" for layer in self.layers):
            raise CloneRefused("recurrent_position" if 0 < upto < self.position else "beyond_position",
                               f"upto={upto}, saved at {self.position}")
        layers = tuple(SavedLayer(layer.kind, tuple(a[:, : upto - layer.first] for a in layer.arrays), layer.first)
                       for layer in self.layers)
        return SavedState(upto, layers, tuple(s for s in self.rope_shifts if s[0] <= upto))


KV_CACHE_DTYPES = ("auto", "float16", "bfloat16", "fp8", "int8", "int4")
KV_CACHE_SPELLINGS = {"int8_per_token_head": "int8", "int4_per_token_head": "int4"}  # vLLM's names
KV_GROUP_SIZES = (32, 64, 128)


class KVStorageRefused(ValueError):
    """A --kv-cache-dtype (or --batch-invariant) the backend cannot take for this model (its head size, its device)."""


class BackendRefused(ValueError):
    """A model this backend does not serve and another does (--backend names the other)."""


@dataclass(frozen=True)
class KVStorage:
    """How a backend stores KV state (--kv-cache-dtype, --kv-group-size), apart from the weights' dtype.
    auto: the weights' dtype; float16 / bfloat16 / fp8: that element type; int8 / int4: integers in
    per-token groups of `group` along the head dimension, each group with a 16-bit scale and bias
    (x = q * scale + bias), as mlx-lm's QuantizedKVCache groups them; int4 stores keys rotated
    (`rotates_keys`). The state is written in this form and every copy of it (clones, the prefix cache,
    sessions, the disk tier) keeps it."""

    dtype: str = "auto"
    group: int = 64

    @classmethod
    def named(cls, dtype: str, group: int = 64) -> KVStorage:
        """From the flag's spelling (vLLM's int8_per_token_head too)."""
        dtype = KV_CACHE_SPELLINGS.get(dtype, dtype)
        if dtype not in KV_CACHE_DTYPES:
            raise KVStorageRefused(f"unknown --kv-cache-dtype {dtype!r}; choose one of {', '.join(KV_CACHE_DTYPES)}")
        return cls(dtype, group)

    @property
    def bits(self) -> int | None:
        """Bits per element of a grouped integer storage; None for a floating one."""
        return {"int8": 8, "int4": 4}.get(self.dtype)

    @property
    def rotates_keys(self) -> bool:
        """Whether keys are stored rotated by the normalised Hadamard matrix of the head size (and queries
        rotated alike in attention): int4, whose 15 levels an outlier channel would otherwise spend."""
        return self.bits == 4

    def label(self, weights_dtype: str) -> str:
        """What is stored, as the start line and the disk tier's fingerprint name it."""
        if self.dtype == "auto":
            return weights_dtype
        if not self.bits:
            return self.dtype
        return f"{self.dtype} (groups of {self.group}{', rotated keys' if self.rotates_keys else ''})"


@dataclass(frozen=True)
class KVCost:
    """What one session's KV state costs, as its backend allocates it. A pure function published at
    load (`ModelInfo.kv`), so the engine prices a session before it exists without calling the backend.

    Design rules:
    - full-attention layers allocate token positions in whole steps of `step`, keeping `spare` of them past
      the furthest token always free: a session opened at `start` (0 when opened empty, `upto` when
      cloned) holds `round_up(start + spare) + slack` positions, then grows to the whole step that holds its
      furthest token written plus `spare` (torch: spare 1, slack 0; MLX: spare 0, slack one step);
    - every sliding layer holds a ring of its window whatever the length (`ring_bytes`, all rings);
    - `shared` leading tokens held by reference in another session's memory cost nothing here: their
      writer counts them, or, once it is gone, the pool of blocks nobody writes (Backend.pooled_bytes).
      Where clones share (`shares`: torch's --clone-mode share), a clone at `upto` reads the whole
      blocks below it, `shared(upto)` tokens, and holds one block of its own; n choices over one prompt
      of P tokens and T in all cost `bytes_for(T) + (n - 1) * bytes_for(T, shared=shared(P), start=P)`.
      Where they copy (MLX, --clone-mode copy), shared(upto) is 0;
    - every session of a hybrid model holds one recurrent state (`state_bytes`: the conv and delta-rule
      / SSM states of all its recurrent layers) whatever its length, and each recurrent-state checkpoint
      it keeps (`checkpoints`) costs one more.
    - `padded_rows`: the backend pads the sessions it runs together to the longest one (MLX's decode
      batch), so any session in an inference slot may hold `row_bytes(longest)`, whatever its own length.
    `tolerance` is how far (a fraction of `bytes_for`, plus one step of positions) the backend's own count
    may stray from this figure for a session: 0 where the backend allocates exactly as stated.
    """

    full_bytes_per_token: int  # all full-attention layers together, per token position allocated
    ring_bytes: int = 0
    step: int = 1
    slack: int = 0
    spare: int = 0
    state_bytes: int = 0
    tolerance: float = 0.0
    padded_rows: bool = False
    shares: bool = False  # a clone holds the whole blocks (of `step`) below its `upto` by reference

    def shared(self, upto: int) -> int:
        """Leading tokens a clone at `upto` holds by reference (0 where clones copy)."""
        return upto // self.step * self.step if self.shares else 0

    def round_up(self, tokens: int) -> int:
        return -(-tokens // self.step) * self.step

    def positions(self, tokens: int, start: int = 0) -> int:
        """Token positions a full layer allocates once a session opened at `start` has written `tokens`."""
        return max(self.round_up(start + self.spare) + self.slack, self.round_up(tokens + self.spare))

    def row_bytes(self, longest: int) -> int:
        """The most one session may hold while the sessions in inference slots beside it grow to at most `longest`
        tokens, where rows are padded to the longest (0 where they are not): the longest rounded up,
        plus two steps (a batch grows a step past its write index; a cache that grew off a step
        boundary trims to its write index and grows a step from there)."""
        if not self.padded_rows:
            return 0
        return (self.round_up(longest) + 2 * self.step) * self.full_bytes_per_token + self.ring_bytes + self.state_bytes

    def bytes_for(self, tokens: int, shared: int = 0, checkpoints: int = 0, start: int = 0) -> int:
        own = self.positions(tokens, start) - shared // self.step * self.step
        return max(0, own) * self.full_bytes_per_token + self.ring_bytes + (1 + checkpoints) * self.state_bytes


@dataclass(frozen=True)
class ModelInfo:
    name: str
    vocab_size: int
    context_length: int
    layers: tuple[LayerAttention, ...]
    eos_token_ids: tuple[int, ...]
    kv: KVCost  # what a session costs (see KVCost)
    dtype: str
    device: str
    kv_dtype: str = ""  # how KV state is stored (KVStorage.label); "" : as `dtype`
    # (storage, full_bytes_per_token) for each --kv-cache-dtype the backend could store this model's KV in
    kv_token_bytes: tuple[tuple[str, int], ...] = ()
    reads_images: bool = False  # a prompt may hold image keys (backends/vision/keys.py): Backend.encode_images
    image_token_bytes: int = 0  # one image token's embeddings, held from encode_images to release_images

    @property
    def recurrent(self) -> bool:
        """Whether any layer keeps a recurrent state (the recurrent rule)."""
        return any(layer.kind == "recurrent" for layer in self.layers)

    @property
    def sliding_windows(self) -> tuple[int, ...]:
        """The windows of the sliding layers, in layer order (the sliding-window rule)."""
        return tuple(layer.window for layer in self.layers if layer.kind == "sliding" and layer.window)


# Below this temperature, logits / temperature overflows to inf (vLLM and llama.cpp also
# sample greedily there): one threshold, read by both backends through `greedy`.
GREEDY_BELOW = 1e-5
# The seeds a request may send: any signed or unsigned 64-bit value.
SEEDS = range(-2**63, 2**64)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0  # over prompt and output, as in transformers
    presence_penalty: float = 0.0  # over output, as in OpenAI
    frequency_penalty: float = 0.0  # over output, as in OpenAI
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: bool = False
    top_logprobs: int = 0

    def __post_init__(self) -> None:
        if self.seed is not None and self.seed not in SEEDS:
            raise ValueError(f"seed {self.seed} is outside [-2**63, 2**64)")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def stream_seed(self) -> int | None:
        """The seed as both backends' generators take it, in [0, 2**64): a negative seed wraps
        as its two's complement, so a non-negative seed draws the same stream either way."""
        return None if self.seed is None else self.seed % 2**64


@dataclass
class Sampled:
    token: int
    # Set when logprobs were asked for: log-softmax of the raw model logits
    # (before penalties, bias and temperature), as OpenAI reports them.
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


@dataclass
class SamplerState:
    """One request's sampling settings and its own random stream.

    `rng` is backend-owned (an MLX key or a torch Generator) and is created lazily from `params.seed`, so a seeded
    request replays exactly.

    `allowed` constrains the next pick (a grammar): a packed bitmask, numpy int32 [ceil(vocab / 32)], bit t of word
    t // 32 set when token t may be picked, at least one bit set. The backend masks the row before anything else,
    on the device; None (the common case) costs nothing.
    """

    params: SamplingParams
    prompt: Sequence[int] = ()
    output: list[int] = field(default_factory=list)
    rng: Any = None
    allowed: Any = None


def packed_masks(states: Sequence[SamplerState]) -> np.ndarray | None:
    """The rows' `allowed` bitmasks stacked, int32 [rows, words], every bit set for an unconstrained
    row; None when no row is constrained (then a backend masks nothing at all)."""
    present = [s.allowed for s in states if s.allowed is not None]
    if not present:
        return None
    everything = np.full(present[0].shape, -1, dtype=np.int32)
    return np.stack([everything if s.allowed is None else s.allowed for s in states])


@dataclass(frozen=True)
class BlockStats:
    """Blocks of full-attention KV a sharing backend holds (`Backend.block_stats`)."""

    blocks: int  # allocated, each counted once whoever holds it
    shared: int  # with more than one holder
    saved_bytes: int  # what copying clones would hold more: a block per holder beyond its first


class Session:
    """A handle on one KV state. Backends subclass it to hang their buffers off."""

    _next_id = 0

    def __init__(self) -> None:
        Session._next_id += 1
        self.id = Session._next_id
        self.position = 0
        self.kept: tuple[int, ...] = ()  # checkpoints of its recurrent state, ascending (Backend.keep_at)
        self.wanted: frozenset[int] = frozenset()  # positions to keep the recurrent state at (keep_at)
        self.checkpoints: dict[int, list[Any]] = {}  # position -> its recurrent layers' states

    def keep(self, taken: dict[int, list[Any]]) -> None:
        """Add checkpoints (position -> recurrent layers' states) to those it holds."""
        self.checkpoints.update(taken)
        self.kept = tuple(sorted(self.checkpoints))

    def hand_checkpoints_below(self, target: "Session") -> None:
        """Backend.move_checkpoints, once both sessions are known to be live."""
        moved = {p: states for p, states in self.checkpoints.items() if p < target.position}
        self.checkpoints = {p: s for p, s in self.checkpoints.items() if p not in moved}
        self.keep({})
        target.keep(moved)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.id} at {self.position}>"


def clone_positions(session_position: int, info: ModelInfo, kept: Collection[int] = ()) -> Collection[int]:
    """The `upto`s a session at `session_position`, with checkpoints at `kept`, may be cloned at,
    before the sliding rule (which needs the rings' held positions: `clone_refusal`). Pure, for
    the engine's planning."""
    if info.recurrent:
        return tuple(sorted({p for p in (*kept, session_position) if 0 < p <= session_position}))
    return range(1, session_position + 1)


def clone_refusal(session_position: int, upto: int, info: ModelInfo, held_from: Sequence[int],
                  kept: Collection[int] = ()) -> CloneRefused | None:
    """Why `clone(upto)` cannot be served, or None when it can.

    `held_from[i]` is the oldest position sliding layer i (in layer order, among
    the sliding layers only) still holds.
    """
    if upto <= 0:
        return CloneRefused("empty", f"upto={upto}")
    if upto > session_position:
        return CloneRefused("beyond_position", f"upto={upto} > position={session_position}")
    if upto not in clone_positions(session_position, info, kept):
        held = clone_positions(session_position, info, kept)
        return CloneRefused("recurrent_position", f"upto={upto}, recurrent state held at {list(held)} only")
    sliding = [layer for layer in info.layers if layer.kind == "sliding"]
    for layer, oldest in zip(sliding, held_from):
        assert layer.window is not None
        if oldest > max(0, upto - layer.window + 1):
            return CloneRefused("window_overwritten", f"needs {max(0, upto - layer.window + 1)}, holds from {oldest}")
    return None


def check_inputs(sessions: Sequence[Session], rows: Sequence[Sequence[int]], live: Container[int],
                 info: ModelInfo) -> None:
    """Every check a backend makes before it changes any state, so a refused call leaves
    every session as it was. Raises ValueError."""
    if len(sessions) != len(rows):
        raise ValueError(f"{len(sessions)} sessions but {len(rows)} token rows")
    if len({s.id for s in sessions}) != len(sessions):
        raise ValueError("a session appears twice in one batch")
    for s, row in zip(sessions, rows):
        if s.id not in live:
            raise ValueError(f"{s!r} was released")
        if not row:
            raise ValueError("empty prefill chunk")
        if s.position + len(row) > info.context_length:
            raise ValueError(f"{s!r} + {len(row)} tokens exceeds the context length {info.context_length}")
        # On the host: an id out of range is a device-side assert on CUDA, fatal to the process.
        if not all(0 <= t < info.vocab_size or (info.reads_images and t >= IMAGE_KEY_BASE) for t in row):
            raise ValueError(f"a token id is outside the vocabulary [0, {info.vocab_size})")


class Backend(abc.ABC):
    """One model on one device."""

    info: ModelInfo
    # True when `prefill` runs rows of any length, one-token decode rows included, in ONE forward
    # pass (torch). The runner then sends a step's decode rows and prefill chunks in one `prefill`
    # call; otherwise (MLX: mlx-lm has no varlen batch) it calls `decode`, then `prefill`.
    mixed_batches: bool = False
    pads_verify: bool = False  # `verify` runs every row at the longest row's length (MLX), not ragged: draft_policy
    reusable: Any = None  # what `reuse` handed over, taken by the next `load` (a backend that cannot use it ignores it)
    vision: ImageReader | None = None  # a model that reads images: its tower and encoder cache (`load` sets it)

    @abc.abstractmethod
    def load(self, folder: str, dtype: str | None = None) -> ModelInfo:
        """Load a Hugging Face style folder. dtype None: float32 on the CPU, bf16/fp16 on a GPU."""

    def built(self) -> Any:
        """The model `load` built, for another backend of this process to `reuse` (None: nothing to hand over).
        A model's weights are read-only once built, so a later load of the same folder can start from them."""
        return None

    def reuse(self, built: Any) -> None:
        """Let the next `load` start from `built` (another backend's `built()`) where it was built from the same
        folder and dtype, neither reading nor converting the weights again; otherwise `load` reads them."""
        self.reusable = built

    @abc.abstractmethod
    def open_session(self) -> Session:
        """A new empty session."""

    @abc.abstractmethod
    def release(self, session: Session) -> None:
        """Free a session's state. Releasing twice is a no-op."""

    @abc.abstractmethod
    def prefill(self, sessions: Sequence[Session], chunks: Sequence[Sequence[int]]) -> Any:
        """Commit chunks[i] (any length >= 1) to sessions[i]; return each session's last-token
        logits, shape [n, vocab]."""

    @abc.abstractmethod
    def decode(self, sessions: Sequence[Session], tokens: Sequence[int]) -> Any:
        """Commit one token per session in one batched pass; return logits [n, vocab]."""

    @abc.abstractmethod
    def sample(self, logits: Any, states: Sequence[SamplerState]) -> list[Sampled]:
        """Pick one token per row of logits, each under its own request's settings and stream.

        A call that raises changes no state (outputs, streams), so the runner can sample
        again row by row and charge the failure to the row that causes it.

        A row's `allowed` mask (a grammar) forbids tokens first, on the device, and
        rows without one pay nothing for it; logprobs stay the raw model's.
        Penalties and logit_bias shape the logits; greedy is their argmax. The
        picked token is appended to `states[i].output` (what presence and
        frequency penalties count), so the engine does not append it again.
        """

    @abc.abstractmethod
    def select_rows(self, logits: Any, rows: Sequence[int]) -> Any:
        """The logits rows `rows` (indices into `logits`, in that order), on the device, for `sample` to
        read only those: a verify pass's positions past a rejected draft are never sampled. `logits`
        itself when `rows` are all its rows in order."""

    @property
    def rolls_back(self) -> bool:
        """After `load`: whether `verify` and `truncate` serve this model (speculative decoding)."""
        return False

    def verify(self, sessions: Sequence[Session], chunks: Sequence[Sequence[int]], reads: Sequence[int]) -> Any:
        """`prefill`, reading more logits: the last `reads[i]` positions of chunks[i] (at least 1) each give
        a row, all rows in order, shape [sum(reads), vocab] (a decode row with k drafted tokens reads k + 1).
        A session may then be `truncate`d back to any position this call passed (same fault contract)."""
        raise NotImplementedError(f"{type(self).__name__} cannot verify drafted tokens")

    def truncate(self, session: Session, position: int) -> None:
        """Roll a session back to `position` (at most its position, at least where its last `verify` call
        began): the state of its first `position` tokens, as if nothing later had been written."""
        raise NotImplementedError(f"{type(self).__name__} cannot roll a session back")

    @abc.abstractmethod
    def clone(self, session: Session, upto: int) -> Session:
        """An independent session holding the state of the first `upto` committed tokens.

        The donor may keep running; neither session sees the other's later writes.
        Raises CloneRefused (see `clone_refusal`) and then changes nothing.
        """

    def keep_at(self, session: Session, positions: Collection[int]) -> None:
        """Keep the recurrent state at each of `positions` the session reaches from now on (and at
        its position now, if listed), so that a clone there is served (the recurrent rule); drop
        the checkpoints not listed. `session.kept` says which are held; each costs
        `info.kv.state_bytes`, counted in `session_bytes`. A model without recurrent layers keeps
        nothing (it clones anywhere)."""
        raise NotImplementedError(f"{type(self).__name__} keeps no recurrent checkpoints")

    def move_checkpoints(self, source: Session, target: Session) -> None:
        """Move `source`'s checkpoints below `target`'s position to `target`, a clone of `source`'s
        prefix (a prompt's snapshot): they are states of `target`'s own prefix, so a clone of `target`
        is served there too. Their bytes move with them."""
        raise NotImplementedError(f"{type(self).__name__} keeps no recurrent checkpoints")

    def export_state(self, session: Session) -> SavedState:
        """The session's state on the host (the saved-state rule); the session is unchanged."""
        raise NotImplementedError(f"{type(self).__name__} cannot save a session's state")

    def import_state(self, state: SavedState) -> Session:
        """A new session holding `state` (the saved-state rule), at `state.position`. The caller
        has reserved its bytes (`info.kv.bytes_for(position, start=position)`) before calling."""
        raise NotImplementedError(f"{type(self).__name__} cannot load a session's state")

    def encode_images(self, images: Sequence[ImageInput], scope: str) -> int:
        """Runner thread, as a request starts: each image its prefill reads gets its embeddings (from `scope`'s
        encoder cache or encoded now) held until `release_images`; how many it encoded."""
        if self.vision is None:
            raise NotImplementedError(f"{type(self).__name__} reads no images")
        return self.vision.encode(images, scope)

    def release_images(self, images: Sequence[int]) -> None:
        """The request that `encode_images` held these images for (their ids) ended."""
        if self.vision is not None:
            self.vision.release(images)

    @property
    def state_format(self) -> str:
        """What saved states are named by on disk: a state of one format imports into a backend of that format."""
        return type(self).__name__

    def set_kv_storage(self, storage: KVStorage) -> None:
        """Before `load`: --kv-cache-dtype; `load` raises KVStorageRefused where the model or device cannot take it."""
        if storage.dtype != "auto":
            raise KVStorageRefused(f"--kv-cache-dtype {storage.dtype}: {type(self).__name__} stores KV in --dtype only")

    def set_batch_invariant(self, on: bool) -> None:
        """Before `load`: --batch-invariant; `load` raises KVStorageRefused where the model cannot take it."""
        if on:
            raise KVStorageRefused(f"--batch-invariant: not on {type(self).__name__} (on the CPU, --backend torch or mlx)")

    def set_encoder_cache_bytes(self, nbytes: int) -> None:
        """Before `load`: bytes of encoder output kept for images sent again (--encoder-cache-bytes; 0: none)."""

    def set_clone_mode(self, mode: Literal["share", "copy"]) -> None:
        """Before `load`: --clone-mode, "share" or "copy" (`info.kv.shares` says which is in effect; MLX copies)."""

    @abc.abstractmethod
    def session_bytes(self, session: Session) -> int:
        """Bytes this session holds of its own. Blocks it reads by reference are not its own: they are
        their writer's, or pooled (`pooled_bytes`) once the writer is gone. Each byte the backend holds
        is one session's or pooled: `total_bytes() == sum(session_bytes) + pooled_bytes()`."""

    def release_frees(self, session: Session) -> int:
        """Bytes releasing this session would free now: its own that nobody reads, and pooled blocks
        nobody else reads."""
        return self.session_bytes(session)

    def memory(self, step_tokens: int) -> DeviceMemory:
        """After `load`: what the device reports about its memory, with the loaded weights and, where the
        backend measures it, the activation peak of a `step_tokens` step (0: do not measure)."""
        return cpu_memory()

    def pooled_bytes(self) -> int:
        """Bytes of blocks whose writer was released and that other sessions still read (0 where
        clones copy)."""
        return 0

    def block_stats(self) -> BlockStats | None:
        """Blocks held, shared, and bytes saved by sharing; None for a backend without blocks."""
        return None

    @abc.abstractmethod
    def total_bytes(self) -> int:
        """Bytes allocated for all live sessions, each counted once."""

    @abc.abstractmethod
    def live_sessions(self) -> int:
        """How many sessions are open (opened or cloned, not yet released)."""

    @abc.abstractmethod
    def to_numpy(self, logits: Any) -> Any:
        """Logits as a float32 numpy array, for tests and tools."""
