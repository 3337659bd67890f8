"""Bounded decoder replay of a prompt (SPEC §11): the policy, and the plan one call computes from it.

Cold prefill runs every position through the layers before the split (the encoder, whose
compressors project every position into Global KV), then only the decoder tail — the last
`T = min(R, n)` real tokens of the chunk — through the layers from the split on, with those
layers' SWA floored at the tail start. Token×layer work: `split·n + (L − split)·T` instead of `L·n`.
With `R ≥ n` it equals the exact reference (every position through every layer, no new floor).
"""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp

from csa2.chunk import Chunk
from csa2.config import ModelConfig

Array = jax.Array

SHORT_EXTEND = ("truncate",)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclasses.dataclass(frozen=True)
class ReplayPolicy:
    """How a prefill replays the decoder (SPEC §11); hashable, a static argument of the jitted entry points.

    window: R, the tail of the chunk that runs through the layers from `split_layer` on
        (None = exact reference mode: every position through every layer);
    split_layer: the first layer that runs on the tail only (None = first decoder layer; SGLang
        uses first decoder layer + 1). Layers before it run on every position.
    short_extend: what a prefill on a non-empty state (prefix hit) replays: "truncate" runs the
        decoder tail on the new tokens only (SGLang main).
    """

    window: int | None = 128
    split_layer: int | None = None
    short_extend: str = "truncate"

    def __post_init__(self) -> None:
        if self.window is not None and (not _is_int(self.window) or self.window < 1):
            raise ValueError(f"ReplayPolicy.window={self.window!r}: use a positive token count, or None for exact mode")
        if self.split_layer is not None and (not _is_int(self.split_layer) or self.split_layer < 0):
            raise ValueError(f"ReplayPolicy.split_layer={self.split_layer!r}: use a layer index ≥ 0, or None for the "
                             "first decoder layer")
        if self.short_extend not in SHORT_EXTEND:
            raise ValueError(f"ReplayPolicy.short_extend={self.short_extend!r}: implemented: {SHORT_EXTEND}")

    @property
    def exact(self) -> bool:
        return self.window is None

    def split(self, cfg: ModelConfig) -> int:
        return cfg.first_decoder_layer if self.split_layer is None else self.split_layer

    def check(self, cfg: ModelConfig) -> None:
        """The rules that depend on the model: the split must leave every KV source before it."""
        split = self.split(cfg)
        if not cfg.first_decoder_layer <= split < cfg.num_hidden_layers:
            raise ValueError(f"ReplayPolicy.split_layer={split}: must lie in [first decoder layer "
                             f"{cfg.first_decoder_layer}, {cfg.num_hidden_layers - 1}] so the encoder sees every "
                             "position and at least one layer runs on the tail")
        late = [s for s in cfg.kv_source_layer_ids if s > split]
        if late:
            raise ValueError(f"ReplayPolicy.split_layer={split}: KV sources {late} come after the split and "
                             "would only see the tail; their Global KV needs every position")


EXACT = ReplayPolicy(window=None)


@chex.dataclass(frozen=True)
class DecoderTail:
    """The chunk rows that run from the split on (SPEC §11): `rows [B, T]` of the chunk and their `chunk`
    (positions of the tail, the decoder floor)."""

    rows: Array
    chunk: Chunk


@dataclasses.dataclass(frozen=True)
class ReplayPlan:
    """What one call does with its chunk, computed once.

    split: the first layer of the decoder segment (static). Layers before it run every row with no
        floor; from it on, layers run `tail.chunk`, floored at `tail.chunk.floor`.
    cut: whether the tail is a strict selection of rows (replay) or every row (exact mode); when
        cut, the split layer runs its compressor on every row, then continues on the tail.
    tail: the decoder tail.
    """

    split: int
    cut: bool
    tail: DecoderTail


def plan(cfg: ModelConfig, policy: ReplayPolicy, chunk: Chunk, s: int, floor: Array) -> ReplayPlan:
    """The plan of a chunk of `s` columns (`chunk.n_valid` real) on rows whose decoder floor is `floor [B]`.

    Exact mode keeps every row and the floor; with a window R the tail is the last `T = min(R, s)`
    real rows of each row (all of them when fewer) and the floor rises to the tail's first position.
    """
    t = s if policy.exact else min(policy.window, s)
    offset = jnp.maximum(chunk.n_valid - t, 0)  # [B] first chunk row of the tail
    rows = jnp.minimum(offset[:, None] + jnp.arange(t, dtype=jnp.int32)[None], s - 1)  # [B, T]
    if not policy.exact:
        floor = jnp.maximum(floor, chunk.start + offset)
    tail = DecoderTail(rows=rows, chunk=Chunk(start=chunk.start + offset, n_valid=chunk.n_valid - offset, floor=floor))
    return ReplayPlan(split=policy.split(cfg), cut=not policy.exact, tail=tail)
