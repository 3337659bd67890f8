"""The fixed shapes of a fuzz run and the calls its properties share.

A `Bench` fixes what each program is compiled for: `rows` cases side by side (one per row of every call), chunked
prefills of `chunk` columns, one-shot prefills of `prompt` columns, a state of `capacity` positions. The defaults
reach what a short prompt would not on `mini`: 48 tokens wrap the 21-slot SWA ring inside one prefill, and hold up
to 24 ratio-2 and 48 ratio-1 entries, more than `index_topk` = 16, so the sparse selection discards entries. What a case
draws (prompt lengths, chunk boundaries, accept lengths, forked rows, tokens) is traced data, so a run of thousands
of cases compiles each program once. Rows never see each other (`csa2.state`: at fixed shapes a row's outputs are
bitwise independent of the other rows), so a batch is `rows` independent cases.

The state is a float cache under either numerics: under "spec" it holds exactly the FP4/FP8 values a packed cache
stores (`csa2.quant`), and the properties compare stored values directly. `readout` is what a property compares
between a state and its reference: length and floor (exact), every committed Global KV entry, the DSpark drafts
(which read every committed entry of the drafter's context windows) and the logits of a teacher-forced
continuation (which read everything a later call can read).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from csa2 import model, sharding
from csa2.config import ModelConfig
from csa2.layout import kv_stacks
from csa2.mesh import Rules, rows as rows_sharding
from csa2.replay import EXACT, Extend, ReplayPolicy
from csa2.state import State, init_state

FLOAT_TOLERANCE = 1e-5  # the float numerics: float rounding only (different programs sum in different orders)
SPEC_TOLERANCE = 1e-2  # the SPEC §8 numerics: a rare FP4/FP8 element flips at a rounding midpoint (~1e-3 later)
CONTINUATION = 2  # decode steps of a readout's continuation
ANCHOR = 7  # the token a readout's drafts follow


@dataclasses.dataclass(frozen=True, eq=False)
class Bench:
    """`rows` cases per call on `cfg` with `params` in `numerics`; with `mesh` (and `rules`) every call runs the
    entry point compiled for that mesh (`EntryPoint.on`) on `params` placed there."""

    cfg: ModelConfig
    params: Any
    numerics: str = "float"
    rows: int = 8
    chunk: int = 16
    prompt: int = 48
    capacity: int = 64
    mesh: Mesh | None = None
    rules: Rules | None = None

    @property
    def tolerance(self) -> float:
        return FLOAT_TOLERANCE if self.numerics == "float" else SPEC_TOLERANCE

    def on_mesh(self, mesh: Mesh, rules: Rules) -> Bench:
        """This bench on `mesh`: the same shapes and numerics, the parameters placed by `rules`."""
        return dataclasses.replace(self, params=sharding.shard_params(self.cfg, self.params, mesh, rules), mesh=mesh,
                                   rules=rules)

    # ------------------------------------------------------------------------------------------ calls
    def _entry(self, fn):
        return fn if self.mesh is None else fn.on(self.mesh, self.rules)

    def put(self, x) -> jax.Array:
        """Per-row data `[B, ...]` where this bench's calls take it."""
        x = jnp.asarray(x)
        return x if self.mesh is None else jax.device_put(x, rows_sharding(self.mesh))

    def empty(self) -> State:
        if self.mesh is None:
            return init_state(self.cfg, self.rows, self.capacity, "float")
        return sharding.init_state(self.cfg, self.rows, self.capacity, self.mesh, "float")

    def prefill(self, state: State, cols, n_valid, replay: ReplayPolicy = EXACT, extend: Extend | None = None):
        """`model.prefill` of `cols [B, S]` (`n_valid [B]` real): (last logits, state); `state` is consumed."""
        extend = None if extend is None else jax.tree.map(self.put, extend)
        cols, n_valid = self.put(np.asarray(cols, np.int32)), self.put(np.asarray(n_valid, np.int32))
        logits, state, _ = self._entry(model.prefill)(self.cfg, self.params, state, cols, n_valid, replay, extend,
                                                      self.numerics)
        return logits, state

    def chunked(self, prompts: np.ndarray, cuts: np.ndarray, replay: ReplayPolicy = EXACT,
                extend: Extend | None = None):
        """`prompts [B, ≥ total]` fed in the chunks `cuts [B, calls]` (tokens per row per call, each ≤ `chunk`):
        each row's last logits of a call that gave it tokens, and the state."""
        state, done, last = self.empty(), np.zeros(self.rows, np.int64), None
        for n_valid in cuts.T:
            cols = np.zeros((self.rows, self.chunk), np.int32)
            for b in range(self.rows):
                cols[b, :n_valid[b]] = prompts[b, done[b]:done[b] + n_valid[b]]
            logits, state = self.prefill(state, cols, n_valid, replay, extend)
            logits = np.asarray(logits)
            last = logits if last is None else np.where((n_valid > 0)[:, None], logits, last)
            done += n_valid
        return last, state

    def decode(self, state: State, tokens: np.ndarray) -> np.ndarray:
        """The logits `[B, K, V]` of decoding `tokens [B, K]` teacher-forced from a copy of `state`."""
        state, out = _copy(state), []
        for k in range(tokens.shape[1]):
            logits, state = self._entry(model.decode_step)(self.cfg, self.params, state, self.put(tokens[:, k]),
                                                           self.numerics)
            out.append(logits)
        return np.asarray(jnp.stack(out, 1))  # read back once, not per step

    def verify(self, state: State, block: np.ndarray) -> State:
        """The speculative state of `model.verify` of `block [B, γ+1]` on a copy of `state`."""
        _, spec = self._entry(model.verify)(self.cfg, self.params, _copy(state),
                                            self.put(np.asarray(block, np.int32)), self.numerics)
        return spec

    def drafts(self, state: State) -> tuple[np.ndarray, np.ndarray]:
        """The DSpark proposal after `ANCHOR` (greedy): its logits `[B, γ, V]` and confidences `[B, γ]`."""
        anchor = self.put(np.full((self.rows,), ANCHOR, np.int32))
        prop = self._entry(model.draft)(self.cfg, self.params, state, anchor, jax.random.PRNGKey(0), np.float32(0),
                                        np.float32(1), self.numerics)
        return np.asarray(prop.logits), np.asarray(prop.confidence)

    def entries(self, state: State) -> list[np.ndarray]:
        """Every committed Global KV entry per stack, Main KV and Indexer K, `[B, G, n, ·]`, zero beyond each row's
        `length // ratio`."""
        out = []
        for gkv, sources in zip(state.global_kv, kv_stacks(self.cfg)):
            ratio = self.cfg.compress_ratios[sources[0]]
            for stored in (gkv.kv, gkv.ikey):
                entries = np.asarray(stored.payload)
                valid = np.arange(entries.shape[2])[None, :] < (np.asarray(state.length) // ratio)[:, None]
                out.append(np.where(valid[:, None, :, None], entries, 0.0))
        return out

    def readout(self, state: State, continuation: np.ndarray) -> list[np.ndarray]:
        """What a property compares: length and floor, committed entries, drafts, continuation logits."""
        reads = [np.asarray(state.length), np.asarray(state.floor), *self.entries(state)]
        if self.cfg.num_nextn_predict_layers:
            reads += self.drafts(state)
        return reads + [self.decode(state, continuation)]

    # ------------------------------------------------------------------------------------------ draws
    def tokens(self, rng: np.random.Generator, *shape: int) -> np.ndarray:
        """Random byte tokens `[B, *shape]`."""
        return rng.integers(0, 256, (self.rows, *shape)).astype(np.int32)

    def cuts(self, rng: np.random.Generator, lengths: np.ndarray) -> np.ndarray:
        """Each row's `lengths[b]` tokens cut at random points (repeats give empty chunks; pieces longer than
        `chunk` split), rows padded with empty chunks to one call count: `[B, calls]`."""
        rows = []
        for n in lengths:
            bounds = [0, *sorted(rng.integers(0, n + 1, rng.integers(0, 7))), int(n)]
            sizes = []
            for a, b in zip(bounds, bounds[1:]):
                sizes += [self.chunk] * ((b - a) // self.chunk) + ([(b - a) % self.chunk] if (b - a) % self.chunk
                                                                   or a == b else [])
            rows.append(sizes)
        calls = max(len(r) for r in rows)
        return np.array([r + [0] * (calls - len(r)) for r in rows], np.int32)


def _copy(state: State) -> State:
    """A copy of `state` in its own shardings, which a donating call may consume."""
    return jax.tree.map(lambda x: jax.device_put(jnp.copy(x), x.sharding), state)


def differences(pairs) -> np.ndarray:
    """Per row, the largest |a − b| over `pairs` of arrays `[B, ...]` (all inf when shapes differ, inf at a NaN)."""
    worst = None
    for a, b in pairs:
        a, b = np.asarray(a), np.asarray(b)
        if a.shape != b.shape:
            return np.full(a.shape[0], np.inf)
        diff = np.abs(a.astype(np.float64) - b.astype(np.float64)).reshape(a.shape[0], -1)
        diff = np.where(np.isnan(diff), np.inf, diff).max(axis=1, initial=0.0)
        worst = diff if worst is None else np.maximum(worst, diff)
    return worst
