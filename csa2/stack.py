"""The layer stack over one chunk: one layer (SPEC §10, §10b), repeating groups scanned (DESIGN §5), and
the three segments of a call around the replay split (SPEC §11).

A layer reads in SPEC order: Engram → attention-site mHC mixes → collapse → attention → expand →
FFN-site mixes → collapse → MoE → expand. Layers are executed by `layout.layer_groups`: each group
is one scanned body over its iterations, each run inside it one scanned body over its layers, with
parameters stacked `[iterations, layers, ...]` and the layer index and KV slot of every layer fed in
as scanned values. Engram memories are not stacked (`params["engram"]`): a body that covers Engram layers
applies the one at its layer index, if any, by a `lax.switch`, so Engram does not split a group. What flows from
layer to layer (`Flow`) carries the whole request state, so the
Global KV stacks and the rings are updated in place: a layer's attention gets its view of the state
(`LayerKV`: its ring, its group's source and compressor tail) and returns it with only the rows its chunk
adds written, and the stack writes it back, the only writer of the `State`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import chex
import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec

from csa2 import cache, engram as engram_lib, engram_vocab, mhc, remat as remat_lib
from csa2.attention import Attention, attention
from csa2.chunk import Chunk, take_rows
from csa2.config import ModelConfig
from csa2.context import Context
from csa2.engram import Engram
from csa2.hooks import OWN_TOPK, Instrument
from csa2.indexer import Bus
from csa2.layout import LAYOUT, Group, LayerSpec, addresses, kv_address, layer_groups, layer_plan
from csa2.mesh import gather_fsdp
from csa2.moe import MoE, moe
from csa2.norm import rms_norm
from csa2.params import linear, ones
from csa2.replay import DecoderTail, Extend, ReplayPlan, ReplayPolicy, plan as replay_plan
from csa2.state import LayerKV, State

Array = jax.Array
Engrams = tuple[tuple[int, dict], ...]  # (layer, its Engram parameters) of the Engram layers a body may run


# ---------------------------------------------------------------------------------------------
# Parameters

class Layer(nnx.Module):
    """One layer's parameters: two mHC sites with their norms, attention and MoE. An Engram layer's n-gram memory
    lives apart, in the model's `engram` (its table's rows differ from layer to layer); parameter layout 2 held it
    here (`engram=True`, `csa2.relayout`)."""

    def __init__(self, cfg: ModelConfig, spec: LayerSpec, rngs: nnx.Rngs, engram: bool = False):
        d = cfg.hidden_size
        if engram:
            self.engram = Engram(cfg, spec.index, rngs)
        self.attn_hc = mhc.HyperConnection(cfg, rngs)
        self.attn_norm = ones((d,), ("embed",))
        self.attn = Attention(cfg, spec, rngs)
        self.ffn_hc = mhc.HyperConnection(cfg, rngs)
        self.ffn_norm = ones((d,), ("embed",))
        self.moe = MoE(cfg, rngs)


def stacked_layers(cfg: ModelConfig, group: Group, rngs: nnx.Rngs, layout: int = LAYOUT) -> nnx.List:
    """One `Layer` per run of `group`, each stacked `[group.count, run.count, ...]` with split RNG streams (in
    parameter `layout` 2, with its Engram inside an Engram layer)."""
    runs = []
    for run in group.runs:
        make = _maker(cfg, run.spec, layout == 2 and run.spec.has_engram)
        for count, axis in ((run.count, "layers"), (group.count, "groups")):
            make = nnx.split_rngs(splits=count)(
                nnx.vmap(make, in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: axis}))
        runs.append(make(rngs))
    return nnx.List(runs)


def _maker(cfg: ModelConfig, spec: LayerSpec, engram: bool):
    return lambda rngs: Layer(cfg, spec, rngs, engram)


def _axes(make) -> dict:
    """The logical axes of every parameter of the module `make()` builds, as a pure dict."""
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):  # names only: place nothing
        names = nnx.get_partition_spec(nnx.state(nnx.eval_shape(make)))
    return jax.tree.map(tuple, nnx.to_pure_dict(names), is_leaf=lambda x: isinstance(x, PartitionSpec))


@functools.lru_cache(maxsize=None)
def layer_axes(cfg: ModelConfig, spec: LayerSpec) -> dict:
    """The logical axes of every parameter of one (unstacked) layer, in the structure of `layer`'s `p`."""
    return _axes(lambda: Layer(cfg, spec, nnx.Rngs(0)))


@functools.lru_cache(maxsize=None)
def engram_axes(cfg: ModelConfig, layer: int) -> dict:
    """The logical axes of Engram layer `layer`'s parameters."""
    return _axes(lambda: Engram(cfg, layer, nnx.Rngs(0)))


def engram_params(cfg: ModelConfig, params: dict, layers) -> Engrams:
    """`(layer, parameters)` of the Engram layers among `layers`, in layer order."""
    return tuple((layer, params["engram"][k]) for k, layer in enumerate(cfg.engram_layer_ids) if layer in layers)


def locate(cfg: ModelConfig, layer: int) -> tuple[int, int, int, int]:
    """Where `layer` sits in the stacked layout: (group, iteration, run, index within the run)."""
    if layer not in addresses(cfg):
        raise ValueError(f"locate: layer={layer} is outside the model's {cfg.num_hidden_layers} layers")
    return addresses(cfg)[layer]


def layer_params(cfg: ModelConfig, params: dict, layer: int) -> dict:
    """The (unstacked) parameters of one layer."""
    gi, iteration, ri, j = locate(cfg, layer)
    return jax.tree.map(lambda a: a[iteration, j], params["groups"][gi][ri])


def split_layers(cfg: ModelConfig, per_layer: Array) -> list[list[Array]]:
    """A per-layer array `[L, ...]` cut into the stacked layout of `params["groups"]`: `[gi][ri]` →
    `[group.count, run.count, ...]` (e.g. each layer's MoE load next to its router bias)."""
    out = []
    for group in layer_groups(cfg):
        cycle = per_layer[group.first:group.end].reshape(group.count, group.period, *per_layer.shape[1:])
        out.append([cycle[:, run.offset:run.offset + run.count] for run in group.runs])
    return out


# ---------------------------------------------------------------------------------------------
# One layer

@chex.dataclass(frozen=True)
class Outputs:
    """What one layer reports besides the flow (stacked along a leading layer axis by the runs): its MoE
    load [E] and its tap (`csa2.hooks`; None with the default instrument)."""

    load: Array
    tap: Any = None


@chex.dataclass(frozen=True)
class Flow:
    """What flows from layer to layer: residual streams X [B, T, n, d], the `pre` handed on [B, T, n]
    (single-pass mHC, SPEC §10), the bus of selections, the request state being written, and (when the
    call collects them) the DSpark target features [B, T, len(dspark_target_layer_ids), d] (SPEC §12)."""

    X: Array
    pre: Array
    bus: Bus
    state: State
    features: Array | None = None


def site_input(cfg: ModelConfig, hc: dict, norm: Array, X: Array, pre_prev: Array):
    """mHC coefficients of a site and its normed collapsed input (single-pass or standard, SPEC §10)."""
    pre, post, comb = mhc.coefficients(cfg, hc, X)
    y = mhc.collapse(X, pre_prev if cfg.mhc_single_pass else pre)
    return rms_norm(y, norm, cfg.rms_norm_eps), pre, post, comb


def _at(tree, index: Array):
    """Item `index` (may be traced) of axis 1 of every leaf: a layer's ring out of `[B, L, slots, ·]`, a source's
    compressor tail out of its stack's `[B, G, slots, ·]`."""
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, index, axis=1, keepdims=False), tree)


def _put(tree, index: Array, item):
    return jax.tree.map(lambda a, r: jax.lax.dynamic_update_index_in_dim(a, r, index, axis=1), tree, item)


def layer_kv(cfg: ModelConfig, spec: LayerSpec, state: State, index: Array, slot: Array | None) -> LayerKV:
    """Layer `index`'s view of `state`: its ring, its group's Global KV (source `slot` of its stack) and, on a
    Full layer, that source's compressor tail."""
    ring = _at(state.swa, index)
    if spec.kv_source is None:
        return LayerKV(ring=ring)
    stack_id = kv_address(cfg, spec.kv_source)[0]
    compressor_tail = _at(state.tails[stack_id], slot) if spec.compresses else None
    return LayerKV(ring=ring, source=state.global_kv[stack_id].source(slot), tail=compressor_tail)


def put_layer_kv(cfg: ModelConfig, spec: LayerSpec, state: State, index: Array, slot: Array | None,
                 kv: LayerKV) -> State:
    """`state` with layer `index`'s view written back: its ring, and on a Full layer its source and tail (the
    only layers that write Global KV)."""
    state = state.replace(swa=_put(state.swa, index, kv.ring))
    if not spec.compresses:
        return state
    stack_id = kv_address(cfg, spec.kv_source)[0]
    return state.replace(global_kv=_replace(state.global_kv, stack_id, kv.source.stack()),
                         tails=_replace(state.tails, stack_id, _put(state.tails[stack_id], slot, kv.tail)))


def layer(cfg: ModelConfig, spec: LayerSpec, p: dict, flow: Flow, ctx: Context, index: Array, slot: Array | None,
          engrams: Engrams = (), enter: DecoderTail | None = None) -> tuple[Flow, Outputs]:
    """One layer (`index` and KV `slot` may be traced) on the rows of `flow`; returns the flow and
    its `Outputs`. `engrams`: the Engram layers among those this body runs, with their parameters; the layer
    applies the one at `index`, if any. At the replay split (`enter`) a Full layer's compressor still sees every
    row and the rest of the layer continues on the tail (`csa2.attention.attention`)."""
    X, state = flow.X, flow.state
    p = gather_fsdp(p, lambda: layer_axes(cfg, spec))  # whole over the FSDP axis, if any (`csa2.mesh`)
    if engrams:
        with jax.named_scope("engram"):
            X = _engram(cfg, engrams, X, ctx, index)
    features = None if flow.features is None else _collect(cfg, flow.features, X, index)
    with jax.named_scope("attn_mix"):
        x, pre, post, comb = site_input(cfg, p["attn_hc"], p["attn_norm"], X, flow.pre)
    with jax.named_scope("attention"):
        out, kv, bus, tap = attention(cfg, spec, p["attn"], x, layer_kv(cfg, spec, state, index, slot), flow.bus,
                                      ctx, index, enter)
        out = checkpoint_name(out, remat_lib.ATTENTION_OUT)
        state = put_layer_kv(cfg, spec, state, index, slot, kv)
    if enter is not None:
        X, pre, post, comb, features = _decoder_rows((X, pre, post, comb, features), enter)
    with jax.named_scope("attn_expand"):
        X = mhc.update(X, out, post, comb)
    with jax.named_scope("ffn_mix"):
        x, ffn_pre, post, comb = site_input(cfg, p["ffn_hc"], p["ffn_norm"], X, pre)
    with jax.named_scope("moe"):
        y, load = moe(cfg, p["moe"], x)
    with jax.named_scope("ffn_expand"):
        X = mhc.update(X, y, post, comb)
    return Flow(X=X, pre=ffn_pre, bus=bus, state=state, features=features), Outputs(load=load, tap=tap)


def _engram(cfg: ModelConfig, engrams: Engrams, X: Array, ctx: Context, index: Array) -> Array:
    """X with the n-gram memory of layer `index` added (SPEC §10b) if it is one of `engrams`' layers, else X: one
    `lax.switch` on the (traced) index, a branch per Engram layer, since each hashes with its own constants."""
    def at(layer: int, p: dict):
        def add(X: Array) -> Array:
            p_whole = gather_fsdp(p, lambda: engram_axes(cfg, layer))
            hashes = engram_lib.engram_hashes(cfg, layer, ctx.history)  # [B, S, columns]
            if ctx.rows is not None:
                hashes = take_rows(hashes, ctx.rows)
            return engram_lib.engram(cfg, p_whole, X, hashes, ctx.chunk.valid(X.shape[1]))
        return add

    branch = sum((index == layer).astype(jnp.int32) * k for k, (layer, _) in enumerate(engrams, 1))
    return jax.lax.switch(branch, [lambda X: X] + [at(layer, p) for layer, p in engrams], X)


def _collect(cfg: ModelConfig, features: Array, X: Array, index: Array) -> Array:
    """`features` with the per-token mean over mHC streams of this layer's attention-site input X [B, T, n, d]
    in the slot of `index` if it is a DSpark target layer (SPEC §12; `index` may be traced)."""
    hit = jnp.asarray(cfg.dspark_target_layer_ids, jnp.int32) == index  # [n_t]
    mean = jnp.mean(X.astype(jnp.float32), axis=-2)[:, :, None, :]  # [B, T, 1, d]
    return jnp.where(hit[None, None, :, None], mean, features)


def _decoder_rows(tree, decoder: DecoderTail):
    """The decoder tail's rows of every `[B, S, ...]` leaf of `tree`."""
    return jax.tree.map(lambda a: take_rows(a, decoder.rows), tree)


def _replace(items: tuple, i: int, value: Any) -> tuple:
    return items[:i] + (value,) + items[i + 1:]


# ---------------------------------------------------------------------------------------------
# Scanned runs and groups

@dataclasses.dataclass(frozen=True)
class Unit:
    """A piece of a group the stack runs in one go: iterations `[i0, i1)` whole, or (when `offsets` is
    set) the layers `offsets = [lo, hi)` of iteration `i0` only."""

    group: int
    i0: int
    i1: int
    offsets: tuple[int, int] | None = None

    def layers(self, groups: tuple[Group, ...]) -> int:
        g = groups[self.group]
        return (self.i1 - self.i0) * g.period if self.offsets is None else self.offsets[1] - self.offsets[0]


def _units(groups: tuple[Group, ...], lo: int, hi: int) -> list[Unit]:
    """Units covering layers `[lo, hi)` in order: whole iterations where possible, partial ones at the edges."""
    units = []
    for gi, g in enumerate(groups):
        a, b = max(lo, g.first), min(hi, g.end)
        if a >= b:
            continue
        i, j = divmod(a - g.first, g.period)
        while a < b:
            if j == 0 and a + g.period <= b:  # whole iterations
                n = (b - a) // g.period
                units.append(Unit(gi, i, i + n))
                a, i = a + n * g.period, i + n
            else:  # part of one iteration
                end = min(b - (a - j), g.period)
                units.append(Unit(gi, i, i + 1, (j, end)))
                a, i, j = a + end - j, i + 1, 0
    return units


def segments(cfg: ModelConfig, split: int) -> tuple[list[Unit], int | None, list[Unit]]:
    """A bounded replay's three segments: units before the split, the split layer when it enters the decoder
    tail from inside (a compressing layer: its compressor needs every row; else None, and the flow is cut
    before the layer), and the units after it."""
    groups = layer_groups(cfg)
    L = cfg.num_hidden_layers
    if layer_plan(cfg)[split].compresses:
        return _units(groups, 0, split), split, _units(groups, split + 1, L)
    return _units(groups, 0, split), None, _units(groups, split, L)


def _slots(cfg: ModelConfig, group: Group, iterations: range) -> Array | None:
    """KV slot (in its stack) of each iteration's KV source; None for SWA groups."""
    plan = layer_plan(cfg)
    sources = [plan[group.layer(i, 0)].kv_source for i in iterations]
    return None if sources[0] is None else jnp.asarray([kv_address(cfg, s)[1] for s in sources], jnp.int32)


def _scan(fn, flow: Flow, xs, n: int):
    """`lax.scan` of `fn` over `n` stacked items, or one direct call when n = 1 (no loop in the program)."""
    if n == 1:
        flow, ys = fn(flow, jax.tree.map(lambda a: a[0], xs))
        return flow, jax.tree.map(lambda a: a[None], ys)
    return jax.lax.scan(fn, flow, xs)


def _run(cfg: ModelConfig, spec: LayerSpec, p: dict, flow: Flow, ctx: Context, indices: Array,
         slot: Array | None, engrams: Engrams) -> tuple[Flow, Outputs]:
    """Layers of one structure, params stacked `[n, ...]`, at layer `indices [n]`: one scanned body, which
    applies `engrams` at their layers."""
    def body(flow, xs):
        p_l, index = xs
        return layer(cfg, spec, p_l, flow, ctx, index, slot, engrams)
    n = indices.shape[0]
    return _scan(remat_lib.wrap(body, ctx.remat, scanned=n > 1), flow, (p, indices), n)


def run_unit(cfg: ModelConfig, params: dict, unit: Unit, flow: Flow, ctx: Context) -> tuple[Flow, Outputs]:
    """One unit; returns the flow and the `Outputs` of its n layers stacked `[n, ...]` in layer order."""
    group = layer_groups(cfg)[unit.group]
    p_group = params["groups"][unit.group]
    iterations = range(unit.i0, unit.i1)
    slots = _slots(cfg, group, iterations)
    if unit.offsets is None:
        run_engrams = [engram_params(cfg, params, {group.layer(i, run.offset + j) for i in iterations
                                                   for j in range(run.count)}) for run in group.runs]

        def cycle(flow, xs):
            p_runs, first, slot = xs
            ys = []
            for run, p_run, engrams in zip(group.runs, p_runs, run_engrams):
                indices = first + run.offset + jnp.arange(run.count, dtype=jnp.int32)
                flow, y = _run(cfg, run.spec, p_run, flow, ctx, indices, slot, engrams)
                ys.append(y)
            return flow, jax.tree.map(lambda *a: jnp.concatenate(a), *ys)

        firsts = jnp.asarray([group.layer(i, 0) for i in iterations], jnp.int32)
        p_iters = [jax.tree.map(lambda a: a[unit.i0:unit.i1], p_group[ri]) for ri in range(len(group.runs))]
        flow, ys = _scan(cycle, flow, (p_iters, firsts, slots), len(iterations))
        return flow, jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), ys)
    lo, hi = unit.offsets
    slot = None if slots is None else slots[0]
    ys = []
    for ri, run in enumerate(group.runs):
        a, b = max(lo, run.offset), min(hi, run.offset + run.count)
        if a < b:
            p = jax.tree.map(lambda x: x[unit.i0, a - run.offset:b - run.offset], p_group[ri])
            layers = range(group.layer(unit.i0, a), group.layer(unit.i0, b))
            indices = jnp.arange(layers.start, layers.stop, dtype=jnp.int32)
            flow, y = _run(cfg, run.spec, p, flow, ctx, indices, slot, engram_params(cfg, params, layers))
            ys.append(y)
    return flow, jax.tree.map(lambda *a: jnp.concatenate(a), *ys)


def _enter(cfg: ModelConfig, params: dict, split: int, flow: Flow, ctx: Context,
           decoder: DecoderTail) -> tuple[Flow, Outputs]:
    """The split layer: its compressor on every row, the rest of it on the decoder tail's rows."""
    spec = layer_plan(cfg)[split]
    slot = None if spec.kv_source is None else jnp.int32(kv_address(cfg, spec.kv_source)[1])
    engrams = engram_params(cfg, params, {split})
    one = remat_lib.wrap(lambda flow, p: layer(cfg, spec, p, flow, ctx, jnp.int32(split), slot, engrams, decoder),
                         ctx.remat, scanned=False)
    flow, y = one(flow, layer_params(cfg, params, split))
    return flow, jax.tree.map(lambda a: a[None], y)


# ---------------------------------------------------------------------------------------------
# The stack over one chunk

@chex.dataclass(frozen=True)
class StackOut:
    X: Array  # [B, T, n, d] streams of the rows that reached the last layer
    pre: Array  # [B, T, n] the last site's pre
    rows: Array  # [B, T] chunk rows of X
    n_rows: Array  # [B] how many of them are real (the rest repeat the last chunk column)
    state: State
    load: Array  # [L, E] MoE load per layer
    work: Array  # int32: token×layer count processed (instrumentation of SPEC §11)
    features: Array | None  # [B, T, n_t, d] DSpark target features of the rows in X (when collected)
    tap: Any  # every layer's tap stacked [L, ...] (`csa2.hooks`; None with the default instrument)


def _history(cfg: ModelConfig, state: State, tokens: Array, start: Array) -> Array:
    """The Engram window [B, N−1+S]: the N−1 tokens before the chunk (pad before position 0), then the chunk."""
    n = cfg.engram_max_ngram_size - 1
    pos = start[:, None] - n + jnp.arange(n, dtype=jnp.int32)[None]  # [B, N−1]
    past = jnp.take_along_axis(state.tokens, pos % state.tokens.shape[1], axis=1)
    return jnp.concatenate([jnp.where(pos >= 0, past, cfg.engram_pad_id), tokens], axis=1)


def largest_source(state: State) -> int:
    """The entry count of the state's largest Global KV source (`hooks.Sight.entries`)."""
    return max((g.kv.payload.shape[2] for g in state.global_kv), default=0)


def stack(cfg: ModelConfig, params: dict, state: State, tokens: Array, n_valid: Array, replay: ReplayPolicy, *,
          quantize: bool, extend: Extend | None = None, features: bool = False,
          instrument: Instrument = OWN_TOPK, remat: str = "none") -> StackOut:
    """Every layer on one chunk per row (`tokens [B, S]` at positions `length + j`, `n_valid` real) of
    `extend` (None: the chunk is the whole extend). `features`: also collect the DSpark target features
    of the rows that reach the head (SPEC §12). `instrument`: what every Global-reading layer reads and what
    every layer taps (`csa2.hooks`). `remat`: what a training backward pass keeps of each layer (`csa2.remat`).

    Exact mode (every row through every layer) is one pass over the layers, the decoder's from the split on
    reading above the rows' decoder floor. Bounded replay has three segments: before the split every row runs;
    at the split the flow enters the decoder tail (inside the split layer when it compresses, before it
    otherwise); from there the tail rows run (SPEC §11).
    """
    b, s = tokens.shape
    chex.assert_shape([state.length, state.floor, n_valid], (b,))
    encoder_floor = jnp.zeros_like(state.length) if extend is None else extend.encoder_floor()
    written_from = None if extend is None else extend.hit  # replayed prefix rows never rewrite its Global KV
    chunk = Chunk(start=state.length, n_valid=n_valid, floor=encoder_floor)
    history = (engram_vocab.compressed(params, _history(cfg, state, tokens, chunk.start)) if cfg.engram_layer_ids
               else None)
    with jax.named_scope("embed"):
        X = mhc.expand(params["embed"][tokens], cfg.hc_mult)  # [B, S, n, d]
    flow = Flow(X=X, pre=jnp.broadcast_to(mhc.first_pre(cfg.hc_mult), (b, s, cfg.hc_mult)),
                bus=Bus.empty(cfg, b, s), state=state,
                features=jnp.zeros((b, s, len(cfg.dspark_target_layer_ids), cfg.hidden_size), jnp.float32)
                if features else None)
    ctx = Context(chunk=chunk, history=history, rows=None, written_from=written_from, quantize=quantize,
                  instrument=instrument, entries=largest_source(state), split=replay.split(cfg),
                  decoder_floor=state.floor, remat=remat)
    groups = layer_groups(cfg)
    if replay.exact:
        flow, y = _run_units(cfg, params, _units(groups, 0, cfg.num_hidden_layers), flow, ctx)
        work = cfg.num_hidden_layers * jnp.sum(chunk.n_valid)
        rows = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32)[None], (b, s))
        return _finish(cfg, flow, y, work, tokens, chunk, rows, n_valid, state.floor)

    plan: ReplayPlan = replay_plan(cfg, replay, chunk, s, state.floor, extend)
    before, at, after = segments(cfg, plan.split)
    before_split = dataclasses.replace(ctx, decoder_floor=plan.tail.chunk.floor)
    from_split = dataclasses.replace(before_split, chunk=plan.tail.chunk, rows=plan.tail.rows)
    ys, work = [], jnp.zeros((), jnp.int32)
    for unit in before:
        flow, y = run_unit(cfg, params, unit, flow, before_split)
        ys.append(y)
        work += unit.layers(groups) * jnp.sum(chunk.n_valid)
    if at is not None:
        flow, y = _enter(cfg, params, at, flow, before_split, plan.tail)
        ys.append(y)
        work += jnp.sum(chunk.n_valid)  # every row enters the split layer
    else:  # the split layer does not compress: the tail enters before it
        X, pre, bus, collected = _decoder_rows((flow.X, flow.pre, flow.bus, flow.features), plan.tail)
        flow = flow.replace(X=X, pre=pre, bus=bus, features=collected)
    for unit in after:
        flow, y = run_unit(cfg, params, unit, flow, from_split)
        ys.append(y)
        work += unit.layers(groups) * jnp.sum(plan.tail.chunk.n_valid)
    y = jax.tree.map(lambda *a: jnp.concatenate(a), *ys)
    return _finish(cfg, flow, y, work, tokens, chunk, plan.tail.rows, plan.tail.chunk.n_valid, plan.tail.chunk.floor)


def _run_units(cfg: ModelConfig, params: dict, units: list[Unit], flow: Flow, ctx: Context) -> tuple[Flow, Outputs]:
    """`units` in order; their `Outputs` concatenated `[layers, ...]`."""
    ys = []
    for unit in units:
        flow, y = run_unit(cfg, params, unit, flow, ctx)
        ys.append(y)
    return flow, jax.tree.map(lambda *a: jnp.concatenate(a), *ys)


def _finish(cfg: ModelConfig, flow: Flow, y: Outputs, work: Array, tokens: Array, chunk: Chunk, rows: Array,
            n_rows: Array, floor: Array) -> StackOut:
    """The call's result: the chunk's tokens in the Engram history, `length` and `floor` set."""
    s = tokens.shape[1]
    state = flow.state
    tokens_ring = state.tokens
    if tokens_ring.shape[1]:
        tokens_ring = cache.ring_scatter(tokens_ring, chunk.positions(s), tokens, chunk.valid(s), chunk.end)
    state = state.replace(length=chunk.end, floor=floor, tokens=tokens_ring)
    return StackOut(X=flow.X, pre=flow.pre, rows=rows, n_rows=n_rows, state=state, load=y.load, work=work,
                    features=flow.features, tap=y.tap)


def logits(cfg: ModelConfig, params: dict, X: Array, pre: Array) -> Array:
    """Final collapse with the last site's pre (SPEC §10), norm, LM head: [B, T, n, d] → [B, T, V] float32."""
    with jax.named_scope("lm_head"):
        y = mhc.collapse(X, pre)
        return linear(rms_norm(y, params["norm"], cfg.rms_norm_eps), params["head"], cfg.dtype)
