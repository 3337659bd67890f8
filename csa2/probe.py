"""Indexer probes: what each layer's attention read against what it would have read densely (SPEC §3, §5).

`forward(..., probe=True)` runs the model as it always runs and has every layer also record, per query:

- `mass`: the main attention probability of each Global entry of the layer's group, averaged over heads,
  when *every* visible entry joins the window in the sink softmax (SPEC §3 without top-k; the target of
  SPEC §13's dense loss). It is 0 on entries that are not visible, on padding, and on SWA layers.
- `topk`: the entries the layer read (its own indexer's on Full and Reindex layers; the shared top-k of
  its index source on Reuse layers; the policy's under a `csa2.selection` policy).
- `scan`: this layer's own indexer over every visible entry (Full and Reindex layers; −1 elsewhere), so
  a Reindex layer's selection inside the candidate pool can be set against the full scan it replaces.
- `pool`: the candidate pool on the bus (layers after the candidate source; −1 elsewhere).

The recorded selections are the ones the model used (the same call, the same numerics); `mass` is
computed next to them from the same queries and stored entries. Host-side measures (recall, pool loss,
misses by distance) live in `experiments.topk`.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from csa2 import selection
from csa2.config import ModelConfig
from csa2.indexer import Bus, full_topk, visible_entries
from csa2.layout import LayerSpec
from csa2.state import SourceKV, State
from pallas_kernels import reference
from pallas_kernels.stored import Stored

Array = jax.Array


@chex.dataclass(frozen=True)
class Probe:
    """One layer's record `[B, S, ·]` (stacked `[L, B, S, ·]` by `forward`); see the module docstring.

    mass [B, S, N]: N = the largest Global KV source of the model (a smaller source's entries are
    padded with 0). topk [B, S, index_topk] (a policy's width under a policy), scan [B, S,
    index_topk]; pool [B, S, candidate pool size] (0 wide without candidates). Entry ids are the source's entries 0..N−1; −1 = none.
    """

    mass: Array
    topk: Array
    scan: Array
    pool: Array


def entries(state: State) -> int:
    """The probe's entry width: the largest Global KV source of `state`."""
    return max((g.kv.payload.shape[2] for g in state.global_kv), default=0)


def attention_probs(q: Array, sink: Array, window: Stored, window_idx: Array, main: Stored, main_idx: Array,
                    main_valid: Array) -> tuple[Array, Array]:
    """Sink-softmax probabilities (SPEC §3) of the window entries `[B, S, H, W]` and of the Global entries at
    rows `main_idx [B, S, E]` (where `main_valid`) `[B, S, H, E]`, in one softmax."""
    window_keys, window_valid = reference.gather_entries(window, window_idx)  # [B, S, W, D]
    main_keys = main.gather(main_idx)  # [B, S, E, D]
    probs = reference.sink_probabilities(q, jnp.concatenate([window_keys, main_keys], axis=2),
                                         jnp.concatenate([window_valid, main_valid], axis=2), sink)
    w = window_keys.shape[2]
    return probs[..., :w], probs[..., w:]


def dense_ids(source: SourceKV, positions: Array, ratio: int) -> tuple[Array, Array]:
    """Every entry id of `source` per query `[B, S, N]` and whether it is visible (SPEC §4)."""
    ids = jnp.broadcast_to(jnp.arange(source.entries, dtype=jnp.int32), positions.shape + (source.entries,))
    return ids, ids < visible_entries(positions, ratio)[..., None]


def record(cfg: ModelConfig, spec: LayerSpec, width: int, q: Array, sink: Array, window: Stored, window_idx: Array,
           source: SourceKV | None, bus: Bus, read: Array, q_index: Array | None, w_index: Array | None,
           positions: Array) -> Probe:
    """This layer's `Probe`, after its indexer published on `bus` (`read`: the entry ids the layer read;
    `q_index`, `w_index`: its indexer queries on Full and Reindex layers). `width` is the padded entry count
    (`entries`)."""
    b, s = positions.shape
    none = jnp.full((b, s, cfg.index_topk), -1, jnp.int32)
    if source is None:  # an SWA layer reads no Global KV
        return Probe(mass=jnp.zeros((b, s, width), jnp.float32), topk=read, scan=none, pool=bus.candidates)
    mass = selection.view(q, sink, window, window_idx, source, positions, spec.ratio).mass()  # [B, S, N]
    mass = jnp.pad(mass, [(0, 0), (0, 0), (0, width - source.entries)])
    scan = none
    if spec.role == "full":
        scan = bus.topk
    elif spec.role == "reindex":
        scan, _ = full_topk(cfg, q_index, w_index, source, positions, spec.ratio)
    return Probe(mass=mass, topk=read, scan=scan, pool=bus.candidates)
