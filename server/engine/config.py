"""Every engine flag, each with its one home (see server/settings.py).

Defaults that depend on the machine or the model are resolved in one place once the model is loaded,
with the memory plan they follow from (policy/memory_plan.py's `resolve_config`).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvfork.backends.base import KV_CACHE_DTYPES, KV_CACHE_SPELLINGS, KV_GROUP_SIZES, KVStorage
from kvfork.server.settings import at_least, between, setting

SPECULATIVE_MODES = ("off", "prompt", "suffix")  # the drafters (worker/drafts.py), or none

# Automatic capture sizing: as many pending captures as inference slots (every request
# that finishes its prefill in the same step can be captured), but never more than
# this share of the KV budget, counting each snapshot at a full context.
CAPTURE_BUDGET_FRACTION = 0.25


@dataclass(frozen=True)
class EngineConfig:
    SETTINGS_GROUP = "scheduling"

    inference_slots: int = setting(8, "requests decoded together", check=at_least(1), aliases=("--max-num-seqs",))
    max_batch_tokens: int = setting(2048, "tokens one step may run: decodes first, prefill chunks fill the rest",
                                    check=at_least(1))
    prefill_chunk: int = setting(512, "most prompt tokens one request prefills in one step", check=at_least(1))
    max_step_ms: float = setting(250.0, "time a step that decodes aims for: prefill chunks are sized from the "
                                 "measured rates to keep running requests' next tokens near it, within "
                                 "--prefill-chunk and --max-batch-tokens (0: token caps only)", check=at_least(0))
    max_queue: int = setting(256, "requests waiting for a slot before capacity_exhausted", check=at_least(0))
    queue_timeout: float = setting(300.0, "seconds a request may wait for a slot before it ends with an error",
                                   check=at_least(0.001))
    kv_budget_bytes: int | None = setting(None, "KV cache bytes the engine may hold; admission waits rather than "
                                          "exceed it (default: what the device leaves once the weights are "
                                          "loaded, docs/kv-budget.md)", check=at_least(1), size=True,
                                          group="model and device")
    gpu_memory_utilization: float = setting(0.9, "on CUDA, the share of the device's memory this instance may "
                                            "use (weights, activations and KV), as vLLM's flag",
                                            check=between(0.01, 1),
                                            group="model and device")
    encoder_cache_bytes: int = setting(256 * 1024**2, "bytes of vision-encoder output a model that reads images "
                                       "keeps by (tenant, image), so an image sent again is not encoded again "
                                       "(vLLM's --mm-processor-cache-gb; 0: none kept); reserved out of the KV "
                                       "budget at load (docs/kv-budget.md)", check=at_least(0), size=True,
                                       group="model and device")
    kv_cache_dtype: str = setting("auto", "how KV state is stored, apart from --dtype: auto (the weights' dtype), "
                                  "float16, bfloat16, fp8 (torch), or int8 / int4 in per-token groups of "
                                  "--kv-group-size along each head with 16-bit scales and biases (vLLM's "
                                  "int8_per_token_head / int4_per_token_head too; int4 stores keys rotated by a "
                                  "Hadamard matrix, so the head size must be a power of two); everything that "
                                  "keeps the state keeps it so (docs/kv-budget.md)",
                                  choices=KV_CACHE_DTYPES + tuple(KV_CACHE_SPELLINGS), group="model and device")
    batch_invariant: bool = setting(False, "compute each position's keys and values bit for bit alike in any "
                                    "batch, chunk or reuse path, so reuse on answers as reuse off under a "
                                    "quantized --kv-cache-dtype too, where a last-bit difference can move a stored "
                                    "level (on the CPU, full-attention models: torch at float32 weights, MLX at "
                                    "int8 or int4 KV; slower: docs/kv-budget.md)", group="model and device")
    kv_group_size: int = setting(64, "elements of a head sharing one scale and bias under --kv-cache-dtype int8 / "
                                 "int4 (the head size must be a multiple of it)", choices=KV_GROUP_SIZES,
                                 group="model and device")
    prefix_cache_entries: int = setting(16, "finished prompts kept for reuse (0 disables the prefix cache)",
                                        check=at_least(0), group="reuse")
    prefix_cache_bytes: int | None = setting(None, "most bytes the prefix cache holds (default: no cap of its own; "
                                             "it still gives way to admission)", check=at_least(0), size=True,
                                             group="reuse")
    # 16 GiB: a few percent of a laptop's SSD, yet room for ~45 full-context (8k) prompts of the default
    # model in float32 (46 KB a token), ~4,000 agent prompts of 2k tokens in bf16 on a 135M model, or a
    # dozen 32k prompts of an 8B one: a working set of system prompts and conversations that outlives restarts.
    prefix_cache_disk_bytes: int = setting(16 * 1024**3, "bytes the prefix cache may keep on disk, under "
                                           "$KVFORK_HOME/kv, for entries evicted from memory and across restarts "
                                           "(least recently used first out; 0: no disk tier)", check=at_least(0),
                                           size=True, group="reuse")
    prefix_cache_min_tokens: int = setting(64, "shortest prompt captured, and shortest cached match used",
                                           check=at_least(1), group="reuse")
    max_captures: int | None = setting(None, "prompt snapshots for the prefix cache that may be pending at once "
                                       f"(default: one per inference slot, capped at {CAPTURE_BUDGET_FRACTION:g} "
                                       "of the KV budget at full context)", check=at_least(0), group="reuse")
    max_named_sessions: int = setting(64, "named sessions each tenant keeps (its least recently used first out)",
                                      check=at_least(1), group="reuse")
    max_context: int | None = setting(None, "most tokens of prompt and output per request (default: the "
                                      "model's)", check=at_least(2), aliases=("--max-model-len",), group="limits")
    max_tokens: int | None = setting(None, "output limit of a request that gives none (default: up to the context "
                                     "left, as OpenAI's and Anthropic's APIs bound it only by the model); any "
                                     "limit is clamped to the context left", check=at_least(1), group="limits")
    # Cloning beats recomputing from a few tokens on (a clone's fixed cost is about
    # one token's prefill, docs/benchmarks.md); 64 is the prefix cache's own
    # shortest match, so both kinds of reuse start at the same size.
    active_prefix_reuse_min_tokens: int = setting(
        64, "prefill tokens active prefix reuse must save beyond the best cached match (0 disables it)",
        check=at_least(0), group="reuse")
    follow_max_wait: float = setting(30.0, "most seconds a request follows a prefilling donor", check=at_least(0),
                                     group="reuse")
    recurrent_checkpoints: int = setting(
        4, "on a model with recurrent layers, checkpoints of the recurrent state a request keeps at its last "
        "message boundaries, so a later prompt that shares its conversation up to one is served from it "
        "(each costs one recurrent state in the KV budget; 0: none)", check=at_least(0), group="reuse")
    clone_mode: str = setting("share", "how a clone holds the prefix it reuses: share (the whole blocks below it "
                              "by reference, counted once in the budget) or copy (all of it; for comparison). A "
                              "backend that can only copy (MLX) copies either way", choices=("share", "copy"),
                              group="reuse")
    follow: bool = setting(True, "with active reuse on, let a request wait for a prefilling donor to commit the "
                           "shared prefix (--no-follow: clone-now: clone only what is already committed)",
                           group="reuse")
    speculative: str = setting("suffix", "model-free speculative decoding: prompt (drafts from the request's own "
                               "prompt and output), suffix (also from the earlier responses of its tenant and "
                               "cache_salt, prompt lookup as the fallback), or off (the same tokens either way; "
                               "suffix is at or above off on every workload measured, docs/benchmarks.md)",
                               choices=SPECULATIVE_MODES)
    speculative_tokens: int = setting(16, "most tokens one draft proposes (each request adapts its own draft length "
                                      "below it)", check=at_least(1), aliases=("--num-speculative-tokens",))
    speculative_corpus_bytes: int = setting(64 * 1024**2, "bytes the suffix corpora of past responses may hold, "
                                            "all scopes together (oldest responses out first)", check=at_least(0),
                                            size=True)

    # Verifying a draft reads its positions in the same pass, nearly free while a decode step is bound by
    # reading the weights; with many rows the step becomes compute-bound and drafts cost what they save.
    speculative_max_batch: int = setting(8, "speculative decoding drafts only in steps that decode at most this "
                                         "many requests (larger batches are compute-bound; 0: never drafts)",
                                         check=at_least(0))

    @property
    def kv_storage(self) -> KVStorage:
        return KVStorage.named(self.kv_cache_dtype, self.kv_group_size)
