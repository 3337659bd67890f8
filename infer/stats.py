"""Intervals for figures measured over prompts: a percentile bootstrap that resamples the prompts (the unit that is
independent), so tokens of one prompt, which are correlated, never count as separate samples.

`ratio_interval` is for rates pooled over prompts (accepted / reached drafts): each resample sums numerators and
denominators over the drawn prompts before dividing, as the point estimate does. `proportion_interval` is for a share
of independent trials (pass keys retrieved): the Wilson score interval, which unlike a bootstrap keeps its width at a
share of 0 or 1. `seed_interval` is for a mean over a few independent runs (training seeds), where a bootstrap
of 3 values says nothing: Student's t interval, honest about how little 3 runs show.
"""

from __future__ import annotations

import math
from statistics import NormalDist
from typing import NamedTuple

import numpy as np
from scipy.stats import t as student_t

LEVEL = 0.95
RESAMPLES = 2000


class Interval(NamedTuple):
    """A point estimate over `n` prompts and its bootstrap interval [lo, hi] at `level`."""

    value: float
    lo: float
    hi: float
    n: int
    level: float = LEVEL

    def as_dict(self, digits: int = 3) -> dict:
        return {"value": round(self.value, digits), "lo": round(self.lo, digits), "hi": round(self.hi, digits),
                "n": self.n, "level": self.level}


def interval_text(interval: Interval | dict, form: str = ".2f") -> str:
    """`value [lo, hi]` of an `Interval` or of its `as_dict()`, each number formatted by `form` (e.g. ".3f")."""
    d = interval._asdict() if isinstance(interval, Interval) else interval
    return f"{d['value']:{form}} [{d['lo']:{form}}, {d['hi']:{form}}]"


def _draws(n: int, resamples: int, seed: int) -> np.ndarray:
    if n < 2:
        raise ValueError(f"n={n}: an interval needs at least 2 prompts; measure more prompts")
    return np.random.default_rng(seed).integers(0, n, size=(resamples, n))


def _percentiles(stats: np.ndarray, level: float) -> tuple[float, float]:
    if not 0 < level < 1:
        raise ValueError(f"level={level!r}: must be in (0, 1), e.g. 0.95")
    lo, hi = np.quantile(stats, [(1 - level) / 2, (1 + level) / 2], axis=0)
    return lo, hi


def mean_interval(values, *, level: float = LEVEL, resamples: int = RESAMPLES, seed: int = 0) -> Interval:
    """The mean of one value per prompt `values [n]` and its percentile-bootstrap interval."""
    v = np.asarray(values, np.float64)
    if v.ndim != 1:
        raise ValueError(f"values.shape={v.shape}: expected one value per prompt [n]")
    lo, hi = _percentiles(v[_draws(len(v), resamples, seed)].mean(axis=1), level)
    return Interval(float(v.mean()), float(lo), float(hi), len(v), level)


def ratio_interval(numerators, denominators, *, level: float = LEVEL, resamples: int = RESAMPLES,
                   seed: int = 0) -> list[Interval]:
    """Pooled rates `Σ num / Σ den` per column of `[n, k]` per-prompt counts, with intervals from resampling the
    prompts (rows); a column whose resample has no denominator is left out of that column's quantiles."""
    num, den = np.asarray(numerators, np.float64), np.asarray(denominators, np.float64)
    if num.shape != den.shape or num.ndim != 2:
        raise ValueError(f"numerators.shape={num.shape}, denominators.shape={den.shape}: expected equal [n, k] "
                         "counts, one row per prompt")
    idx = _draws(len(num), resamples, seed)
    s_num, s_den = num[idx].sum(axis=1), den[idx].sum(axis=1)  # [resamples, k]
    out = []
    for j in range(num.shape[1]):
        total = den[:, j].sum()
        if total == 0:
            out.append(Interval(float("nan"), float("nan"), float("nan"), len(num), level))
            continue
        ok = s_den[:, j] > 0
        lo, hi = _percentiles(s_num[ok, j] / s_den[ok, j], level)
        out.append(Interval(float(num[:, j].sum() / total), float(lo), float(hi), len(num), level))
    return out


def proportion_interval(successes: int, n: int, *, level: float = LEVEL) -> Interval:
    """The share `successes / n` of independent trials and its Wilson score interval at `level`."""
    if not 0 <= successes <= n or n < 1:
        raise ValueError(f"successes={successes}, n={n}: need 0 ≤ successes ≤ n and n ≥ 1 trials")
    if not 0 < level < 1:
        raise ValueError(f"level={level!r}: must be in (0, 1), e.g. 0.95")
    z = NormalDist().inv_cdf((1 + level) / 2)
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return Interval(p, max(0.0, centre - half), min(1.0, centre + half), n, level)


def seed_interval(values, *, level: float = LEVEL) -> Interval:
    """The mean of one value per independent run `values [n]` (e.g. one per training seed) and its Student's t
    interval `mean ± t(n − 1) · s / √n` at `level` (normal runs assumed; with n = 3, t = 4.30: wide by design)."""
    v = np.asarray(values, np.float64)
    if v.ndim != 1 or len(v) < 2:
        raise ValueError(f"values.shape={v.shape}: an interval over runs needs one value per run, at least 2 runs; "
                         "train more seeds")
    if not 0 < level < 1:
        raise ValueError(f"level={level!r}: must be in (0, 1), e.g. 0.95")
    half = student_t.ppf((1 + level) / 2, len(v) - 1) * v.std(ddof=1) / math.sqrt(len(v))
    return Interval(float(v.mean()), float(v.mean() - half), float(v.mean() + half), len(v), level)


def prompt_intervals(per_prompt, *, shares=(), digits: int = 3) -> dict[str, dict] | None:
    """{measure: `Interval.as_dict(digits)`} of one value per prompt `[n]` for each measure of `per_prompt`: the
    measures named in `shares` (0/1 per prompt, e.g. a key retrieved whole) as a share of independent prompts
    (`proportion_interval`, Wilson), every other one as a mean with a bootstrap over prompts (`mean_interval`);
    None with one prompt (an interval needs two)."""
    values = {name: np.asarray(v, np.float64) for name, v in per_prompt.items()}
    if len(next(iter(values.values()))) < 2:
        return None
    return {name: (proportion_interval(int(v.sum()), len(v)) if name in shares else mean_interval(v)).as_dict(digits)
            for name, v in values.items()}
