"""KV-selection baselines (SPEC §14) as read policies over this model's Global KV, at an equal read budget.

CSA2 reads, per query, its sliding window plus `index_topk` Global entries chosen by the lightning indexer
(SPEC §5). A policy here replaces *which* `index_topk` Global entries a layer reads; the window, the sink and
everything else stay. `forward(..., instrument=KVSelection(policy, start))` applies it to every layer that reads
Global KV (the model's read hook, `csa2.hooks`), each
layer choosing with its own queries, for the queries at positions ≥ `start`: the earlier ones are the prefill
and read the model's own top-k, identical for every policy, so the policies differ only in what the steps
after the prompt read (the one-shot policies compress the cache at `start`). Every policy reads at most
`index_topk` entries per step and head (PyramidKV: on average over the layers), so `index_topk` is the read budget.

| policy         | reads per step                                   | keeps         | loses for ever                 |
|----------------|--------------------------------------------------|---------------|--------------------------------|
| `StreamingLLM` | the first `sinks` entries + the newest           | what it reads | every other entry              |
| `H2O`          | heavy hitters (cumulative attention) + newest    | what its      | each entry it evicts           |
|                |                                                  | heads read    |                                |
| `SnapKV`       | prompt entries chosen once at `start` + newest   | what its      | unchosen prompt entries, later |
|                |                                                  | heads read    | ones past the newest           |
| `PyramidKV`    | SnapKV with per-layer budgets, deep layers fewer | as SnapKV     | as SnapKV                      |
| `Quest`        | the pages of largest upper bound (+ the newest)  | every entry   | nothing                        |
| `Oracle`       | the entries of largest true attention            | every entry   | nothing                        |

Each policy is a pure function of a `View` (one layer's queries, every Global entry, the window's share of
the softmax) to a read mask; `Policy.read` turns it into the entry ids the layer reads, a block of queries at a
time, so that no whole layer's `[B, S, H, N]` mask is built. Attention scores are the SPEC §3
sink softmax. The policies that rank entries by them (H2O, SnapKV, PyramidKV, Quest: `PerHead`) choose for each head
on its own, as their papers do (the default): a mask `[B, S, H, N]`, each head attending over its own set
(`csa2.attention.read_attention`), the budget per head; with `per_head=False` they pool the scores over heads into
one mask `[B, S, N]` that the heads share, as CSA2's top-k is (the oracle and StreamingLLM always do).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import chex
import jax
import jax.numpy as jnp
import numpy as np

from csa2.boundary import concrete
from csa2.config import ModelConfig
from csa2.hooks import Instrument, Sight
from csa2.indexer import select_topk
from csa2.layout import layer_plan
from csa2.replay import ReplayPolicy
from pallas_kernels import reference
from pallas_kernels.stored import NO_ENTRY

Array = jax.Array
BLOCK = 256  # queries at a time where a whole layer's per-query arrays [B, S, H, N] would not fit in memory


# ---------------------------------------------------------------------------------------------
# What a policy sees

@chex.dataclass(frozen=True)
class View:
    """One layer's queries and its group's Global KV (batch B, queries S, heads H, entries N, dim D).

    q [B, S, H, D] rotated main queries; keys [B, N, D] every Global entry, decoded (K = V, SPEC §3);
    rest [B, S, H] log of what the window entries and the sink add to each head's softmax denominator;
    visible [B, S] the number of entries each query may read (SPEC §4); positions [B, S].
    """

    q: Array
    keys: Array
    rest: Array
    visible: Array
    positions: Array

    @property
    def entries(self) -> int:
        return self.keys.shape[1]

    def dense(self) -> Array:
        """Whether each entry is visible to each query `[B, S, N]`."""
        return jnp.arange(self.entries) < self.visible[..., None]

    def logits(self) -> Array:
        """`q_h · k_e · D^-½` `[B, S, H, N]`, −inf where not visible (SPEC §3)."""
        logits = jnp.einsum("bshd,bnd->bshn", self.q.astype(jnp.float32), self.keys.astype(jnp.float32),
                            precision=jax.lax.Precision.HIGHEST) * self.q.shape[-1] ** -0.5
        return jnp.where(self.dense()[:, :, None, :], logits, -jnp.inf)

    def probs(self) -> Array:
        """Per-head dense sink-softmax probabilities `[B, S, H, N]`: the window and every visible entry in the
        softmax (SPEC §3 without top-k)."""
        return sink_softmax(self.logits(), self.rest)

    def mass(self, block: int = BLOCK) -> Array:
        """Dense attention probability of each entry `[B, S, N]`, averaged over heads (`research.probe`'s mass),
        `block` queries at a time: the per-head probabilities of one block `[B, block, H, N]` are the largest
        array, so a 16K-token layer needs O(S·N), not O(S·H·N), memory."""
        return self.by_blocks(lambda part: jnp.mean(part.probs(), axis=2), block)  # [B, S, N]

    def by_blocks(self, fn, block: int) -> Array:
        """`fn(part)` over views of at most `block` of the queries (every entry), joined `[B, S, ...]`: `fn` must
        treat each query on its own (what it gives a query may not depend on the others in its block)."""
        def one_block(part):
            return fn(View(keys=self.keys, **part)), None

        per_query = dict(q=self.q, rest=self.rest, visible=self.visible, positions=self.positions)
        return map_query_blocks(one_block, per_query, block)[0]


def map_query_blocks(fn, per_query: dict, block: int) -> tuple[Any, Any]:
    """`fn` over blocks of at most `block` queries of `per_query` (`[B, S, ...]` arrays; the last block is padded
    with zeros, so its padded queries see no entry): `fn(part) -> (rows, extra)`, `rows` per-query results
    `[B, size, ...]` joined back to `[B, S, ...]`, `extra` stacked `[blocks, ...]`."""
    b, s = next(iter(per_query.values())).shape[:2]
    size = min(block, s)
    blocks = -(-s // size)
    pad = blocks * size - s

    def split(x):
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x.reshape(b, blocks, size, *x.shape[2:]), 1, 0)

    def join(x):
        return jnp.moveaxis(x, 0, 1).reshape(b, blocks * size, *x.shape[3:])[:, :s]

    rows, extra = jax.lax.map(fn, jax.tree.map(split, per_query))
    return jax.tree.map(join, rows), extra


def mask_ids(mask: Array, width: int) -> Array:
    """The entries of a read mask `[..., N]` as ascending ids `[..., width]`, −1-padded (at most `width` set)."""
    return select_topk(jnp.zeros(mask.shape, jnp.float32), mask, width)


def id_mask(ids: Array, n: int) -> Array:
    """The valid ids `[..., K]` (−1 = none) as a mask `[..., n]`."""
    slot = jnp.where(ids < 0, n, ids)  # one spare column takes the missing ones
    return jnp.put_along_axis(jnp.zeros((*ids.shape[:-1], n + 1), bool), slot, True, axis=-1, inplace=False)[..., :n]


def sink_softmax(logits: Array, rest: Array) -> Array:
    """`exp(l_e − lse)` with `lse = log(Σ_e exp(l_e) + exp(rest))` over the last axis: logits `[..., N]`
    (−inf = not in the softmax), rest `[...]` the rest of the denominator (window entries and sink)."""
    lse = jnp.logaddexp(jax.nn.logsumexp(logits, axis=-1), rest)
    return jnp.exp(logits - lse[..., None])


def view(sight: Sight) -> View:
    """The `View` of one layer that reads Global KV (`csa2.hooks.Sight`)."""
    q, source = sight.q, sight.source
    b = q.shape[0]
    ids = jnp.broadcast_to(jnp.arange(source.entries, dtype=jnp.int32), (b, source.entries))
    keys = source.kv.gather(source.rows(ids))  # [B, N, D]
    window_keys, window_valid = reference.gather_entries(sight.window, sight.window_idx)  # [B, S, W, D]
    logits = jnp.einsum("bshd,bswd->bshw", q.astype(jnp.float32), window_keys,
                        precision=jax.lax.Precision.HIGHEST) * q.shape[-1] ** -0.5
    logits = jnp.where(window_valid[:, :, None, :], logits, -jnp.inf)
    rest = jnp.logaddexp(jax.nn.logsumexp(logits, axis=-1), sight.sink.astype(jnp.float32)[None, None, :])
    return View(q=q, keys=keys, rest=rest, visible=sight.visible(), positions=sight.positions)


# ---------------------------------------------------------------------------------------------
# Building blocks (masks [..., N])

def newest(visible: Array, count: Array, n: int) -> Array:
    """The newest `count` of the `visible` entries `[..., N]` (entries `[visible − count, visible)`)."""
    i = jnp.arange(n)
    return (i < visible[..., None]) & (i >= (visible - count)[..., None])


def fill_newest(keep: Array, dense: Array, budget: Array | int) -> Array:
    """`keep` plus the newest entries of `dense` not in it, up to `budget` entries in all (masks `[..., N]`)."""
    free = dense & ~keep
    younger = jnp.cumsum(free[..., ::-1], axis=-1)[..., ::-1] - free  # free entries newer than each entry
    room = budget - jnp.sum(keep, axis=-1, keepdims=True)
    return keep | (free & (younger < room))


def top(scores: Array, where: Array, count: Array | int) -> Array:
    """The `count` entries of largest score among `where` (masks `[..., N]`, `where` broadcast to the scores'
    shape; ties: the lower id first). A Python-int `count` takes one partial `top_k`; a traced one (PyramidKV's
    per-layer budgets, one per row) ranks every entry with two sorts."""
    where = jnp.broadcast_to(where, scores.shape)
    if isinstance(count, int):
        k = min(max(count, 0), scores.shape[-1])
        if k == 0:
            return jnp.zeros(scores.shape, bool)
        # −inf scores among `where` must still outrank what is not in it: rank by (where, score) as one key
        key = jnp.where(where, jnp.maximum(scores, jnp.finfo(jnp.float32).min), -jnp.inf)
        _, ids = jax.lax.top_k(key.astype(jnp.float32), k)  # ties: the lower index first
        return id_mask(ids, scores.shape[-1]) & where
    order = jnp.lexsort((jnp.where(where, -scores, 0.0), ~where), axis=-1)  # `where` first, then by score
    rank = jnp.argsort(order, axis=-1, stable=True)
    count = jnp.asarray(count)
    return where & (rank < (count[..., None] if count.ndim else count))


def over_heads(x: Array, groups: int, axis: int, reduce) -> Array:
    """A per-head statistic (heads on `axis`) as `groups` selectors: 1 (`reduce` over every head: one set the
    heads share) or H (each head its own)."""
    heads = x.shape[axis]
    return reduce(x.reshape(x.shape[:axis] + (groups, heads // groups) + x.shape[axis + 1:]), axis=axis + 1)


def _heads_out(mask: Array, per_head: bool) -> Array:
    """A read mask `[B, S, G, N]` as a policy returns it: `[B, S, H, N]` per head, `[B, S, N]` shared (G = 1)."""
    return mask if per_head else mask[:, :, 0]


def recent_count(budget: Array | int, share: float) -> Array | int:
    """How many of a `budget` the newest entries take: ⌊share · budget⌋."""
    if isinstance(budget, int):
        return int(np.floor(budget * share))
    return jnp.floor(budget * share).astype(jnp.int32)


# ---------------------------------------------------------------------------------------------
# The policies: pure functions View → read mask [B, S, N]

def oracle(v: View, budget: int) -> Array:
    """The `budget` entries of largest true attention (head-mean dense probability) at every query, ties to the
    lower id (`top`: one partial `top_k` for the int budget)."""
    return top(v.mass(), v.dense(), budget)


def streaming_llm(v: View, budget: Array | int, sinks: int) -> Array:
    """StreamingLLM: the first `sinks` entries (attention sinks) and the newest ones."""
    dense = v.dense()
    return fill_newest(dense & (jnp.arange(v.entries) < sinks), dense, budget)


def h2o(v: View, budget: int, recent: float, start: Array | int, per_head: bool, emit=None) -> Array:
    """H2O: heavy hitters by cumulative attention plus the newest `⌊recent · budget⌋` entries.

    Before `start` (the prefill; an int or one per row [B]) every query attends densely and its
    probabilities accumulate; from `start` on a query reads its kept set (heavy hitters ∪ newest), its
    probabilities over that set (the window and sink in the denominator) accumulate, and when an entry
    leaves the newest ones the `budget − ⌊recent · budget⌋` kept entries of largest cumulative score stay
    heavy: the others are evicted for ever. Each head keeps its own scores and set (`per_head`, `[B, S, H, N]`,
    as the paper), or the scores are summed over heads into one set they share (`[B, S, N]`). `emit` maps each
    step's read mask `[B, G, N]` to what the scan stacks (default: the mask; `H2O.read` stacks its ids instead, so
    a 16K-token layer holds O(S·G·K), not O(S·G·N)).
    """
    b, n, heads = v.visible.shape[0], v.entries, v.q.shape[2]
    groups = heads if per_head else 1
    newest_count = recent_count(budget, recent)
    heavy_count = budget - newest_count
    vis_next = jnp.concatenate([v.visible[:, 1:], v.visible[:, -1:]], axis=1)  # the next query's count

    def step(carry, xs):
        acc, heavy = carry  # [B, G, N] float, bool
        q, rest, vis, pos, nxt, before = xs  # [B, H, D], [B, H], [B], [B], [B], [B]
        # this query's logits [B, H, N] (View.logits of its position alone: O(H·N) memory per step)
        logit = View(q=q[:, None], keys=v.keys, rest=rest[:, None], visible=vis[:, None],
                     positions=pos[:, None]).logits()[:, 0]
        dense = (jnp.arange(n) < vis[:, None])[:, None, :]  # [B, 1, N]
        read = jnp.where(before[:, None, None], dense, fill_newest(heavy & dense, dense, budget))  # [B, G, N]
        probs = sink_softmax(jnp.where(jnp.repeat(read, heads // groups, axis=1), logit, -jnp.inf), rest)
        acc = acc + over_heads(probs, groups, 1, jnp.sum)
        candidates = read & ~newest(nxt, newest_count, n)[:, None, :]  # what leaves the newest may stay heavy
        return (acc, top(acc, candidates, heavy_count)), read if emit is None else emit(read)

    prefill = (v.positions < _per_row(start, b)[:, None]).T  # [S, B]
    xs = (jnp.moveaxis(v.q, 1, 0), jnp.moveaxis(v.rest, 1, 0), v.visible.T, v.positions.T, vis_next.T, prefill)
    init = (jnp.zeros((b, groups, n), jnp.float32), jnp.zeros((b, groups, n), bool))
    _, reads = jax.lax.scan(step, init, xs)  # [S, B, G, N] (or what `emit` makes of each step)
    return _heads_out(jnp.moveaxis(reads, 0, 1), per_head)


def snapkv(v: View, budget: Array | int, recent: float, window: int, kernel: int, start: Array | int,
           per_head: bool) -> Array:
    """SnapKV: at `start`, the last `window` prompt queries' attention (summed over those queries, max-pooled over
    `kernel` neighbouring entries) chooses `budget − ⌊recent · budget⌋` prompt entries, once; every later query
    reads them and the newest entries up to `budget`. Each head chooses by its own attention (`per_head`,
    `[B, S, H, N]`, as the paper), or all by their mean attention (`[B, S, N]`)."""
    return snapkv_reads(v, snapkv_choice(v, budget, recent, window, kernel, start, per_head), budget, per_head)


def snapkv_choice(v: View, budget: Array | int, recent: float, window: int, kernel: int, start: Array | int,
                  per_head: bool) -> Array:
    """The prompt entries SnapKV chooses at `start` `[B, G, N]` (G = H per head, else 1), as `snapkv` says."""
    b, s, heads = v.q.shape[:3]
    n = v.entries
    start = _per_row(start, b)[:, None]
    # The observation queries alone (at most `window` rows, whichever part of them this call holds).
    rows = jnp.clip(start - window + jnp.arange(window) - v.positions[:, :1], 0, s - 1)  # [B, window]

    def take(x):
        return jnp.take_along_axis(x, rows.reshape(rows.shape + (1,) * (x.ndim - 2)), axis=1)

    obs = View(q=take(v.q), keys=v.keys, rest=take(v.rest), visible=take(v.visible), positions=take(v.positions))
    observed = (obs.positions >= start - window) & (obs.positions < start)  # [B, window]
    scores = jnp.sum(jnp.where(observed[:, :, None, None], obs.probs(), 0.0), axis=1)  # [B, H, N]
    scores = over_heads(scores, heads if per_head else 1, 1, jnp.mean)  # [B, G, N]
    half = kernel // 2
    padded = jnp.pad(scores, [(0, 0), (0, 0), (half, half)], constant_values=-jnp.inf)
    pooled = jnp.max(jnp.stack([padded[..., j:j + n] for j in range(kernel)]), axis=0)
    at_start = jnp.max(jnp.where(observed, obs.visible, 0), axis=1)  # entries visible at the prompt's end [B]
    recent_n = recent_count(budget, recent)
    older = jnp.arange(n) < (at_start - recent_n)[:, None, None]  # not among the newest at the prompt's end
    return top(pooled, older, budget - recent_n)


def snapkv_reads(v: View, chosen: Array, budget: Array | int, per_head: bool) -> Array:
    """What SnapKV's queries read once it has `chosen` its prompt entries `[B, G, N]`: those and the newest
    visible entries up to `budget`. Each query on its own: `v` may hold any block of the queries."""
    dense = v.dense()[:, :, None, :]
    return _heads_out(fill_newest(chosen[:, None] & dense, dense, budget), per_head)


def quest(v: View, budget: int, page: int, per_head: bool) -> Array:
    """Quest: pages of `page` entries with per-channel key min and max; a query bounds each page's logit by
    `Σ_i max(q_i · max_i, q_i · min_i)`, reads the `budget // page` pages of largest bound, the newest (partial)
    page always among them; nothing is evicted. Each head reads by its own bound (`per_head`, `[B, S, H, N]`, as
    the paper), or all by the largest bound over heads (`[B, S, N]`)."""
    b, n, d = v.keys.shape
    pages = -(-n // page)
    keys = jnp.pad(v.keys.astype(jnp.float32), [(0, 0), (0, pages * page - n), (0, 0)]).reshape(b, pages, page, d)
    hi, lo = jnp.max(keys, axis=2), jnp.min(keys, axis=2)  # [B, P, D]
    q = v.q.astype(jnp.float32)
    # max(q·hi, q·lo) per channel = q·(hi + lo)/2 + |q|·(hi − lo)/2, summed over channels.
    bound = (jnp.einsum("bshd,bpd->bshp", q, (hi + lo) / 2, precision=jax.lax.Precision.HIGHEST)
             + jnp.einsum("bshd,bpd->bshp", jnp.abs(q), (hi - lo) / 2, precision=jax.lax.Precision.HIGHEST))
    score = over_heads(bound, v.q.shape[2] if per_head else 1, 2, jnp.max)  # [B, S, G, P]
    p = jnp.arange(pages)
    newest_page = ((v.visible - 1) // page)[..., None, None]
    score = jnp.where(p == newest_page, jnp.inf, score)
    chosen = top(score, p * page < v.visible[..., None, None], budget // page)  # [B, S, G, P]
    return _heads_out(jnp.repeat(chosen, page, axis=-1)[..., :n] & v.dense()[:, :, None, :], per_head)


# ---------------------------------------------------------------------------------------------
# Policies as static configuration (hashable: `forward` compiles one program per policy)

@dataclasses.dataclass(frozen=True)
class Policy:
    """A read policy (its settings; where it starts is the caller's `start`, an int or one per row [B])."""

    name: ClassVar[str] = ""
    evicts: ClassVar[bool] = True  # whether what it does not read is gone for ever (kept = read)

    def mask(self, cfg: ModelConfig, v: View, layer: Array, start: Array) -> Array:
        """The read mask `[B, S, N]` of layer `layer` (may be traced) at budget `cfg.index_topk`, for queries
        from `start` [B] on (the prefill before it informs the one-shot and cumulative policies)."""
        raise NotImplementedError

    def read(self, cfg: ModelConfig, v: View, layer: Array, start: Array, block: int = BLOCK) -> Array:
        """The ids of `mask` (`[B, S, width]`, per head `[B, S, H, width]`; ascending, −1-padded), `block` queries
        at a time (a policy whose queries' masks depend on one another overrides this)."""
        width = self.width(cfg)
        return v.by_blocks(lambda part: mask_ids(self.mask(cfg, part, layer, start), width), block)

    def width(self, cfg: ModelConfig) -> int:
        """The most entries one layer reads per query (per head where it reads per head)."""
        return cfg.index_topk

    def heads(self, cfg: ModelConfig) -> int:
        """How many read sets a layer reads per query: 1, shared by its heads (`mask` `[B, S, N]`), or one per head
        (`[B, S, H, N]`)."""
        return 1

    def check(self, cfg: ModelConfig, length: int, start: np.ndarray | None) -> None:
        """ValueError naming the field when this policy cannot run on `length` tokens of `cfg` from `start`
        (None: traced, unknown)."""
        if start is not None and not np.all((0 <= start) & (start <= length)):
            raise ValueError(f"policy_start={start}: the first position read by the policy must be in "
                             f"[0, {length}] for {length} tokens")

    def _share(self, field: str, value: float) -> None:
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{type(self).__name__}.{field}={value}: a share of the budget, in [0, 1]")


@dataclasses.dataclass(frozen=True)
class Oracle(Policy):
    name: ClassVar[str] = "oracle"
    evicts: ClassVar[bool] = False

    def mask(self, cfg, v, layer, start):
        return oracle(v, cfg.index_topk)


@dataclasses.dataclass(frozen=True)
class StreamingLLM(Policy):
    sinks: int = 4
    name: ClassVar[str] = "streamingllm"

    def mask(self, cfg, v, layer, start):
        return streaming_llm(v, cfg.index_topk, self.sinks)

    def check(self, cfg, length, start):
        super().check(cfg, length, start)
        if not 0 <= self.sinks <= cfg.index_topk:
            raise ValueError(f"StreamingLLM.sinks={self.sinks}: the sink entries must fit the budget "
                             f"index_topk={cfg.index_topk}")


@dataclasses.dataclass(frozen=True)
class PerHead(Policy):
    """A policy that chooses by attention scores: for each head on its own, as its paper does (the default), or
    once for all the heads from their pooled scores, as CSA2's top-k is shared (`per_head=False`)."""

    per_head: bool = dataclasses.field(default=True, kw_only=True)

    def heads(self, cfg):
        return cfg.num_attention_heads if self.per_head else 1


@dataclasses.dataclass(frozen=True)
class H2O(PerHead):
    recent: float = 0.5  # share of the budget that reads the newest entries; the rest holds heavy hitters
    name: ClassVar[str] = "h2o"

    def mask(self, cfg, v, layer, start):
        return h2o(v, cfg.index_topk, self.recent, start, self.per_head)

    def read(self, cfg, v, layer, start, block=BLOCK):
        """One scan over the queries (each step's scores carry to the next; `block` does not apply): it stacks each
        step's ids, not its mask."""
        width = self.width(cfg)
        return h2o(v, cfg.index_topk, self.recent, start, self.per_head, emit=lambda read: mask_ids(read, width))

    def check(self, cfg, length, start):
        super().check(cfg, length, start)
        self._share("recent", self.recent)


@dataclasses.dataclass(frozen=True)
class SnapKV(PerHead):
    recent: float = 0.25  # share of the budget that reads the newest entries; the rest is chosen at `start`
    window: int = 8  # observation queries: the last `window` prompt positions
    kernel: int = 5  # max-pooling width over neighbouring entries (odd)
    name: ClassVar[str] = "snapkv"

    def budget(self, cfg: ModelConfig, layer: Array) -> Array | int:
        return cfg.index_topk

    def mask(self, cfg, v, layer, start):
        return snapkv(v, self.budget(cfg, layer), self.recent, self.window, self.kernel, start, self.per_head)

    def read(self, cfg, v, layer, start, block=BLOCK):
        """The choice at `start` from the whole prompt, then the reads `block` queries at a time."""
        budget = self.budget(cfg, layer)
        chosen = snapkv_choice(v, budget, self.recent, self.window, self.kernel, start, self.per_head)
        width = self.width(cfg)
        return v.by_blocks(lambda part: mask_ids(snapkv_reads(part, chosen, budget, self.per_head), width), block)

    def check(self, cfg, length, start):
        super().check(cfg, length, start)
        self._share("recent", self.recent)
        if self.window < 1:
            raise ValueError(f"{type(self).__name__}.window={self.window}: observe at least one prompt query")
        if start is not None and np.any(start < self.window):
            raise ValueError(f"policy_start={start}: {type(self).__name__} observes the last window={self.window} "
                             "prompt queries; start the policy after at least that many")
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise ValueError(f"{type(self).__name__}.kernel={self.kernel}: use an odd pooling width ≥ 1")


@dataclasses.dataclass(frozen=True)
class PyramidKV(SnapKV):
    beta: float = 4.0  # the deepest Global layer reads budget/beta, the first 2·budget − budget/beta
    name: ClassVar[str] = "pyramidkv"

    def budgets(self, cfg: ModelConfig) -> np.ndarray:
        """Per-layer budgets `[L]` (0 on SWA layers): an arithmetic sequence down the layers that read Global
        KV from `2K − K/β` to `K/β`, K = `index_topk`, whose mean is exactly K."""
        readers = [s.index for s in layer_plan(cfg) if s.role != "swa"]
        k = cfg.index_topk
        steps = np.floor(np.linspace(2 * k - k / self.beta, k / self.beta, len(readers))).astype(np.int64)
        steps[:k * len(readers) - int(steps.sum())] += 1  # the rounding deficit, one entry each from the bottom
        out = np.zeros(cfg.num_hidden_layers, np.int64)
        out[readers] = steps
        return out

    def budget(self, cfg, layer):
        return jnp.asarray(self.budgets(cfg), jnp.int32)[layer]

    def width(self, cfg):
        return int(self.budgets(cfg).max())

    def check(self, cfg, length, start):
        super().check(cfg, length, start)
        if not 1.0 <= self.beta <= cfg.index_topk:
            raise ValueError(f"PyramidKV.beta={self.beta}: the deepest layer reads index_topk/beta entries; "
                             f"use 1 ≤ beta ≤ index_topk={cfg.index_topk}")


@dataclasses.dataclass(frozen=True)
class Quest(PerHead):
    page: int = 8  # entries per page
    name: ClassVar[str] = "quest"
    evicts: ClassVar[bool] = False

    def mask(self, cfg, v, layer, start):
        return quest(v, cfg.index_topk, self.page, self.per_head)

    def check(self, cfg, length, start):
        super().check(cfg, length, start)
        if self.page < 1 or cfg.index_topk % self.page:
            raise ValueError(f"Quest.page={self.page}: the budget index_topk={cfg.index_topk} must be a whole "
                             "number of pages")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVSelection(Instrument):
    """Every layer that reads Global KV reads what `policy` chooses for the queries at positions ≥ `start` (an
    int or one per row [B]); the earlier positions, the prefill, read the model's own top-k."""

    policy: Policy = dataclasses.field(metadata=dict(static=True))
    start: Array | int

    def width(self, cfg: ModelConfig) -> int:
        return self.policy.width(cfg)

    def heads(self, cfg: ModelConfig) -> int:
        return self.policy.heads(cfg)

    def read(self, cfg: ModelConfig, sight: Sight) -> Array:
        """The entry ids `[B, S, policy.width(cfg)]` (per head: `[B, S, H, width]`; ascending, −1-padded) the layer
        reads; before `start` every head reads the model's own top-k."""
        ids = self.policy.read(cfg, view(sight), sight.layer, self.start)
        width = self.policy.width(cfg)
        topk = sight.bus.topk
        own = jnp.pad(topk, [(0, 0), (0, 0), (0, width - topk.shape[-1])], constant_values=NO_ENTRY)
        positions = sight.positions
        after = positions >= _per_row(self.start, positions.shape[0])[:, None]  # [B, S]
        if ids.ndim == 4:  # one set per head
            own, after = own[:, :, None, :], after[..., None]
        return jnp.where(after[..., None], ids, own)

    def check(self, cfg: ModelConfig, tokens: tuple[int, int], replay: ReplayPolicy) -> None:
        if not isinstance(self.policy, Policy):
            raise ValueError(f"KVSelection.policy={self.policy!r}: pass a research.selection policy (Oracle, "
                             "StreamingLLM, H2O, SnapKV, PyramidKV, Quest)")
        if not replay.exact:
            raise ValueError(f"policy={self.policy} with replay={replay}: a policy reads for every layer on every "
                             "position; use replay=EXACT")
        if jnp.shape(self.start) not in ((), tuple(tokens[:1])):
            raise ValueError(f"policy_start={self.start}: give KVSelection.start, the first position the policy "
                             f"reads, as an int or one per row [{tokens[0]}]")
        self.policy.check(cfg, tokens[1], concrete(self.start))


def _per_row(start: Array | int, b: int) -> Array:
    """`start` (an int or [B]) as int32 [B]."""
    return jnp.broadcast_to(jnp.asarray(start, jnp.int32), (b,))
