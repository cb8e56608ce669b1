"""Restore a prefix from the disk tier, or recompute it: the cost model's choice. Pure policy.

The engine calls (Rates from rates.py, with the read bandwidth the disk tier measured):
  choose_restore(disk_upto, file_bytes, memory_upto, rates, prefilling) -> RestorePlan
  RestorePlan.log_fields() -> dict                 # the decision and its inputs, for the log line

Rule: a disk hit is restored only when its expected time, reading the file
(`rates.read_s`) and loading it into a session (priced as a clone of as many
tokens), is below the expected time of computing the same tokens without it:
a clone of the best match held in memory (prefix cache, donor or leader) and
the prefill of the rest at the share of the prefill rate the request would get.
Ties recompute: a disk read also costs the other requests their I/O.
The tokens past the disk hit are prefilled either way, so they do not count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvfork.server.engine.policy.rates import Rates

RestoreReason = Literal["restore", "slower", "no_gain"]


@dataclass(frozen=True)
class RestorePlan:
    restore: bool
    disk_upto: int  # tokens the disk entry gives
    memory_upto: int  # tokens the best match in memory gives
    restore_s: float  # expected: read, checksum and load of the disk entry
    recompute_s: float  # expected: clone of the memory match, prefill up to disk_upto
    reason: RestoreReason

    def log_fields(self) -> dict:
        return {"disk": self.reason, "disk_upto": self.disk_upto, "disk_restore_s": round(self.restore_s, 4),
                "disk_recompute_s": round(self.recompute_s, 4)}


def choose_restore(disk_upto: int, file_bytes: int, memory_upto: int, rates: Rates, prefilling: int) -> RestorePlan:
    """`prefilling`: requests prefilling now, the recipient not counted."""
    restore_s = rates.read_s(file_bytes) + rates.clone_s(disk_upto)
    recompute_s = rates.clone_s(memory_upto) + max(0, disk_upto - memory_upto) / rates.share(prefilling + 1)
    if disk_upto <= memory_upto:
        return RestorePlan(False, disk_upto, memory_upto, restore_s, recompute_s, "no_gain")
    restore = restore_s < recompute_s
    return RestorePlan(restore, disk_upto, memory_upto, restore_s, recompute_s, "restore" if restore else "slower")
