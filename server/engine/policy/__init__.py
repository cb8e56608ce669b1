"""Pure policies: placement, matching, follow the leader, rates, restore or recompute, scheduling, drafting, fair
shares and the memory plan; no threads, no backend.

- placement.py: Where a request starts: one pure decision over a read-only view
- matching.py: Which computed KV state serves the start of a new request's prompt: pure policy
- entries.py: What the prefix cache's tiers hold (`Entry`) and what a lookup finds (`Match`, `Found`): plain values
  the policies read (placement.py decides over a `Found`); cache/index.py stores, finds and removes them
- follow.py: Follow the leader: requests that share a prompt prefix share one prefill
- rates.py: Measured rates the follow-the-leader cost model runs on
- restore.py: Restore a prefix from the disk tier, or recompute it: the cost model's choice
- scheduler.py: Decode-first continuous batching, as pure functions (no threads, no arrays)
- draft_policy.py: When a decode row drafts: the batch-level policy of speculative decoding
- fair_share.py: Fair shares between tenants, as pure functions: who gets a free inference slot, and who gives
  way when the queue is full
- memory_plan.py: How many bytes of KV state fit the device: one pure function of what the device reports
  (backends/device_memory.py), the flags and the model, so every rule is tested on the readings of real
  machines (tests/engine/test_memory_plan.py) and printed at start and in /health with its reason
"""
