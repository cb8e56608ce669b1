"""M-RoPE's shifts (Qwen2.5-VL): where a session's next text position is not its slot.

After an image placed by M-RoPE the text continues from the image's first position + max(h, w), not from its
slot (backends/torch/images.py says how an image's tokens are placed), so a session keeps `RopeShifts`: (slot,
shift) pairs, the shift (next position minus slot, <= 0) holding from that slot on, one pair where an image
ends. Both backends keep them with the session's state: clones, roll backs and saved states cut them to what
they hold (reuse points never fall inside an image), and a decode row's position is its slot plus `shift_at`.
"""

from __future__ import annotations

import bisect

RopeShifts = tuple[tuple[int, int], ...]  # (slot, shift from that slot on), in slot order


def shift_at(shifts: RopeShifts, slot: int) -> int:
    """The M-RoPE shift in force at `slot`."""
    at = bisect.bisect_right(shifts, (slot, float("inf"))) - 1
    return shifts[at][1] if at >= 0 else 0


def shifts_upto(shifts: RopeShifts, upto: int) -> RopeShifts:
    """The shifts of the state of [0, upto)."""
    return tuple(s for s in shifts if s[0] <= upto)
