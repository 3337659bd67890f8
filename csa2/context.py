"""What every layer of one segment of a call shares (`csa2.stack` builds it, every layer reads it)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from csa2.chunk import Chunk
from csa2.hooks import Instrument

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class Context:
    """chunk: the chunk of the rows in the flow; history: the Engram token window of the whole chunk
    `[B, N−1+S]` (None without Engram); rows: the chunk rows of the flow (None = every row); written_from: the
    first position whose Global KV entries the call may write (None = any; SPEC §11 encoder replay); quantize:
    the SPEC §8 numerics (False: the float model); instrument: what every Global-reading layer reads and what
    every layer taps (`csa2.hooks`); entries: the call's largest Global KV source (`hooks.Sight.entries`);
    split, decoder_floor: from layer `split` on (the decoder, SPEC §11), no window entry below `decoder_floor
    [B]` is read; before it, none below `chunk.floor` (`window_floor`); remat: what the backward pass keeps of
    each layer (`csa2.remat`; "none" outside training)."""

    chunk: Chunk
    history: Array | None
    rows: Array | None
    written_from: Array | None
    quantize: bool
    instrument: Instrument
    entries: int
    split: int
    decoder_floor: Array
    remat: str = "none"

    def window_floor(self, layer: Array | int) -> Array:
        """The first position layer `layer` (may be traced) may read in its window `[B]`."""
        return jnp.where(layer >= self.split, self.decoder_floor, self.chunk.floor)
