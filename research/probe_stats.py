"""Probe statistics reduced inside the compiled model, so the Top-K and KV-selection measures reach long contexts.

`research.probe.Probes` hands every layer's dense attention mass `[L, B, S, N]` back to the host: 43 GB at 16K
tokens on `tiny`. `forward(..., instrument=ProbeStats(edges=...))` computes the same mass per layer, one block of
`block` queries at a time (a block's per-head probabilities `[B, block, H, N]` are the largest array), and keeps
only what the measures of `experiments.topk` and `experiments.kv_selection` need, per query: O(S·K) memory.

Per layer (stacked `[L, ...]` in `aux["tap"]`), with mass_e the head-averaged dense sink-softmax probability of
Global entry e (SPEC §3 without top-k, as in `Probes`) and captured(set) = Σ_{e ∈ set} mass_e:

- `total` [B, S]: captured(every entry);
- `read` [B, S]: captured(the entries the layer read); where each head reads its own set (`Instrument.heads`), the
  mean over heads of each head's dense probability on its own set;
- `oracle` [B, S]: captured(the `index_topk` entries of largest mass), the best any selection of that size reaches;
- `overlap` [B, S]: the share of those oracle entries (the ones with mass > 0) that the layer read (any head);
  NaN without any;
- `scan` [B, S]: captured(the layer's own indexer over every visible entry), Full and Reindex layers (0 elsewhere);
- `pool` [B, S]: captured(the candidate pool on the bus), layers after the candidate source (0 elsewhere);
- `topk` [B, S, width] (per head `[B, S, H, width]`): the entry ids read (−1 = none);
- `by_distance` [B, 2, bins]: the mass (row 0) and the part of it not read (row 1, as `read` counts it) by token
  distance from the query to the entry's last token, in the bins `[edges[i], edges[i+1])`, summed over the
  queries that count (more visible entries than `index_topk`, and some Global mass); None without `edges`.

SWA layers read no Global KV: every field is 0 there (`overlap` NaN, `topk` −1).
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
from research.selection import View, id_mask, map_query_blocks, view

Array = jax.Array


@chex.dataclass(frozen=True)
class Summary:
    """One layer's statistics (see the module docstring); `forward` stacks them `[L, ...]`."""

    total: Array
    read: Array
    oracle: Array
    overlap: Array
    scan: Array
    pool: Array
    topk: Array
    by_distance: Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ProbeStats(Instrument):
    """Every layer reduces its dense attention mass to a `Summary`, `block` queries at a time; `edges`: the
    token-distance bins of `Summary.by_distance` (ascending; () = none)."""

    edges: tuple[int, ...] = dataclasses.field(default=(), metadata=dict(static=True))
    block: int = dataclasses.field(default=256, metadata=dict(static=True))

    def tap(self, cfg: ModelConfig, sight: Sight, read: Array) -> Summary:
        b, s = sight.positions.shape
        zero = jnp.zeros((b, s), jnp.float32)
        if sight.source is None:  # an SWA layer reads no Global KV
            bins = jnp.zeros((b, 2, len(self.edges) - 1)) if self.edges else None
            return Summary(total=zero, read=zero, oracle=zero, overlap=jnp.full((b, s), jnp.nan), scan=zero,
                           pool=zero, topk=read, by_distance=bins)
        scan = None
        if sight.spec.role == "full":
            scan = sight.bus.topk
        elif sight.spec.role == "reindex":
            scan, _ = full_topk(cfg, sight.q_index, sight.w_index, sight.source, sight.positions, sight.spec.ratio)
        v = view(sight)
        per_query = dict(q=v.q, rest=v.rest, visible=v.visible, positions=v.positions, read=read,
                         pool=sight.bus.candidates)
        if scan is not None:
            per_query["scan"] = scan

        def one_block(part):
            return _block_stats(cfg, sight.spec.ratio, self.edges, v.keys, part)

        out, dist = map_query_blocks(one_block, per_query, self.block)
        out.setdefault("scan", zero)
        return Summary(**out, topk=read, by_distance=jnp.sum(dist, axis=0) if self.edges else None)

    def check(self, cfg: ModelConfig, tokens: tuple[int, int], replay: ReplayPolicy) -> None:
        if not replay.exact:
            raise ValueError(f"ProbeStats with replay={replay}: probes measure every layer on every position; "
                             "use replay=EXACT")
        if self.block < 1:
            raise ValueError(f"ProbeStats.block={self.block}: give a positive number of queries per block")
        if len(self.edges) == 1 or list(self.edges) != sorted(set(self.edges)):
            raise ValueError(f"ProbeStats.edges={self.edges}: give two or more strictly ascending distance bin "
                             "edges, or none")


def _block_stats(cfg: ModelConfig, ratio: int, edges: tuple[int, ...], keys: Array,
                 xs: dict) -> tuple[dict, Array]:
    """`Summary` fields of one block of queries `[B, Q]` and its distance sums `[B, 2, bins]`."""
    probs = View(q=xs["q"], keys=keys, rest=xs["rest"], visible=xs["visible"], positions=xs["positions"]).probs()
    mass = jnp.mean(probs, axis=2)  # [B, Q, N]
    n = mass.shape[-1]
    if xs["read"].ndim == 4:  # one set per head: each head's mass on its own set; an entry is read if any head read it
        per_head = id_mask(xs["read"], n)  # [B, Q, H, N]
        got, read = jnp.mean(jnp.where(per_head, probs, 0.0), axis=2), jnp.any(per_head, axis=2)
    else:
        read = id_mask(xs["read"], n)
        got = jnp.where(read, mass, 0.0)  # [B, Q, N]: the mass each entry gave to what was read
    k = min(cfg.index_topk, n)
    best, best_ids = jax.lax.top_k(mass, k)  # the oracle: ties go to the older entry, as a stable sort's
    in_oracle = best > 0
    hits = jnp.sum(jnp.take_along_axis(read, best_ids, axis=-1) & in_oracle, axis=-1)
    total = jnp.sum(mass, axis=-1)
    out = dict(total=total, read=jnp.sum(got, axis=-1), oracle=jnp.sum(best, axis=-1),
               overlap=hits / jnp.sum(in_oracle, axis=-1), pool=_captured(mass, id_mask(xs["pool"], n)))
    if "scan" in xs:  # Full and Reindex layers
        out["scan"] = _captured(mass, id_mask(xs["scan"], n))
    counts = (xs["visible"] > cfg.index_topk) & (total > 0)  # [B, Q]
    distance = xs["positions"][..., None] - ((jnp.arange(n) + 1) * ratio - 1)  # to the entry's last token
    weights = jnp.where(counts[..., None], mass, 0.0)
    missed = jnp.where(counts[..., None], mass - got, 0.0)
    sums = [jnp.stack([jnp.sum(jnp.where(inside, weights, 0.0), axis=(1, 2)),
                       jnp.sum(jnp.where(inside, missed, 0.0), axis=(1, 2))], axis=1)
            for inside in ((distance >= lo) & (distance < hi) for lo, hi in zip(edges[:-1], edges[1:]))]
    return out, jnp.stack(sums, axis=-1) if sums else None


def _captured(mass: Array, mask: Array) -> Array:
    return jnp.sum(jnp.where(mask, mass, 0.0), axis=-1)
