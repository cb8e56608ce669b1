"""Measured rates the follow-the-leader cost model runs on. Pure arithmetic.

The engine calls:
  tracker = RateTracker()                       # priors until the first samples
  tracker = tracker.observe_prefill(tokens, seconds)   # after each step that prefilled
  tracker = tracker.observe_clone(tokens, seconds)     # after each clone
  tracker = tracker.observe_decode(seconds)     # after each step that decoded (the runner's own tracker)
  tracker = tracker.observe_read(nbytes, seconds)      # after each disk tier read (file read and checksum)
  tracker.rates -> Rates                        # .share(prefilling) .clone_s(tokens) .decode_s .read_s(nbytes)
  split_pass(decode_rows, prefill_tokens, seconds)     # one mixed pass's time, as decode and prefill parts
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Rates:
    prefill_tps: float = 500.0  # tokens/s the whole batch prefills
    clone_fixed_s: float = 0.002
    clone_s_per_token: float = 1e-5
    decode_s: float = 0.05  # what a step's decode rows take, without prefill
    # Disk tier reads (file and checksum), bytes/s. The prior is a modest SSD's cold read, so a
    # restore is chosen before any read was measured only where it clearly beats prefilling.
    read_bps: float = 500e6

    def share(self, prefilling: int) -> float:
        """Tokens/s one of `prefilling` requests gets: prefill is compute-bound, so they split it."""
        return self.prefill_tps / max(1, prefilling)

    def clone_s(self, tokens: int) -> float:
        return self.clone_fixed_s + self.clone_s_per_token * tokens if tokens > 0 else 0.0

    def read_s(self, nbytes: int) -> float:
        return nbytes / self.read_bps


def split_pass(decode_rows: int, prefill_tokens: int, seconds: float) -> tuple[float, float]:
    """(decode seconds, prefill seconds) of one forward pass that ran both kinds of rows (a
    mixed_batches backend), split by tokens: the pass is one batch, so neither part can be timed
    alone. The parts add up to the pass, so a time budget that adds the two rates back predicts
    the pass it measured; and both rates keep learning while every step mixes."""
    tokens = decode_rows + prefill_tokens
    prefill_s = seconds * prefill_tokens / tokens if tokens else 0.0
    return seconds - prefill_s, prefill_s


@dataclass(frozen=True)
class RateTracker:
    """Exponential moving averages, fed with what the runner measures; each observation returns a new tracker.

    Prefill: tokens/s as EMA(tokens) / EMA(seconds), so long steps weigh more.
    Clone: seconds = fixed + per_token * tokens by least squares over EMA moments.
    Decode: seconds per step, an EMA (the step budget's fixed part).
    """

    alpha: float = 0.2
    prior: Rates = Rates()
    prefill_tokens: float = 0.0
    prefill_seconds: float = 0.0
    # EMA of 1, x, y, x*x, x*y with x = tokens cloned, y = seconds
    clone_moments: tuple[float, float, float, float, float] = (0.0, 0.0, 0.0, 0.0, 0.0)
    decode_seconds: float = 0.0
    read_bytes: float = 0.0
    read_seconds: float = 0.0

    def observe_prefill(self, tokens: int, seconds: float) -> RateTracker:
        if tokens <= 0 or seconds <= 0:
            return self
        first = self.prefill_seconds == 0
        return replace(self, prefill_tokens=self._ema(self.prefill_tokens, tokens, first),
                             prefill_seconds=self._ema(self.prefill_seconds, seconds, first))

    def observe_clone(self, tokens: int, seconds: float) -> RateTracker:
        if tokens <= 0 or seconds < 0:
            return self
        sample = (1.0, tokens, seconds, tokens * tokens, tokens * seconds)
        first = self.clone_moments[0] == 0
        moments = tuple(self._ema(old, new, first) for old, new in zip(self.clone_moments, sample))
        return replace(self, clone_moments=moments)

    def observe_decode(self, seconds: float) -> RateTracker:
        if seconds <= 0:
            return self
        return replace(self, decode_seconds=self._ema(self.decode_seconds, seconds, self.decode_seconds == 0))

    def observe_read(self, nbytes: int, seconds: float) -> RateTracker:
        if nbytes <= 0 or seconds <= 0:
            return self
        first = self.read_seconds == 0
        return replace(self, read_bytes=self._ema(self.read_bytes, nbytes, first),
                             read_seconds=self._ema(self.read_seconds, seconds, first))

    @property
    def rates(self) -> Rates:
        prefill = self.prefill_tokens / self.prefill_seconds if self.prefill_seconds > 0 else self.prior.prefill_tps
        decode = self.decode_seconds or self.prior.decode_s
        read = self.read_bytes / self.read_seconds if self.read_seconds > 0 else self.prior.read_bps
        return Rates(prefill, *self._clone_fit(), decode_s=decode, read_bps=read)

    def _clone_fit(self) -> tuple[float, float]:
        w, sx, sy, sxx, sxy = self.clone_moments
        if w <= 0:
            return self.prior.clone_fixed_s, self.prior.clone_s_per_token
        mx, my = sx / w, sy / w
        var, cov = sxx / w - mx * mx, sxy / w - mx * my
        # Clones of one size cannot separate the fixed part from the per-token
        # part: keep the prior's fixed part and put the rest per token.
        if var <= 1e-9 * mx * mx:
            fixed = min(self.prior.clone_fixed_s, my)
            return fixed, (my - fixed) / mx
        slope = max(0.0, cov / var)
        fixed = my - slope * mx
        return (fixed, slope) if fixed >= 0 else (0.0, my / mx)

    def _ema(self, old: float, sample: float, first: bool) -> float:
        # the first sample replaces the zero start, so early estimates are not biased low
        return sample if first else (1 - self.alpha) * old + self.alpha * sample
