"""Where research instruments plug into the model: one read hook and one tap per layer.

Every layer that reads Global KV reads, by default, its own selection: the top-k its index source published
(SPEC §5). An `Instrument` may replace *what* it reads (`read`, e.g. a KV-selection baseline of SPEC §14) and
may record *anything it can compute from what the layer sees* (`tap`, e.g. the dense attention mass next to the
selection, or the indexer's training loss of SPEC §13). What a layer sees is its `Sight`. `forward(...,
instrument=)` runs one instrument on every layer; each layer's tap is stacked `[L, ...]` in `aux["tap"]`.

The core imports no instrument: the instruments live above the model (`research`, `csa2.index_loss`), so a new
policy or probe is a new class there and touches no file of the core. An instrument is a pytree: its settings are
static (`dataclasses.field(metadata=dict(static=True))`, part of the compiled program), its arrays are leaves
(e.g. the position a policy starts at, one per row).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from csa2.config import ModelConfig
from csa2.indexer import Bus, visible_entries
from csa2.layout import LayerSpec
from csa2.replay import ReplayPolicy
from csa2.state import SourceKV
from pallas_kernels import reference
from pallas_kernels.stored import Stored

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Sight:
    """What one layer sees at its read, for the chunk rows it runs (batch B, queries S, heads H, window W).

    spec: the layer's role and ratio (static); entries: the entry count N of the call's largest Global KV
    source (static; a tap that reports per entry pads to it, so every layer's tap has one shape); layer: its index (an
    int32 scalar, traced inside scanned groups); q [B, S, H, D] the rotated main queries; sink [H] the per-head sink
    logits; window [B, slots + S, ·] the layer's SWA ring followed by this chunk's window KV, and window_idx [B, S, W]
    the rows of it each query reads (−1 = none); source: the group's Global KV (None on SWA layers); bus: the selections
    published so far, this layer's own included (`topk` [B, S, index_topk], `candidates`); q_index [B, S, Hi, Di] and
    w_index [B, S, Hi]: this layer's indexer queries (Full and Reindex layers, else None); positions [B, S];
    valid [B, S] the real rows.
    """

    spec: LayerSpec = dataclasses.field(metadata=dict(static=True))
    entries: int = dataclasses.field(metadata=dict(static=True))
    layer: Array
    q: Array
    sink: Array
    window: Stored
    window_idx: Array
    source: SourceKV | None
    bus: Bus
    q_index: Array | None
    w_index: Array | None
    positions: Array
    valid: Array

    def visible(self) -> Array:
        """How many Global entries each query may read `[B, S]` (SPEC §4)."""
        return visible_entries(self.positions, self.spec.ratio)

    def dense_ids(self) -> tuple[Array, Array]:
        """Every entry id of the source per query `[B, S, N]` and whether it is visible (SPEC §4)."""
        ids = jnp.broadcast_to(jnp.arange(self.source.entries, dtype=jnp.int32),
                               self.positions.shape + (self.source.entries,))
        return ids, ids < self.visible()[..., None]

    def probs(self, ids: Array, valid: Array) -> tuple[Array, Array]:
        """Sink-softmax probabilities (SPEC §3) of the window entries `[B, S, H, W]` and of the Global entries
        `ids [B, S, E]` (where `valid`) `[B, S, H, E]`, in one softmax: what the layer's attention would weigh
        if it read those entries."""
        window_keys, window_valid = reference.gather_entries(self.window, self.window_idx)  # [B, S, W, D]
        main_keys = self.source.kv.gather(self.source.rows(ids))  # [B, S, E, D]
        probs = reference.sink_probabilities(self.q, jnp.concatenate([window_keys, main_keys], axis=2),
                                             jnp.concatenate([window_valid, valid], axis=2), self.sink)
        w = window_keys.shape[2]
        return probs[..., :w], probs[..., w:]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Instrument:
    """The default instrument: every layer reads its own top-k and taps nothing.

    Subclass it as a frozen dataclass registered with `jax.tree_util.register_dataclass` (settings static, arrays as
    leaves) and override what changes. `read` and `tap` run inside the compiled model on every layer; `check` runs on
    the host before tracing (`csa2.model.forward`) and raises ValueError naming the field, the value and the fix.
    """

    def width(self, cfg: ModelConfig) -> int:
        """The most Global entries one layer reads per query (the static width of `read`)."""
        return cfg.index_topk

    def heads(self, cfg: ModelConfig) -> int:
        """1: a layer's heads share one read set (CSA2's top-k, SPEC §5); `num_attention_heads`: each head reads
        its own, and attends over it alone (e.g. a KV-selection baseline that chooses per head, SPEC §14)."""
        return 1

    def read(self, cfg: ModelConfig, sight: Sight) -> Array:
        """The entry ids `[B, S, width]` (per head: `[B, S, H, width]`; ascending, −1-padded) a layer that reads
        Global KV reads."""
        return sight.bus.topk

    def tap(self, cfg: ModelConfig, sight: Sight, read: Array) -> Any:
        """What the layer exposes for measurement (a pytree of the same structure on every layer, or None);
        `read` is what it read (−1 everywhere on SWA layers, which read no Global KV)."""
        return None

    def check(self, cfg: ModelConfig, tokens: tuple[int, int], replay: ReplayPolicy) -> None:
        """ValueError when this instrument cannot run on a `tokens` (batch, length) call under `replay`."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Joined(Instrument):
    """Two instruments at once: every layer reads what `reader` reads and taps what `tapper` taps (e.g. probes
    under a KV-selection policy)."""

    reader: Instrument
    tapper: Instrument

    def width(self, cfg):
        return self.reader.width(cfg)

    def heads(self, cfg):
        return self.reader.heads(cfg)

    def read(self, cfg, sight):
        return self.reader.read(cfg, sight)

    def tap(self, cfg, sight, read):
        return self.tapper.tap(cfg, sight, read)

    def check(self, cfg, tokens, replay):
        self.reader.check(cfg, tokens, replay)
        self.tapper.check(cfg, tokens, replay)


OWN_TOPK = Instrument()
