"""Verify-length scheduler for speculative decoding (SPEC §12): how many drafts each row verifies.

The drafter proposes γ tokens per row with confidences `c [B, γ]`, `c_k` ≈ P(draft k is accepted |
drafts before it were). Draft k lands only if drafts 1…k all do, so its *survival*
`s_k = Π_{j≤k} c_j` is the probability it is committed, and a row verifying its first k drafts
commits `1 + Σ_{j≤k} s_j` tokens in expectation (the 1 is the bonus token every row commits).

For a budget of K drafts over the batch, the K of highest survival commit the most:
`τ(K) = N_req + Σ_{i≤K} s_(i)`, N_req the number of active rows. Survivals never rise along a row, so
those top K are a prefix of each row: row i verifies its first `k_i(K)` drafts, verify length
`1 + k_i(K)`.

Cost. The executor runs the verify block at one static width w for the whole batch, chosen among
compiled widths; a row of verify length ℓ < w is masked past ℓ (it accepts at most ℓ − 1 drafts). A
step's rate depends on (batch size, w) only, and is measured once into an `SpsTable`. The scheduler
maximises expected committed tokens per second:

    K* = argmax_K τ(K) · SPS(B, w(K)),   w(K) = the smallest compiled width ≥ 1 + max_i k_i(K),

with K over 0 … #active·γ, skipping every K whose w(K) exceeds the widest compiled width. Ties go to
the smaller K. Fixed γ is the one-width case `widths=(γ+1,)`.

Exactness under sampling. Stochastic acceptance keeps the target's distribution only if whether draft k
is verified does not depend on draft k itself (nor on later drafts). The confidence c_{k+1} reads
W1[x_k], so the global argmax above — which weighs draft k's inclusion against options that include
draft k + 1, whose survival depends on x_k — breaks that: at batch 1 with widths (2, 4) it shifts the
distribution of the second emitted token measurably (`tests/infer/test_schedule.py`). When sampling,
`schedule` therefore decides position by position: for m = 1 … γ, among the rows that verify every
draft before m, it adds the r rows of highest survival s_m (r = 0 … all of them) that maximise
τ · SPS(B, w), w the smallest compiled width ≥ 1 + m once any row reaches m, and stops at the first m
where r = 0. s_m reads drafts before m only, and other rows' drafts are drawn independently of row i's,
so whether row i verifies draft m never depends on draft m or a later one: acceptance stays exact. A
whole position weighs against a width step at once, so at large batch it widens where the argmax does;
it cannot look past m, so at batch 1 it widens only when the next draft alone pays for the wider block.
Greedy decoding takes the argmax: its output is the target's argmax chain whatever the lengths.

Edge rules:
- Equal survivals rank row-major (row, then position), so the top K stays a prefix of each row.
- A survival of exactly 0 adds nothing to τ, so under the tie rule it is verified only when that
  moves w(K) to a width the table says is strictly faster; with SPS non-increasing in width it never
  is. With fixed γ every row therefore verifies up to its last positive survival: length γ+1 when all
  its survivals are > 0, else 1 + (the position of its first zero confidence).
- Inactive rows get length 1 and add neither to N_req nor a survival.
- Confidences are probabilities in [0, 1] (the drafter's sigmoid); `schedule` checks shapes and the
  static widths, never traced values.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from csa2.checks import is_int, is_number

Array = jax.Array

MEASURE = "python -m infer.bench_spec --measure-sps"  # the command that fills an SpsTable


class Verify(NamedTuple):
    """One step's schedule: verify lengths [B] int32 (1 = no draft), the index into `widths` of the
    block width w (every length ≤ w), and τ(K*), the expected committed tokens of the batch."""

    lengths: Array
    width_index: Array
    tau: Array


def survival(confidence: Array) -> Array:
    """`s_k = Π_{j≤k} c_j`: the probability that draft k and every draft before it are accepted,
    [B, γ] → [B, γ] float32."""
    return jnp.cumprod(confidence.astype(jnp.float32), axis=-1)


@functools.partial(jax.jit, static_argnames=("widths",))
def schedule(confidence: Array, active: Array, sps: Array, widths: tuple[int, ...], sampled: Array | bool = False
             ) -> Verify:
    """K* and the per-row verify lengths (module docstring) for confidences [B, γ] of the active rows
    [B] bool, with `sps [W]` the measured steps/s of batch size B at each compiled width of `widths`
    (static, strictly increasing, each in [1, γ+1]); `sampled` (a bool, traced or not): the position-by-position
    rule that keeps stochastic acceptance exact, else the argmax. Static shapes, no host sync: one compile per
    (B, γ, widths)."""
    b, gamma = _check_schedule_args(confidence, active, sps, widths)
    surv = survival(confidence)
    key = jnp.where(active[:, None], surv, -jnp.inf).reshape(-1)  # inactive entries rank last
    order = jnp.argsort(-key, stable=True)  # descending survival; ties keep row-major order
    pos = order % gamma  # the ranked draft's position in its row
    gained = jnp.where(active[:, None], surv, 0.0).reshape(-1)[order]
    # Index K = 0 … Bγ: τ(K), and max_i k_i(K) = the deepest position among the top K (prefix property).
    tau = jnp.sum(active, dtype=jnp.float32) + jnp.concatenate([jnp.zeros(1), jnp.cumsum(gained)])
    deepest = jnp.concatenate([jnp.zeros(1, jnp.int32), jax.lax.cummax(pos + 1)])
    index = jnp.searchsorted(jnp.asarray(widths, jnp.int32), 1 + deepest).astype(jnp.int32)  # W = too wide
    # K ≤ #active·γ (later K only add inactive entries); it keeps inactive rows at length 1 (rank ≥ K*).
    fits = (jnp.arange(b * gamma + 1) <= jnp.sum(active) * gamma) & (index < len(widths))
    rate = sps.astype(jnp.float32)[jnp.minimum(index, len(widths) - 1)]
    best = jnp.argmax(jnp.where(fits, tau * rate, -jnp.inf))  # the first maximum: ties → the smaller K
    rank = jnp.zeros(b * gamma, jnp.int32).at[order].set(jnp.arange(b * gamma, dtype=jnp.int32))
    lengths = 1 + jnp.sum((rank < best).reshape(b, gamma), axis=1, dtype=jnp.int32)
    exact = _by_position(surv, active, sps, widths)
    return jax.tree.map(lambda e, a: jnp.where(sampled, e, a), exact,
                        Verify(lengths=lengths, width_index=index[best], tau=tau[best]))


def _by_position(surv: Array, active: Array, sps: Array, widths: tuple[int, ...]) -> Verify:
    """The sampling rule (module docstring): position m = 1 … γ in turn adds the r rows of highest s_m among those
    at length m that maximise τ·SPS (ties → the smaller r); no row goes past a position where r = 0."""
    b, gamma = surv.shape
    rates, compiled = sps.astype(jnp.float32), jnp.asarray(widths, jnp.int32)
    r = jnp.arange(b + 1)
    lengths, tau, index = jnp.ones(b, jnp.int32), jnp.sum(active, dtype=jnp.float32), jnp.int32(0)
    for m in range(1, gamma + 1):
        eligible = active & (lengths == m)  # verifies every draft before m
        order = jnp.argsort(-jnp.where(eligible, surv[:, m - 1], -jnp.inf), stable=True)
        gained = jnp.concatenate([jnp.zeros(1), jnp.cumsum(jnp.where(eligible, surv[:, m - 1], 0.0)[order])])
        need = jnp.searchsorted(compiled, 1 + m).astype(jnp.int32)  # len(widths): no width holds m drafts
        wider = jnp.where(r > 0, jnp.maximum(index, need), index)
        fits = (r <= jnp.sum(eligible)) & (wider < len(widths))
        take = jnp.argmax(jnp.where(fits, (tau + gained) * rates[jnp.minimum(wider, len(widths) - 1)], -jnp.inf))
        lengths = lengths + jnp.zeros(b, jnp.int32).at[order].set((r[:-1] < take).astype(jnp.int32))
        tau, index = tau + gained[take], wider[take]
    return Verify(lengths=lengths, width_index=index, tau=tau)


def _check_schedule_args(confidence, active, sps, widths) -> tuple[int, int]:
    """Shapes and the static widths (trace-time values only); returns (B, γ)."""
    if confidence.ndim != 2:
        raise ValueError(f"confidence.shape={confidence.shape}: pass the drafter's confidences as [B, γ]")
    b, gamma = confidence.shape
    if active.shape != (b,) or active.dtype != jnp.bool_:
        raise ValueError(f"active: shape {active.shape} dtype {active.dtype}; pass a [{b}] bool mask of the "
                         "rows being decoded")
    _check_widths("widths", widths)
    if widths[-1] > gamma + 1:
        raise ValueError(f"widths={widths}: a verify block holds at most γ+1={gamma + 1} rows (R and γ drafts); "
                         "drop the wider widths")
    if sps.shape != (len(widths),):
        raise ValueError(f"sps.shape={sps.shape}: give one steps/s per compiled width ({len(widths)}), e.g. "
                         "SpsTable.row(B)")
    return b, gamma


def _check_widths(name: str, widths) -> None:
    """A non-empty tuple of strictly increasing positive integers."""
    if (not isinstance(widths, tuple) or not widths or not all(is_int(w) and w >= 1 for w in widths)
            or any(a >= b for a, b in zip(widths, widths[1:]))):
        raise ValueError(f"{name}={widths!r}: use a non-empty tuple of strictly increasing positive integers, "
                         "e.g. (1, 2, 4, 8)")


@dataclasses.dataclass(frozen=True)
class SpsTable:
    """Measured verify-step rates: `steps_per_s[B][j]` = steps/s of a batch of B rows at compiled width
    `widths[j]`. `meta` is free-form JSON (preset, `"config"` fingerprint, machine, date); `check`
    compares its `"config"` against the model being served, since a rate holds only for the config and
    machine it was measured on."""

    widths: tuple[int, ...]
    steps_per_s: dict[int, tuple[float, ...]]
    meta: dict

    def __post_init__(self) -> None:
        _check_widths("SpsTable.widths", self.widths)
        if not isinstance(self.steps_per_s, dict) or not self.steps_per_s:
            raise ValueError(f"SpsTable.steps_per_s={self.steps_per_s!r}: use a non-empty dict batch size → "
                             f"tuple of steps/s per width; measure it with `{MEASURE}`")
        for batch, rates in self.steps_per_s.items():
            if not is_int(batch) or batch < 1:
                raise ValueError(f"SpsTable.steps_per_s: key {batch!r} is not a batch size; use integers ≥ 1")
            if (not isinstance(rates, tuple) or len(rates) != len(self.widths)
                    or not all(is_number(r) and math.isfinite(r) and r > 0 for r in rates)):
                raise ValueError(f"SpsTable.steps_per_s[{batch}]={rates!r}: use a tuple of {len(self.widths)} "
                                 f"finite positive steps/s, one per width {self.widths}")
        if not isinstance(self.meta, dict):
            raise ValueError(f"SpsTable.meta={self.meta!r}: use a dict (preset, config fingerprint, machine, date)")
        try:
            json.dumps(self.meta, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ValueError(f"SpsTable.meta={self.meta!r}: must be JSON (strings, numbers, lists, dicts): {e}")

    def row(self, batch: int) -> np.ndarray:
        """Steps/s of a batch of `batch` rows at each width, [W] float32: the `sps` of `schedule`."""
        if batch not in self.steps_per_s:
            raise ValueError(f"SpsTable has no steps/s for batch size {batch} (it has {sorted(self.steps_per_s)}); "
                             f"re-measure with that batch size: `{MEASURE}`")
        return np.asarray(self.steps_per_s[batch], np.float32)

    def check(self, cfg_fingerprint: str) -> None:
        """Refuse a table measured for another model config (fingerprint in `meta["config"]`)."""
        measured = self.meta.get("config")
        if measured != cfg_fingerprint:
            raise ValueError(f"SpsTable.meta['config']={measured!r}: the table was measured for another config "
                             f"than {cfg_fingerprint!r}; re-measure for this one: `{MEASURE}`")

    def save(self, path: str | os.PathLike) -> None:
        """Write the table as JSON (batch sizes become string keys)."""
        data = {"widths": list(self.widths), "meta": self.meta,
                "steps_per_s": {str(b): list(self.steps_per_s[b]) for b in sorted(self.steps_per_s)}}
        with open(path, "w") as f:
            json.dump(data, f, indent=1, allow_nan=False)

    @classmethod
    def load(cls, path: str | os.PathLike) -> SpsTable:
        """Read a table written by `save`, validated; anything else raises ValueError naming `path`."""
        try:
            with open(path) as f:
                data = json.load(f)
            if not isinstance(data, dict) or set(data) != {"widths", "steps_per_s", "meta"}:
                raise ValueError("expected a JSON object with keys widths, steps_per_s, meta")
            rates = data["steps_per_s"]
            if not isinstance(rates, dict) or not all(k.isdigit() for k in rates):
                raise ValueError("steps_per_s must map decimal batch sizes to lists of steps/s")
            return cls(widths=_tuple(data["widths"]), meta=data["meta"],
                       steps_per_s={int(k): _tuple(v) for k, v in rates.items()})
        except (ValueError, UnicodeDecodeError) as e:  # json.JSONDecodeError is a ValueError
            raise ValueError(f"{os.fspath(path)}: not an SpsTable ({e}); write one with `{MEASURE}`") from e


def config_fingerprint(cfg) -> str:
    """The `meta["config"]` of a table measured for model config `cfg`: a hash of every field (rates hold only
    for the config, and the machine, they were measured on)."""
    blob = json.dumps(dataclasses.asdict(cfg), sort_keys=True, default=str)
    return hashlib.sha1(blob.encode()).hexdigest()[:16]


def _tuple(x):
    """A JSON list as a tuple; anything else unchanged, for validation to reject."""
    return tuple(x) if isinstance(x, list) else x
