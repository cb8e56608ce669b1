"""Measured rates the follow-the-leader cost model runs on. Pure arithmetic.

The engine calls:
  tracker = RateTracker()                       # priors until the first samples
  tracker = tracker.observe_prefill(tokens, seconds)   # after each step that prefilled
  tracker = tracker.observe_clone(tokens, seconds)     # after each clone
  tracker = tracker.observe_decode(seconds)     # after each step that decoded (the runner's own tracker)
  tracker.rates -> Rates                        # .share(prefilling) .clone_s(tokens) .decode_s
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Rates:
    prefill_tps: float = 500.0  # tokens/s the whole batch prefills
    clone_fixed_s: float = 0.002
    clone_s_per_token: float = 1e-5
    decode_s: float = 0.05  # what a step's decode rows take, without prefill

    def share(self, prefilling: int) -> float:
        """Tokens/s one of `prefilling` requests gets: prefill is compute-bound, so they split it."""
        return self.prefill_tps / max(1, prefilling)

    def clone_s(self, tokens: int) -> float:
        return self.clone_fixed_s + self.clone_s_per_token * tokens if tokens > 0 else 0.0


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

    @property
    def rates(self) -> Rates:
        prefill = self.prefill_tokens / self.prefill_seconds if self.prefill_seconds > 0 else self.prior.prefill_tps
        decode = self.decode_seconds or self.prior.decode_s
        return Rates(prefill, *self._clone_fit(), decode_s=decode)

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
