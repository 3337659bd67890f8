"""Bounded decoder replay of a prompt (SPEC §11): the policy, the extend a chunk belongs to, and the
plan one call computes from them.

A prompt's new tokens are one *extend*: positions `[start, end)` of a row (`[0, N)` for a cold
prompt), fed in one prefill call or in several chunks. Every position runs through the layers
before the split (the encoder, whose compressors project every position into Global KV); only the
decoder tail — the last `T = min(R, end − start)` positions `[end − T, end)` of the extend — runs
through the layers from the split on, with those layers' SWA floored at the tail start. A chunk runs
the part of the tail it holds, so every chunking of an extend gives the state and logits of one call;
with `R ≥ end − start` that is the exact reference (every position through every layer, no floor).

Work (`prefill`'s aux `work`) counts the rows that enter each layer. When the split layer compresses
(a Full layer, e.g. layer 20 of the release), its Engram, attention-site mHC and compressor take every
row and only its attention and FFN run on the tail, so it counts all n rows: `(split + 1)·n +
(L − split − 1)·T` per extend. SPEC §11's `20·N + 20·T` counts layer 20 as tail; SGLang's split 21
(layer 20 whole on every row) gives the same `21·N + 19·T` as the count here for split 20.
"""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp

from csa2.checks import is_static_int
from csa2.chunk import Chunk
from csa2.config import ModelConfig
from csa2.layout import layer_plan

Array = jax.Array

SHORT_EXTEND = ("truncate", "borrow")


@dataclasses.dataclass(frozen=True)
class ReplayPolicy:
    """How a prefill replays the decoder (SPEC §11); hashable, a static argument of the jitted entry points.

    window: R, the tail of the chunk that runs through the layers from `split_layer` on
        (None = exact reference mode: every position through every layer);
    split_layer: the first layer that runs on the tail only (None = first decoder layer; SGLang
        uses first decoder layer + 1). Layers before it run on every position.
    short_extend: the decoder window of an extend shorter than R that resumes a cached prefix with its
        rings (a prefix hit with a snapshot). Both run the layers from the split on the extend's rows
        only (`[max(start, end − R), end)`), so they cost the same. "truncate" (SGLang main) floors their
        windows at the extend's first decoder row: a 4-token extend sees 4 local positions. "borrow"
        floors them at `end − R` and reads the prefix's positions in between from the decoder rings the
        prefix's own prefill wrote (the cached encoder outputs, already run through the decoder): the
        window's extent is the one a cold prefill of the whole prompt has (where the prefix's tail covered
        it), its borrowed entries are those the prefix computed under its own floor. The two agree whenever
        the extend holds R tokens or more, and under encoder replay (the replayed rows make the extend
        long enough).
    """

    window: int | None = 128
    split_layer: int | None = None
    short_extend: str = "truncate"

    def __post_init__(self) -> None:
        if self.window is not None and (not is_static_int(self.window) or self.window < 1):
            raise ValueError(f"ReplayPolicy.window={self.window!r}: use a positive token count, or None for exact mode")
        if self.split_layer is not None and (not is_static_int(self.split_layer) or self.split_layer < 0):
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


def token_layers(cfg: ModelConfig, policy: ReplayPolicy, n: int) -> int:
    """Token×layer work of prefilling a cold prompt of `n` tokens (what `prefill`'s aux `work` counts):
    `L·n` exact; `(split + 1)·n + (L − split − 1)·T` when the split layer compresses, else
    `split·n + (L − split)·T`, T = min(R, n)."""
    layers = cfg.num_hidden_layers
    if policy.exact:
        return layers * n
    split, t = policy.split(cfg), min(policy.window, n)
    every = split + layer_plan(cfg)[split].compresses  # a compressing split layer takes every row
    return every * n + (layers - every) * t


def exact_window(cfg: ModelConfig, split_layer: int | None = None) -> int:
    """The replay window R from which a bounded prefill's last position is the exact one's (to float rounding):
    `D·(W − 1) + 1` for the `D = L − split` layers that run on the tail (`split_layer` as `ReplayPolicy`'s).

    Why: every position runs through the layers before the split, and the split layer's compressor takes every
    row, so the Global KV is exact; what replay cuts is the SWA of the tail layers, floored at the tail start
    `N − R`. A window reaches `W − 1` positions back, so the first tail layer's output is exact from `N − R + W − 1`
    on, and each later layer moves that edge `W − 1` further; after `D` layers it passes the last position `N − 1`
    exactly when `R ≥ D·(W − 1) + 1`. The bound is sufficient, not a cliff: just below it only the far edge of
    the last position's receptive field is cut, and how much that moves it depends on the weights."""
    policy = ReplayPolicy(window=1, split_layer=split_layer)
    policy.check(cfg)  # a split before the decoder or past the last layer is refused by name
    return (cfg.num_hidden_layers - policy.split(cfg)) * (cfg.sliding_window - 1) + 1


def drafting_replay(cfg: ModelConfig, policy: ReplayPolicy) -> ReplayPolicy:
    """The policy a caller that drafts (SPEC §12) prefills with: `policy` with its window raised to the sliding
    window W when R < W, i.e. `ReplayPolicy(window=max(R, W))` with the same split and short-extend mode; exact
    stays exact and R ≥ W is returned as it is.

    Why: the drafter reads the context `[L − W, L − 1]`, and a position has drafter features only if it ran
    through the target layers, which lie from the split on, i.e. only on the decoder tail under replay. With
    R < W the first drafts after a prompt would see R rows (`csa2.dspark.window_rows` masks the rest, below the
    floor), and nothing short of running the decoder layers on the missing rows can make their features. The
    raised window also changes what the target computes: its decoder windows on the last rows reach W back, so a
    drafting caller's greedy output equals `infer.generate` with this policy, not with `policy`.

    What it guarantees, T = min(max(R, W), end − start) the decoder tail of an extend `[start, end)`:
    - a cold prompt of N tokens (one call, or chunks passing `Extend.cold(N)`): the tail is `[N − T, N)` and the
      floor `max(N − max(R, W), 0)`, at most `N − W` (0 when R ≥ N: every row runs the decoder, as in exact mode);
    - a prefix hit without its snapshot (`Extend.replaying` with this policy): the extend starts at most T tokens
      before `end`, so the tail is again the prompt's last T positions and the floor at most `end − W`;
    - a snapshot hit under "borrow": the floor is `max(end − max(R, W), 0)`; the window's rows before the hit are
      the snapshot's context windows, written by the prefix's own prefill (complete if it used this policy too).
      Under "truncate" an extend shorter than max(R, W) floors the decoder at the hit, and the drafter with it:
      the rows in `[end − W, hit)` stay masked whatever R is. No caller drafts after a prefix hit today
      (`infer.prefix_cache.prefill` has no speculative entry; `infer.speculative` prefills cold prompts).
    The oldest context rows are still approximate: a target layer ℓ past the split computes position p from
    decoder windows cut at the floor unless p ≥ floor + (ℓ − split)·(W − 1) (SPEC §11; `csa2.dspark`).
    """
    if not isinstance(policy, ReplayPolicy):
        raise ValueError(f"policy={policy!r}: pass a csa2.replay.ReplayPolicy (EXACT for the reference mode)")
    if policy.exact or policy.window >= cfg.sliding_window:
        return policy
    return dataclasses.replace(policy, window=cfg.sliding_window)


@chex.dataclass(frozen=True)
class Extend:
    """The extend a prefill chunk belongs to: per row, the positions `[start, end)` (`[B]` each) fed to the
    model, whatever chunks they arrive in. A cold prompt of N tokens is `Extend.cold(N)`; the suffix
    after a prefix hit of P tokens whose rings are in the state is `[P, N)`. Each chunk lies inside its
    row's extend.

    `hit` (None: none) is the length of a cached prefix the extend resumes (SPEC §11 prefix hit): the
    Global KV entries completed before it are the cache's, read and never rewritten (an entry straddling
    it completes after it and is written). `start < hit` is an *encoder replay*: the state holds that
    Global KV but not the prefix's rings, so the extend re-runs its last prefix tokens to rebuild them;
    their windows begin at `start`, and they count towards the decoder tail like any other row of the
    extend. `Extend.replaying` plans it.
    """

    start: Array
    end: Array
    hit: Array | None = None

    @classmethod
    def cold(cls, lengths: Array) -> "Extend":
        """Prompts of `lengths [B]` tokens on empty rows: `[0, lengths)`."""
        lengths = jnp.asarray(lengths, jnp.int32)
        return cls(start=jnp.zeros_like(lengths), end=lengths)

    @classmethod
    def replaying(cls, cfg: ModelConfig, policy: ReplayPolicy, hit: Array, end: Array) -> "Extend":
        """The extend that resumes a cached prefix of `hit [B]` tokens without its rings, for a prompt of
        `end [B]` tokens (SPEC §11 encoder replay): it re-runs the last `max(W, T − (end − hit))` prefix
        tokens (all of them when fewer), W the sliding window and T = min(R, end) the decoder tail, so
        the encoder's windows are whole again when the suffix starts and the decoder tail is the full
        prompt's last T positions. Exact mode (T = end) re-runs the whole prefix. SPEC's worked example:
        hit 4096, prompt 4100, W = R = 128 → `[3968, 4100)`, decoder tail `[3972, 4100)`.
        """
        hit, end = jnp.asarray(hit, jnp.int32), jnp.asarray(end, jnp.int32)
        tail = end if policy.exact else jnp.minimum(policy.window, end)
        start = jnp.maximum(jnp.minimum(hit - cfg.sliding_window, end - tail), 0)
        return cls(start=start, end=end, hit=hit)

    @classmethod
    def of(cls, chunk: Chunk) -> "Extend":
        """The chunk as a whole extend (a one-call prefill)."""
        return cls(start=chunk.start, end=chunk.end)

    def tail_start(self, policy: ReplayPolicy) -> Array:
        """First position of the decoder tail `[max(start, end − R), end)` [B]."""
        return jnp.maximum(self.start, self.end - policy.window)

    def decoder_floor(self, policy: ReplayPolicy) -> Array:
        """Where the decoder windows of the extend begin [B]: the tail start ("truncate"), or `end − R`
        ("borrow": the prefix's cached decoder ring entries fill the rest of the window)."""
        if policy.short_extend == "borrow":
            return jnp.maximum(self.end - policy.window, 0)
        return self.tail_start(policy)

    def encoder_floor(self) -> Array:
        """Where the encoder windows begin [B]: `start` when the extend replays a prefix (the rings hold
        nothing older), else 0."""
        if self.hit is None:
            return jnp.zeros_like(self.start)
        return jnp.where(self.start < self.hit, self.start, 0)


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
    cut: whether the tail is a selection of rows (replay) or every row (exact mode); when cut, a
        compressing split layer runs its compressor on every row, then continues on the tail, and
        any other split layer runs on the tail only (`csa2.stack.segments`).
    tail: the decoder tail.
    """

    split: int
    cut: bool
    tail: DecoderTail


def plan(cfg: ModelConfig, policy: ReplayPolicy, chunk: Chunk, s: int, floor: Array,
         extend: Extend | None = None) -> ReplayPlan:
    """The plan of a chunk of `s` columns (`chunk.n_valid` real) of `extend` (None: the chunk is the
    whole extend) on rows whose decoder floor is `floor [B]`.

    Exact mode keeps every row and the floor. With a window R the tail is the chunk's rows inside the
    extend's decoder tail (at most `min(R, s)`: a static width; none when the chunk ends before the
    tail starts) and the floor of a row that receives tokens rises to the tail start; a row with
    `n_valid = 0` keeps its floor.
    """
    if policy.exact:
        rows = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32)[None], (chunk.start.shape[0], s))
        tail = DecoderTail(rows=rows, chunk=chunk.replace(floor=floor))
        return ReplayPlan(split=policy.split(cfg), cut=False, tail=tail)
    extend = Extend.of(chunk) if extend is None else extend
    first = extend.tail_start(policy)  # [B]
    offset = jnp.clip(first - chunk.start, 0, chunk.n_valid)  # [B] first chunk row of the tail
    t = min(policy.window, s)
    rows = jnp.minimum(offset[:, None] + jnp.arange(t, dtype=jnp.int32)[None], s - 1)  # [B, T]
    floor = jnp.where(chunk.n_valid > 0, jnp.maximum(floor, extend.decoder_floor(policy)), floor)
    tail = DecoderTail(rows=rows, chunk=Chunk(start=chunk.start + offset, n_valid=chunk.n_valid - offset, floor=floor))
    return ReplayPlan(split=policy.split(cfg), cut=True, tail=tail)
