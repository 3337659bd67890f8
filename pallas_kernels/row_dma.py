"""Gathering rows on TPU: ids in SMEM drive one DMA per row from HBM into double-buffered VMEM slots.

Mosaic has no vector-indexed loads, so a TPU kernel gathers the way ragged paged attention reads its
pages: the row ids sit in SMEM (a per-program block in `memory_space=SMEM`, so a prefill's ids need not fit
SMEM at once, as a whole-array scalar prefetch would), the buffers stay in HBM (`memory_space=ANY`), and
each id starts one `make_async_copy` of that row into a VMEM slot. Block `j + 1` is fetched into the other
slot while block `j` is computed on.

Ids outside `[0, rows)` (−1 padding) start no copy: their slot row keeps whatever it held, a previously
fetched row or the zeros `zero` wrote at the start, so it is always finite and the caller masks it.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu


def ids_blocks(idx, block: int, splits: int = 1):
    """Ids `[B, S, splits · steps · block]` as one row per program `(b, s[, split])` of a `(B, S[, splits])` grid:
    the arrays and their specs, in SMEM `[1, steps · block]` (DMA addresses) and in VMEM `[steps, block]`
    (validity masks, and the layout of per-block outputs)."""
    b, s = idx.shape[:2]
    flat = idx.reshape(b * s * splits, -1, block)
    program = lambda b_, s_, p_=0: ((b_ * s + s_) * splits + p_, 0, 0)  # noqa: E731
    return ([flat.reshape(b * s * splits, 1, -1), flat],
            [pl.BlockSpec((None, 1, flat.shape[1] * block), program, memory_space=pltpu.SMEM),
             pl.BlockSpec((None, flat.shape[1], block), program)])


def scratch(block: int, *sources) -> list:
    """VMEM slots `[2, block, width]` for each source array `[B, rows, width]`, and one pair of DMA semaphores each."""
    return [pltpu.VMEM((2, block, x.shape[-1]), x.dtype) for x in sources] + [
        pltpu.SemaphoreType.DMA((2,)) for _ in sources]


@dataclasses.dataclass(frozen=True)
class RowGather:
    """Rows `ids[0, j·block : (j+1)·block]` of `sources[k][batch]` into `slots[k][slot]`, one DMA per valid id.

    ids: SMEM ref `[1, n]`; sources: HBM refs `[B, rows, width]`; slots: VMEM refs `[2, block, width]`;
    sems: DMA semaphore refs `[2]` (one per source).
    """

    ids: object
    sources: tuple
    slots: tuple
    sems: tuple
    batch: object
    block: int

    def _each_row(self, j, slot, act) -> None:
        rows = self.sources[0].shape[1]

        def body(i, _):
            row = self.ids[0, j * self.block + i]

            @pl.when((row >= 0) & (row < rows))
            def _():
                for src, dst, sem in zip(self.sources, self.slots, self.sems):
                    act(pltpu.make_async_copy(src.at[self.batch, pl.ds(row, 1)], dst.at[slot, pl.ds(i, 1)],
                                              sem.at[slot]))

            return 0

        lax.fori_loop(0, self.block, body, 0)

    def zero(self) -> None:
        """Both slots zeroed, so a row no DMA ever wrote is finite."""
        for dst in self.slots:
            dst[...] = jnp.zeros(dst.shape, dst.dtype)

    def start(self, j, slot) -> None:
        """Start the copies of block `j` into `slot`."""
        self._each_row(j, slot, lambda copy: copy.start())

    def wait(self, j, slot) -> None:
        """Wait for the copies of block `j` (started with `start(j, slot)`)."""
        self._each_row(j, slot, lambda copy: copy.wait())

    def fetched(self, slot) -> tuple:
        """The slot's rows, one `[block, width]` array per source."""
        return tuple(dst[slot] for dst in self.slots)

    def prime(self, steps: int) -> None:
        """Start block 0 (into slot 0), if there are blocks; `pipeline` expects it in flight."""
        if steps > 0:
            self.start(0, 0)

    def pipeline(self, steps: int, body, carry):
        """`carry = body(j, rows, carry)` for j < `steps`, block `j + 1` in flight while block `j` is used
        (block 0 started by `prime`)."""
        def step(j, carry):
            slot = j % 2

            @pl.when(j + 1 < steps)
            def _():
                self.start(j + 1, 1 - slot)

            self.wait(j, slot)
            return body(j, self.fetched(slot), carry)

        return lax.fori_loop(0, steps, step, carry)
