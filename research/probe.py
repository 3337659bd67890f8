"""Indexer probes: what each layer's attention read against what it would have read densely (SPEC §3, §5).

`forward(..., instrument=Probes())` runs the model as it always runs and has every layer also record, per
query (`aux["tap"]`, stacked `[L, B, S, ·]`):

- `mass`: the main attention probability of each Global entry of the layer's group, averaged over heads,
  when *every* visible entry joins the window in the sink softmax (SPEC §3 without top-k; the target of
  SPEC §13's dense loss). It is 0 on entries that are not visible, on padding, and on SWA layers.
- `topk`: the entries the layer read (its own indexer's on Full and Reindex layers; the shared top-k of
  its index source on Reuse layers; the policy's under a `research.selection` policy, with
  `csa2.hooks.Joined(KVSelection(...), Probes())`).
- `scan`: this layer's own indexer over every visible entry (Full and Reindex layers; −1 elsewhere), so
  a Reindex layer's selection inside the candidate pool can be set against the full scan it replaces.
- `pool`: the candidate pool on the bus (layers after the candidate source; −1 elsewhere).

The recorded selections are the ones the model used (the same call, the same numerics); `mass` is
computed next to them from the same queries and stored entries. The record is O(L·S·N) (43 GB at 16K tokens
on `tiny`); `research.probe_stats.ProbeStats` reduces the same mass inside the model to the measures of
`experiments.topk`, O(S·K), for long prompts.
"""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp

from csa2.config import ModelConfig
from csa2.hooks import Instrument, Sight
from csa2.indexer import full_topk
from csa2.replay import ReplayPolicy
from pallas_kernels.stored import NO_ENTRY
from research.selection import view

Array = jax.Array


@chex.dataclass(frozen=True)
class Probe:
    """One layer's record `[B, S, ·]` (stacked `[L, B, S, ·]` by `forward`); see the module docstring.

    mass [B, S, N]: N = the largest Global KV source of the model (a smaller source's entries are
    padded with 0). topk [B, S, index_topk] (a policy's width under a policy), scan [B, S, index_topk];
    pool [B, S, candidate pool size] (0 wide without candidates). Entry ids are the source's entries 0..N−1; −1 = none.
    """

    mass: Array
    topk: Array
    scan: Array
    pool: Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Probes(Instrument):
    """Every layer records its `Probe` (the layer reads what it would read anyway)."""

    def tap(self, cfg: ModelConfig, sight: Sight, read: Array) -> Probe:
        b, s = sight.positions.shape
        none = jnp.full((b, s, cfg.index_topk), NO_ENTRY, jnp.int32)
        pool = sight.bus.candidates
        if sight.source is None:  # an SWA layer reads no Global KV
            return Probe(mass=jnp.zeros((b, s, sight.entries), jnp.float32), topk=read, scan=none, pool=pool)
        mass = view(sight).mass()  # [B, S, N]
        mass = jnp.pad(mass, [(0, 0), (0, 0), (0, sight.entries - sight.source.entries)])
        scan = none
        if sight.spec.role == "full":
            scan = sight.bus.topk
        elif sight.spec.role == "reindex":
            scan, _ = full_topk(cfg, sight.q_index, sight.w_index, sight.source, sight.positions, sight.spec.ratio)
        return Probe(mass=mass, topk=read, scan=scan, pool=pool)

    def check(self, cfg: ModelConfig, tokens: tuple[int, int], replay: ReplayPolicy) -> None:
        if not replay.exact:
            raise ValueError(f"Probes with replay={replay}: probes record every layer on every position; "
                             "use replay=EXACT")
