"""Measured rates the follow-the-leader cost model runs on. Pure arithmetic.

The engine calls:
  tracker = RateTracker()                       # priors until the first samples
  tracker = tracker.observe_prefill(tokens, seconds)   # after each step that prefilled
  tracker = tracker.observe_clone(tokens, seconds)     # after each clone
  tracker = tracker.observe_step(tokens, seconds, drafted)   # after each step that decoded: its prefill tokens,
                                                       # backend seconds and drafted positions verified (the
                                                       # runner's own tracker, for the step budget)
  tracker = tracker.observe_read(nbytes, seconds)      # after each disk tier read (file read and checksum)
  tracker.rates -> Rates                        # .share(prefilling) .clone_s(tokens) .decode_s
                                                #   .step_s_per_token .verify_s_per_token .read_s(nbytes)
  split_pass(decode_positions, prefill_tokens, seconds)   # one mixed pass's time, as decode and prefill parts
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class Rates:
    prefill_tps: float = 500.0  # tokens/s the whole batch prefills
    clone_fixed_s: float = 0.002
    clone_s_per_token: float = 1e-5
    decode_s: float = 0.05  # what a step that decodes takes without prefill (its fixed part)
    step_s_per_token: float = 0.002  # what each prefill token adds to such a step
    verify_s_per_token: float = 0.002  # what each drafted position it verifies adds to such a step (speculation)
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


def split_pass(decode_positions: int, prefill_tokens: int, seconds: float) -> tuple[float, float]:
    """(decode seconds, prefill seconds) of one forward pass that ran both kinds of rows (a
    mixed_batches backend), split by the positions each computed (a decode row's drafted positions
    among its own): the pass is one batch, so neither part can be timed alone. The prefill part feeds
    the cost model's prefill rate; the step budget fits the whole step instead (RateTracker.observe_step)."""
    tokens = decode_positions + prefill_tokens
    prefill_s = seconds * prefill_tokens / tokens if tokens else 0.0
    return seconds - prefill_s, prefill_s


@dataclass(frozen=True)
class RateTracker:
    """Exponential moving averages, fed with what the runner measures; each observation returns a new tracker.

    Prefill: tokens/s as EMA(tokens) / EMA(seconds), so long steps weigh more.
    Clone: seconds = fixed + per_token * tokens by least squares over EMA moments.
    A step that decodes: seconds = decode_s + step_s_per_token * prefill tokens, the same way. The
    fixed part (a pass's per-layer overhead, the decode rows) is its own term: a rate of tokens per
    second taken from small chunks would carry it, read low, cut the next chunk, and shrink the
    chunks to nothing (prefill starving under the step budget).
    A step that verifies drafted positions (speculation) is kept off that line: its extra positions
    would read as a larger fixed part, and the steps that prefill (which never draft) would get
    smaller chunks for it. Its seconds against its drafted positions fit their own cost instead.
    """

    alpha: float = 0.2
    prior: Rates = Rates()
    prefill_tokens: float = 0.0
    prefill_seconds: float = 0.0
    # EMA of 1, x, y, x*x, x*y with x = tokens cloned, y = seconds
    clone_moments: tuple[float, float, float, float, float] = (0.0, 0.0, 0.0, 0.0, 0.0)
    # EMA of 1, x, y, x*x, x*y with x = prefill tokens of a step that decoded, y = its seconds
    step_moments: tuple[float, float, float, float, float] = (0.0, 0.0, 0.0, 0.0, 0.0)
    # EMA of 1, x, y, x*x, x*y with x = drafted positions a step verified, y = its seconds
    verify_moments: tuple[float, float, float, float, float] = (0.0, 0.0, 0.0, 0.0, 0.0)
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
        return replace(self, clone_moments=self._moments(self.clone_moments, tokens, seconds))

    def observe_step(self, prefill_tokens: int, seconds: float, drafted: int = 0) -> RateTracker:
        """A step that decoded, with `prefill_tokens` prefilled beside its decode rows and `drafted`
        positions verified among them, took `seconds`."""
        if prefill_tokens < 0 or seconds <= 0:
            return self
        if drafted > 0:
            return replace(self, verify_moments=self._moments(self.verify_moments, drafted, seconds))
        return replace(self, step_moments=self._moments(self.step_moments, prefill_tokens, seconds))

    def observe_read(self, nbytes: int, seconds: float) -> RateTracker:
        if nbytes <= 0 or seconds <= 0:
            return self
        first = self.read_seconds == 0
        return replace(self, read_bytes=self._ema(self.read_bytes, nbytes, first),
                             read_seconds=self._ema(self.read_seconds, seconds, first))

    @property
    def rates(self) -> Rates:
        prefill = self.prefill_tokens / self.prefill_seconds if self.prefill_seconds > 0 else self.prior.prefill_tps
        read = self.read_bytes / self.read_seconds if self.read_seconds > 0 else self.prior.read_bps
        decode_s, step_s_per_token = self._step_fit(prefill)
        return Rates(prefill, *self._clone_fit(), decode_s, step_s_per_token, self._verify_fit(decode_s), read)

    def _clone_fit(self) -> tuple[float, float]:
        w, sx, sy, sxx, sxy = self.clone_moments
        if w <= 0:
            return self.prior.clone_fixed_s, self.prior.clone_s_per_token
        mx, my = sx / w, sy / w
        # Clones of one size cannot separate the fixed part from the per-token
        # part: keep the prior's fixed part and put the rest per token.
        fit = fit_line(self.clone_moments)
        if fit is None:
            fixed = min(self.prior.clone_fixed_s, my)
            return fixed, (my - fixed) / mx
        fixed, slope = fit
        return (fixed, slope) if fixed >= 0 else (0.0, my / mx)

    def _step_fit(self, prefill_tps: float) -> tuple[float, float]:
        """(decode_s, step_s_per_token) of a step that decodes; while only steps that verified drafts
        were seen, the fixed part their line gives."""
        w, sx, sy, _, _ = self.step_moments
        if w <= 0:
            fit = fit_line(self.verify_moments) if self.verify_moments[0] > 0 else None
            fixed = self.prior.decode_s if fit is None else max(0.0, fit[0])
            return fixed, self.prior.step_s_per_token
        fit = fit_line(self.step_moments)
        if fit is None or fit[1] <= 0:
            # Steps of one chunk size (or none yet with prefill) cannot tell the parts apart: each
            # prefill token costs what a prefill-only step's rate says, the rest is fixed.
            # (Never more than the whole step per token: a prior from a slower device would
            # otherwise hold the chunks at one size for good.)
            slope = min(1 / prefill_tps, sy / sx) if sx > 0 else 1 / prefill_tps
            return max(0.0, (sy - slope * sx) / w), slope
        fixed, slope = fit
        return (fixed, slope) if fixed >= 0 else (0.0, sy / sx)

    def _verify_fit(self, decode_s: float) -> float:
        """What a drafted position adds to a step: the slope of its steps' line, or, where their drafts
        were all of one length, what they took beyond the plain steps' fixed part, per position."""
        w, sx, sy, _, _ = self.verify_moments
        if w <= 0:
            return self.prior.verify_s_per_token
        fit = fit_line(self.verify_moments)
        return fit[1] if fit is not None else max(0.0, (sy - decode_s * w) / sx)

    def _moments(self, moments: tuple[float, ...], x: float, y: float) -> tuple[float, float, float, float, float]:
        sample = (1.0, x, y, x * x, x * y)
        first = moments[0] == 0
        return tuple(self._ema(old, new, first) for old, new in zip(moments, sample))  # type: ignore[return-value]

    def _ema(self, old: float, sample: float, first: bool) -> float:
        # the first sample replaces the zero start, so early estimates are not biased low
        return sample if first else (1 - self.alpha) * old + self.alpha * sample


def fit_line(moments: tuple[float, ...]) -> tuple[float, float] | None:
    """Least squares y = a + b x over EMA moments (1, x, y, x*x, x*y): (a, b), or None when the x
    seen are (nearly) all one value and cannot fix a slope."""
    w, sx, sy, sxx, sxy = moments
    mx, my = sx / w, sy / w
    var, cov = sxx / w - mx * mx, sxy / w - mx * my
    if var <= 1e-9 * max(mx * mx, 1.0):
        return None
    slope = max(0.0, cov / var)
    return my - slope * mx, slope


@dataclass
class LiveRates:
    """The cost model's tracker as the control loop holds it: one holder its parts share (serving.py's parts
    observe into it, placement reads it), each observation replacing `tracker`."""

    tracker: RateTracker = field(default_factory=RateTracker)
