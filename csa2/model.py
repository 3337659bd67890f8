"""The CED model and its pure entry points (SPEC §9–§12, DESIGN §3).

embed → hc expand → encoder layers → decoder layers (layer 20's compressor projects the encoder
output into the decoder's Global KV) → final collapse → norm → LM head.

Every entry point is a pure function of `(cfg, params, state, tokens)` that returns new values:
`prefill` (one chunk per call, optionally with the bounded decoder replay of SPEC §11),
`decode_step`, `verify` (γ+1 tokens, speculative state), `commit` (set `length`), `fork`
(gather rows) and `forward` (teacher-forced logits for training). Runs of layers with the same
structure are stacked and scanned (DESIGN §5), so `tiny` compiles 18 layer bodies, not 40.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from csa2 import cache, engram as engram_lib, mhc
from csa2.attention import Bus, Chunk, attention, empty_bus, init_attention_params, validate_chunk
from csa2.compressor import compress
from csa2.config import ModelConfig
from csa2.layout import LayerSpec, layer_plan
from csa2.moe import init_moe_params, moe
from csa2.norm import rms_norm
from csa2.params import dense, linear, ones
from csa2.state import State, capacity, init_state, token_granule

Array = jax.Array


# ---------------------------------------------------------------------------------------------
# Replay policy and layer runs

REPLAY_SHORT_EXTEND = ("truncate",)


@dataclasses.dataclass(frozen=True)
class ReplayPolicy:
    """Bounded decoder replay of a prompt (SPEC §11).

    window: R, the tail of the prompt that runs through the layers from `split_layer` on
        (None = exact reference mode: every position through every layer);
    split_layer: the first layer that runs on the tail only (None = first decoder layer; SGLang
        uses first decoder layer + 1). Layers before it run on every position.
    short_extend: what a prefill on a non-empty state (prefix hit) replays: "truncate" runs the
        decoder tail on the new tokens only (SGLang main).
    """

    window: int | None = 128
    split_layer: int | None = None
    short_extend: str = "truncate"

    def split(self, cfg: ModelConfig) -> int:
        return cfg.first_decoder_layer if self.split_layer is None else self.split_layer

    def validate(self, cfg: ModelConfig) -> None:
        if self.window is not None and (not isinstance(self.window, int) or self.window < 1):
            raise ValueError(f"ReplayPolicy.window={self.window!r}: use a positive token count, or None for exact mode")
        if self.short_extend not in REPLAY_SHORT_EXTEND:
            raise ValueError(f"ReplayPolicy.short_extend={self.short_extend!r}: implemented: {REPLAY_SHORT_EXTEND}")
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


class Run(NamedTuple):
    """Consecutive layers with the same structure, stacked and scanned as one body."""

    first: int
    count: int
    spec: LayerSpec  # of the first layer; the others differ only in index / index_source


def _structure(spec: LayerSpec) -> tuple:
    return (spec.role, spec.ratio, spec.kv_source, spec.is_encoder, spec.uses_candidates, spec.is_candidate_source)


@functools.lru_cache(maxsize=None)
def layer_runs(cfg: ModelConfig) -> tuple[Run, ...]:
    """Split the plan into runs; Full, Reindex and Engram layers and every decoder boundary stand alone."""
    runs: list[Run] = []
    for spec in layer_plan(cfg):
        alone = spec.role in ("full", "reindex") or spec.has_engram
        if runs and not alone and not runs[-1].spec.has_engram and runs[-1].spec.role not in ("full", "reindex") \
                and _structure(runs[-1].spec) == _structure(spec):
            runs[-1] = runs[-1]._replace(count=runs[-1].count + 1)
        else:
            runs.append(Run(spec.index, 1, spec))
    return tuple(runs)


def _split_runs(cfg: ModelConfig, split: int) -> tuple[Run, ...]:
    """The runs with layer `split` standing alone: it is where the stack enters the decoder tail."""
    plan, out = layer_plan(cfg), []
    for run in layer_runs(cfg):
        end = run.first + run.count
        if run.first <= split < end:
            pieces = [(run.first, split), (split, split + 1), (split + 1, end)]
            out += [Run(a, b - a, plan[a]) for a, b in pieces if b > a]
        else:
            out.append(run)
    return tuple(out)


# ---------------------------------------------------------------------------------------------
# Parameters

def _init_layer(cfg: ModelConfig, spec: LayerSpec, key: Array) -> dict:
    k = jax.random.split(key, 5)
    p = {
        "attn_hc": mhc.init_mhc_params(cfg, k[0]), "attn_norm": ones(cfg.hidden_size),
        "attn": init_attention_params(cfg, spec, k[1]),
        "ffn_hc": mhc.init_mhc_params(cfg, k[2]), "ffn_norm": ones(cfg.hidden_size),
        "moe": init_moe_params(cfg, k[3]),
    }
    if spec.has_engram:
        p["engram"] = engram_lib.init_engram_params(cfg, spec.index, k[4])
    return p


@functools.partial(jax.jit, static_argnums=0)
def init_params(cfg: ModelConfig, key: Array) -> dict:
    """All parameters (float32). `layers` holds one stacked pytree per run of `layer_runs(cfg)`."""
    plan = layer_plan(cfg)
    k_embed, k_head, k_layers = jax.random.split(key, 3)
    keys = jax.random.split(k_layers, cfg.num_hidden_layers)
    # One vmapped init per run (layers of a run share their structure): a small trace, a fast compile.
    layers = tuple(jax.vmap(functools.partial(_init_layer, cfg, plan[run.first]))(keys[run.first:run.first + run.count])
                   for run in layer_runs(cfg))
    return {
        "embed": dense(k_embed, (cfg.vocab_size, cfg.hidden_size), cfg.initializer_range),
        "layers": layers,
        "norm": ones(cfg.hidden_size),
        "head": dense(k_head, (cfg.hidden_size, cfg.vocab_size), cfg.initializer_range),
    }


def _run_params(cfg: ModelConfig, params: dict, run: Run) -> dict:
    """The stacked parameters of `run` (which may be a piece of a run of `layer_runs`)."""
    for base, p in zip(layer_runs(cfg), params["layers"]):
        if base.first <= run.first < base.first + base.count:
            offset = run.first - base.first
            return jax.tree_util.tree_map(lambda x: x[offset:offset + run.count], p)
    raise AssertionError(run)


# ---------------------------------------------------------------------------------------------
# One layer: Engram → attention site → FFN site (SPEC §10, §10b)

class Streams(NamedTuple):
    """What flows between layers: residual streams X [B, S, n, d], the pre handed on [B, S, n], the bus."""

    X: Array
    pre: Array
    bus: Bus


class Tail(NamedTuple):
    """Where the replay tail starts (SPEC §11): the chunk rows it keeps [B, T] and its chunk."""

    rows: Array
    chunk: Chunk


def _take_rows(x: Array, rows: Array) -> Array:
    """x [B, S, ...] → x[b, rows[b, j]] [B, T, ...]."""
    return jax.vmap(lambda a, i: a[i])(x, rows)


def _site_input(cfg: ModelConfig, hc: dict, norm: Array, X: Array, pre_prev: Array):
    """mHC coefficients of a site and its normed collapsed input (single-pass or standard, SPEC §10)."""
    pre, post, comb = mhc.coefficients(cfg, hc, X)
    y = mhc.collapse(X, pre_prev if cfg.mhc_single_pass else pre)
    return rms_norm(y, norm, cfg.rms_norm_eps), pre, post, comb


def _layer(cfg: ModelConfig, spec: LayerSpec, p: dict, streams: Streams, chunk: Chunk, ring, gkv, tail,
           engram_rows: Array | None, quantize: bool, index_loss: str | None, enter: Tail | None = None):
    """One layer on a chunk. A Full layer compresses its own input first; at the replay split
    (`enter`) the compressor still sees every position and the rest continues on the tail."""
    X = streams.X
    if spec.has_engram:
        X = engram_lib.engram(cfg, p["engram"], X, engram_rows, chunk.valid(X.shape[1]))
    x, pre, post, comb = _site_input(cfg, p["attn_hc"], p["attn_norm"], X, streams.pre)
    if spec.role == "full":
        gkv, tail = compress(cfg, p["attn"]["compressor"], spec.ratio, gkv, tail, x, chunk.start, chunk.n_valid,
                             quantize=quantize)
    bus = streams.bus
    if enter is not None:
        X, x, pre, post, comb = (_take_rows(a, enter.rows) for a in (X, x, pre, post, comb))
        bus = Bus(topk=_take_rows(bus.topk, enter.rows), candidates=_take_rows(bus.candidates, enter.rows))
        chunk = enter.chunk
    out, ring, bus, kl = attention(cfg, spec, p["attn"], x, chunk, ring, gkv, bus, quantize=quantize,
                                   index_loss=index_loss)
    X = mhc.update(X, out, post, comb)
    x, ffn_pre, post, comb = _site_input(cfg, p["ffn_hc"], p["ffn_norm"], X, pre)
    y, load = moe(cfg, p["moe"], x)
    X = mhc.update(X, y, post, comb)
    return Streams(X, ffn_pre, bus), ring, gkv, tail, (load, kl)


def _scan_run(cfg: ModelConfig, run: Run, p: dict, streams: Streams, chunk: Chunk, ring, gkv, tail,
              engram_rows, quantize: bool, index_loss: str | None, enter: Tail | None):
    """`run.count` layers as one scanned body over their stacked params and rings [count, B, ...].

    The layer entering the replay tail changes the row count, so it runs unscanned (it stands alone).
    """
    if enter is not None:
        first = lambda x: None if x is None else x[0]  # noqa: E731
        streams, ring, gkv, tail, aux = _layer(cfg, run.spec, jax.tree_util.tree_map(first, p), streams, chunk,
                                               tuple(map(first, ring)), gkv, tail, engram_rows, quantize,
                                               index_loss, enter)
        return (streams, tuple(None if r is None else r[None] for r in ring), gkv, tail,
                jax.tree_util.tree_map(lambda a: a[None], aux))

    def body(carry, xs):
        streams, gkv, tail = carry
        p_l, ring_l = xs
        streams, ring_l, gkv, tail, aux = _layer(cfg, run.spec, p_l, streams, chunk, ring_l, gkv, tail,
                                                 engram_rows, quantize, index_loss)
        return (streams, gkv, tail), (ring_l, aux)

    (streams, gkv, tail), (ring, aux) = jax.lax.scan(body, (streams, gkv, tail), (p, ring))
    return streams, ring, gkv, tail, aux


# ---------------------------------------------------------------------------------------------
# The layer stack over one chunk

class StackOut(NamedTuple):
    streams: Streams  # of the rows that reached the last layer ([B, T, ...])
    rows: Array  # [B, T] chunk rows of `streams`
    state: State
    load: Array  # [L, E] MoE load per layer
    index_kl: Array  # [L] indexer KL loss per layer (SPEC §13; 0 where not computed)
    work: Array  # int32: token×layer count actually processed (instrumentation, SPEC §11)


def _history(cfg: ModelConfig, state: State, tokens: Array, start: Array) -> Array:
    """The Engram window [B, N−1+S]: the N−1 tokens before the chunk (pad before position 0), then the chunk."""
    n = cfg.engram_max_ngram_size - 1
    pos = start[:, None] - n + jnp.arange(n, dtype=jnp.int32)[None]  # [B, N−1]
    past = jnp.take_along_axis(state.tokens, pos % state.tokens.shape[1], axis=1)
    return jnp.concatenate([jnp.where(pos >= 0, past, cfg.engram_pad_id), tokens], axis=1)


def _stack(cfg: ModelConfig, params: dict, state: State, tokens: Array, n_valid: Array,
           replay: ReplayPolicy, quantize: bool, index_loss: str | None = None) -> StackOut:
    """Every layer on one chunk per row (`tokens [B, S]` at positions `length + j`, `n_valid` real).

    Layers before the replay split run on all rows; from the split on, only the last
    `T = min(R, S)` real rows of each row (all rows in exact mode) with the decoder SWA floored
    at the tail start (SPEC §11).
    """
    b, s = tokens.shape
    start = state.length
    chunk = Chunk(start=start, n_valid=n_valid, floor=jnp.zeros_like(start))
    split = replay.split(cfg)
    t = s if replay.window is None else min(replay.window, s)
    offset = jnp.maximum(n_valid - t, 0)  # [B] first chunk row of the tail
    rows = jnp.minimum(offset[:, None] + jnp.arange(t, dtype=jnp.int32)[None], s - 1)  # [B, T]
    floor = state.floor if replay.window is None else jnp.maximum(state.floor, start + offset)
    tail = Tail(rows, Chunk(start=start + offset, n_valid=n_valid - offset, floor=floor))

    history = _history(cfg, state, tokens, start) if cfg.engram_layer_ids else None
    X = mhc.expand(params["embed"][tokens], cfg.hc_mult)  # [B, S, n, d]
    first = jnp.broadcast_to(mhc.first_pre(cfg.hc_mult), (b, s, cfg.hc_mult))
    streams = Streams(X, first, empty_bus(cfg, b, s))
    gkv, tails = list(state.global_kv), list(state.tails)
    rings, loads, kls, work = [], [], [], jnp.zeros((), jnp.int32)
    for run in _split_runs(cfg, split):
        spec = run.spec
        g = None if spec.kv_source is None else cfg.kv_source_layer_ids.index(spec.kv_source)
        on_tail = run.first >= split
        enter = tail if run.first == split and replay.window is not None else None
        here = tail.chunk if on_tail else chunk
        engram_rows = None
        if spec.has_engram:
            engram_rows = engram_lib.engram_hashes(cfg, spec.index, history)
            if on_tail and enter is None:
                engram_rows = _take_rows(engram_rows, tail.rows)
        layers = slice(run.first, run.first + run.count)
        ring = (state.swa.kv[layers], None if state.swa.scale is None else state.swa.scale[layers])
        streams, ring, gkv_g, tail_g, (load, kl) = _scan_run(
            cfg, run, _run_params(cfg, params, run), streams, chunk if enter is not None else here, ring,
            None if g is None else gkv[g], None if g is None else tails[g], engram_rows, quantize, index_loss, enter)
        if g is not None:
            gkv[g], tails[g] = gkv_g, tail_g
        rings.append(ring)
        loads.append(load)
        kls.append(kl)
        work = work + run.count * jnp.sum(here.n_valid)
    new_length = start + n_valid
    tokens_ring = state.tokens
    if tokens_ring.shape[1]:
        tokens_ring = cache.ring_scatter(tokens_ring, chunk.positions(s), tokens, chunk.valid(s), new_length)
    swa = state.swa.replace(kv=jnp.concatenate([r[0] for r in rings]),
                            scale=None if state.swa.scale is None else jnp.concatenate([r[1] for r in rings]))
    new_state = state.replace(length=new_length, floor=floor, global_kv=tuple(gkv), tails=tuple(tails), swa=swa,
                              tokens=tokens_ring)
    return StackOut(streams, rows, new_state, jnp.concatenate(loads), jnp.concatenate(kls), work)


def _logits(cfg: ModelConfig, params: dict, streams: Streams) -> Array:
    """Final collapse with the last site's pre (SPEC §10), norm, LM head: [B, T, n, d] → [B, T, V] float32."""
    y = mhc.collapse(streams.X, streams.pre)
    return linear(rms_norm(y, params["norm"], cfg.rms_norm_eps), params["head"], cfg.dtype)


# ---------------------------------------------------------------------------------------------
# Entry points (DESIGN §3)

def _check_tokens(cfg: ModelConfig, state: State, tokens: Array, n_valid: Array) -> None:
    """Boundary checks (DESIGN §7): shapes, token ids in the vocabulary, positions within capacity."""
    if tokens.ndim != 2 or tokens.shape[0] != state.batch:
        raise ValueError(f"tokens.shape={tokens.shape}: expected [B={state.batch}, S] (the state's batch)")
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"tokens.dtype={tokens.dtype}: token ids must be integers")
    chunk = Chunk(start=state.length, n_valid=n_valid, floor=state.floor)
    validate_chunk(cfg, jax.ShapeDtypeStruct(tokens.shape + (cfg.hidden_size,), jnp.float32), chunk, capacity(cfg, state))
    if not isinstance(tokens, jax.core.Tracer):
        ids = np.asarray(tokens)
        valid = np.arange(ids.shape[1])[None] < np.asarray(n_valid)[:, None]
        bad = ids[valid & ((ids < 0) | (ids >= cfg.vocab_size))]
        if bad.size:
            raise ValueError(f"tokens: ids {sorted(set(bad.tolist()))[:5]} are outside the vocabulary "
                             f"[0, {cfg.vocab_size}); map them through the tokenizer first")


def _last_logits(cfg: ModelConfig, params: dict, out: StackOut, n_valid: Array) -> Array:
    """Logits [B, V] of each row's last real position among the rows that reached the head."""
    last = jnp.clip(jnp.minimum(n_valid, out.rows.shape[1]) - 1, 0)[:, None]  # [B, 1]
    streams = Streams(_take_rows(out.streams.X, last), _take_rows(out.streams.pre, last), out.streams.bus)
    return _logits(cfg, params, streams)[:, 0]


@functools.partial(jax.jit, static_argnames=("cfg", "replay"))
def _prefill(cfg, params, state, tokens, n_valid, replay):
    out = _stack(cfg, params, state, tokens, n_valid, replay, quantize=True)
    return _last_logits(cfg, params, out, n_valid), out.state, out.work


def prefill(cfg: ModelConfig, params: dict, state: State, tokens: Array, n_valid: Array | None = None,
            replay: ReplayPolicy = ReplayPolicy()) -> tuple[Array, State]:
    """Process a prompt chunk `tokens [B, S]` (`n_valid [B]` real tokens per row, default S).

    Returns the logits of each row's last real position [B, V] and the new state. With
    `replay.window = R` only the last min(R, S) tokens run through the layers from the split on
    (SPEC §11); `ReplayPolicy(window=None)` is the exact reference.
    """
    return prefill_with_work(cfg, params, state, tokens, n_valid, replay)[:2]


def prefill_with_work(cfg, params, state, tokens, n_valid=None, replay=ReplayPolicy()):
    """`prefill`, plus the token×layer work it did (int32) — the instrumentation of SPEC §11's saving."""
    tokens = jnp.asarray(tokens)
    n_valid = jnp.full((tokens.shape[0],), tokens.shape[1], jnp.int32) if n_valid is None else jnp.asarray(n_valid, jnp.int32)
    replay.validate(cfg)
    _check_tokens(cfg, state, tokens, n_valid)
    return _prefill(cfg, params, state, tokens, n_valid, replay)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _decode_step(cfg, params, state, tokens):
    ones_ = jnp.ones((tokens.shape[0],), jnp.int32)
    out = _stack(cfg, params, state, tokens[:, None], ones_, EXACT, quantize=True)
    return _last_logits(cfg, params, out, ones_), out.state


def decode_step(cfg: ModelConfig, params: dict, state: State, tokens: Array) -> tuple[Array, State]:
    """One token per row `tokens [B]` through all layers: logits [B, V] and the state with length + 1."""
    tokens = jnp.asarray(tokens)
    if tokens.ndim != 1:
        raise ValueError(f"tokens.shape={tokens.shape}: decode_step takes one token per row, [B]")
    _check_tokens(cfg, state, tokens[:, None], jnp.ones((tokens.shape[0],), jnp.int32))
    return _decode_step(cfg, params, state, tokens)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _verify(cfg, params, state, tokens):
    b, s = tokens.shape
    out = _stack(cfg, params, state, tokens, jnp.full((b,), s, jnp.int32), EXACT, quantize=True)
    accept = state.accept.replace(tokens=state.accept.tokens.at[:, :s].set(tokens), count=jnp.zeros_like(state.length))
    # Speculative: buffers hold positions L … L+γ, but nothing is committed until `commit`.
    return _logits(cfg, params, out.streams), out.state.replace(length=state.length, accept=accept)


def verify(cfg: ModelConfig, params: dict, state: State, tokens: Array) -> tuple[Array, State]:
    """Score a verify block `tokens [B, γ+1]` = [R, d1 … dγ] at positions L … L+γ (SPEC §12).

    Returns all logits [B, γ+1, V] and the speculative state: `length` is still L; `commit`
    then sets it to L + n + 1. Rejected positions are scratch that no valid read can reach.
    """
    tokens = jnp.asarray(tokens)
    if tokens.ndim != 2 or not 1 <= tokens.shape[1] <= cfg.max_draft + 1:
        raise ValueError(f"tokens.shape={tokens.shape}: verify takes [B, γ+1] with 1 ≤ γ+1 ≤ max_draft+1 = "
                         f"{cfg.max_draft + 1}; raise ModelConfig.max_draft for longer drafts")
    _check_tokens(cfg, state, tokens, jnp.full((tokens.shape[0],), tokens.shape[1], jnp.int32))
    return _verify(cfg, params, state, tokens)


def commit(state: State, accept_lens: Array) -> State:
    """Commit `accept_lens [B]` = n+1 verified rows per row: set `length` (nothing is copied, SPEC §12)."""
    accept_lens = jnp.asarray(accept_lens, jnp.int32)
    if accept_lens.shape != state.length.shape:
        raise ValueError(f"accept_lens.shape={accept_lens.shape}: expected one count per row {state.length.shape}")
    if not isinstance(accept_lens, jax.core.Tracer):
        slots = state.accept.tokens.shape[1]
        if (np.asarray(accept_lens) < 0).any() or (np.asarray(accept_lens) > slots).any():
            raise ValueError(f"accept_lens={np.asarray(accept_lens).tolist()}: each must lie in [0, {slots}] "
                             "(the verified rows R, d1 … dγ)")
    return state.replace(length=state.length + accept_lens, accept=state.accept.replace(count=accept_lens))


def fork(state: State, rows: Array) -> State:
    """A state whose row i is row `rows[i]` of `state` (beams, parallel samples): a gather, nothing shared."""
    rows = jnp.asarray(rows, jnp.int32)
    take = lambda x: None if x is None else x[rows]  # noqa: E731
    return jax.tree_util.tree_map(take, state.replace(swa=None)).replace(
        swa=state.swa.replace(kv=state.swa.kv[:, rows], scale=None if state.swa.scale is None else state.swa.scale[:, rows]))


@functools.partial(jax.jit, static_argnames=("cfg", "qat", "replay", "index_loss"))
def _forward(cfg, params, tokens, qat, replay, index_loss):
    b, s = tokens.shape
    granule = token_granule(cfg)
    state = init_state(cfg, b, -(-s // granule) * granule, "float")
    out = _stack(cfg, params, state, tokens, jnp.full((b,), s, jnp.int32), replay, quantize=qat, index_loss=index_loss)
    return _logits(cfg, params, out.streams), {"load": out.load, "index_kl": out.index_kl, "rows": out.rows}


def forward(cfg: ModelConfig, params: dict, tokens: Array, *, qat: bool = False,
            replay: ReplayPolicy = EXACT, index_loss: str | None = None) -> tuple[Array, dict]:
    """Teacher-forced logits for training: `tokens [B, S]` → logits of the rows that reach the head
    `[B, T, V]` (T = S in exact mode; the decoder tail under `replay`), and aux outputs
    (`load [L, E]` MoE loads for the balancing update, `index_kl [L]` the indexer KL of SPEC §13 per
    layer when `index_loss` is "sparse" or "dense", `rows [B, T]` chunk rows of the logits).

    `qat=True` runs the SPEC §8 fake-quant (straight-through) on Main KV, Indexer Q/K and window KV,
    exactly as inference stores them; `qat=False` is the float model.
    """
    tokens = jnp.asarray(tokens)
    replay.validate(cfg)
    if tokens.ndim != 2:
        raise ValueError(f"tokens.shape={tokens.shape}: expected [B, S]")
    return _forward(cfg, params, tokens, qat, replay, index_loss)
