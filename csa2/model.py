"""The CED model's entry points (DESIGN §3): pure functions of `(cfg, params, state, tokens)`.

embed → hc expand → encoder layers → decoder layers (layer 20's compressor projects the encoder
output into the decoder's Global KV) → final collapse → norm → LM head (`csa2.stack`).

- `init_params` builds the `Model` module once and returns its parameter `nnx.State`.
- `prefill`, `decode_step` and `verify` are jitted with the state donated: the caller's state is
  consumed and its buffers are reused for the returned one, so a decode loop driven from the host
  never copies the Global KV. Keep a state you still need with `fork` (a copy) before passing it on.
- `commit` (set `length`) and `fork` (gather rows) are one-liners on the state pytree.
- With a DSpark drafter (`num_nextn_predict_layers > 0`), `prefill`, `decode_step` and `verify` also
  write its context windows for the rows they compute, and `draft` proposes γ tokens from them
  (SPEC §12, `csa2.dspark`); it reads the state and writes nothing.
- `forward` is the teacher-forced model for training; `update_router_bias` its balancing rule.
Each entry point checks its arguments on the host before tracing (`csa2.boundary`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from csa2 import boundary, dspark, engram_vocab, relayout, remat as remat_lib
from csa2.boundary import entry_point
from csa2.chunk import take_rows
from csa2.config import ModelConfig
from csa2.engram import Engram
from csa2.hooks import OWN_TOPK, Instrument
from csa2.layout import LAYOUT, layer_groups
from csa2.mesh import PARAMS, REPLICATED, ROWS
from csa2.moe import bias_update
from csa2.params import arrays, constant, initialize, normal, ones
from csa2.replay import EXACT, Extend, ReplayPolicy
from csa2.stack import StackOut, logits as head_logits, split_layers, stack, stacked_layers
from csa2.state import State, cache_format, init_state, token_granule

Array = jax.Array

__all__ = ["Model", "init_params", "as_module", "abstract_params", "prefill", "decode_step", "verify", "commit",
           "emitted", "fork", "draft", "forward", "update_router_bias", "ReplayPolicy", "EXACT", "Extend", "init_state",
           "DRAFTER"]

DRAFTER = dspark.DRAFTER  # the subtree of the DSpark drafter's parameters (`csa2.dspark.Drafter`)


class Model(nnx.Module):
    """Every parameter of the model: embedding, the layer groups (stacked as `layout.layer_groups`), the Engram
    layers' n-gram memories (`engram[k]` for the k-th of `engram_layer_ids`), the final norm, the LM head, the
    compressed Engram vocabulary when it is not the identity (`engram_vocab`, `csa2.engram_vocab`) and, when
    `num_nextn_predict_layers > 0`, the DSpark drafter under `drafter` (frozen-backbone training selects it alone).
    `layout=2` builds the older parameter layout, whose Engram layers hold their memory (`csa2.relayout`). Calling
    it runs `forward` on its own parameters (for `nnx.tabulate`)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, layout: int = LAYOUT):
        d, v, std = cfg.hidden_size, cfg.vocab_size, cfg.initializer_range
        self.cfg = cfg
        self.embed = normal(rngs, (v, d), std, ("vocab", "embed"))
        self.groups = nnx.List([stacked_layers(cfg, group, rngs, layout) for group in layer_groups(cfg, layout)])
        if cfg.engram_layer_ids and layout == LAYOUT:
            self.engram = nnx.List([Engram(cfg, layer, rngs) for layer in cfg.engram_layer_ids])
        self.norm = ones((d,), ("embed",))
        self.head = normal(rngs, (d, v), std, ("embed", "vocab"), compute=True)
        if engram_vocab.has_table(cfg):
            self.engram_vocab = constant(engram_vocab.default_table(cfg), ("vocab",), engram_vocab.CompressedVocab,
                                         engram_vocab.DefaultTable.of(cfg))
        if cfg.num_nextn_predict_layers:
            self.drafter = dspark.Drafter(cfg, rngs)

    def __call__(self, tokens: Array) -> Array:
        """Teacher-forced logits [B, S, V] of `tokens [B, S]` (float numerics)."""
        return forward(self.cfg, nnx.state(self), tokens)[0]


def init_params(cfg: ModelConfig, key: Array) -> nnx.State:
    """All parameters, as the `nnx.State` of `Model(cfg)`: float32 `Param`s and `RouterBias` variables, and the int32
    `CompressedVocab` when the model has one, each drawn on the host by its declared initializer from `key` and its
    path (`csa2.params.initialize`: no program is compiled; under a transform, a host callback). They are drawn in
    parameter layout 2 and moved to layout 3 (`csa2.relayout`), so a key gives the values it gave before layout 3."""
    return relayout.from_layout2(cfg, initialize(abstract_params(cfg, layout=2), key), abstract_params(cfg))


def as_module(cfg: ModelConfig, params: nnx.State) -> Model:
    """The `Model` holding `params` (no copy), for `nnx.display`, `nnx.tabulate` and notebooks."""
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: Model(cfg, nnx.Rngs(0))))
    return nnx.merge(graphdef, params)


def abstract_params(cfg: ModelConfig, layout: int = LAYOUT) -> nnx.State:
    """`init_params` as shapes only (traced, nothing allocated or compiled): restore targets, memory plans; `layout`
    2 gives those of the older parameter layout (`Model`)."""
    return nnx.state(nnx.eval_shape(lambda: Model(cfg, nnx.Rngs(0), layout)))


# ---------------------------------------------------------------------------------------------
# Inference

def _last_logits(cfg: ModelConfig, p: dict, out: StackOut) -> Array:
    """Logits [B, V] of each row's last real position among the rows that reached the head."""
    last = jnp.clip(out.n_rows - 1, 0)[:, None]  # [B, 1]
    return head_logits(cfg, p, take_rows(out.X, last), take_rows(out.pre, last))[:, 0]


def _with_context(cfg: ModelConfig, p: dict, start: Array, out: StackOut, quantize: bool) -> State:
    """The call's new state with the drafter's context windows written for the rows that reached the head
    (SPEC §12): what a later `draft` reads. Without a drafter the state is returned as it is."""
    if DRAFTER not in p:
        return out.state
    t = out.rows.shape[1]
    valid = jnp.arange(t, dtype=jnp.int32)[None] < out.n_rows[:, None]
    with jax.named_scope("drafter_context"):
        windows = dspark.write_context(cfg, p[DRAFTER], out.state.draft, out.features, start[:, None] + out.rows,
                                       valid, out.state.length, quantize)
    return out.state.replace(draft=windows)


def _check_prefill(cfg, params, state, tokens, n_valid, replay, extend, numerics) -> None:
    boundary.check_config(cfg)
    boundary.check_replay(cfg, replay)
    boundary.check_chunk(cfg, state, tokens, n_valid)
    boundary.check_numerics(numerics, cache_format(state.swa))
    boundary.check_extend(cfg, state, tokens, n_valid, extend)


@entry_point(_check_prefill, static_argnames=("cfg", "replay", "numerics"), donate_argnames=("state",),
             place=dict(params=PARAMS, state=ROWS, tokens=ROWS, n_valid=ROWS, extend=ROWS),
             out=(ROWS, "state", REPLICATED))
def prefill(cfg: ModelConfig, params: nnx.State, state: State, tokens: Array, n_valid: Array | None = None,
            replay: ReplayPolicy = ReplayPolicy(), extend: Extend | None = None,
            numerics: str = "spec") -> tuple[Array, State, dict]:
    """Process a prompt chunk `tokens [B, S]` (`n_valid [B]` real tokens per row, default S) of
    `extend` (`Extend(start, end)`: the positions of the prompt's new tokens when it arrives in
    several chunks, e.g. `Extend.cold(N)`; None: this chunk is the whole prompt). A state that holds
    a prefix is a prefix hit: its Global KV is read, never rewritten; `Extend.replaying` plans the
    encoder replay of a hit whose rings are gone (SPEC §11, `infer.prefix_cache`).

    Returns the logits of each row's last real position that reached the head [B, V] (meaningful on
    the chunk holding the prompt's last token), the new state and `{"work": int32}`, the token×layer
    count processed. With `replay.window = R` only the extend's last min(R, end − start) positions
    run through the layers from the split on (SPEC §11), in whichever chunks hold them, so every
    chunking gives the state and logits of one call; `EXACT` is the reference.

    `numerics`: "spec" (SPEC §8: what the cache stores is rounded to its FP4/FP8 formats, the default) or
    "float" (the float model, on a float cache: the reference for exactness checks, and the baseline that
    measures what the FP4/FP8 cache costs). Every call on one state uses the same numerics.
    """
    n_valid = jnp.full(tokens.shape[:1], tokens.shape[1], jnp.int32) if n_valid is None else n_valid.astype(jnp.int32)
    p = arrays(params)
    quantize = numerics == "spec"
    out = stack(cfg, p, state, tokens, n_valid, replay, quantize=quantize, extend=extend, features=DRAFTER in p)
    return _last_logits(cfg, p, out), _with_context(cfg, p, state.length, out, quantize), {"work": out.work}


STEP = dict(params=PARAMS, state=ROWS, tokens=ROWS)  # a step's placements on a mesh (`EntryPoint.on`)


def _check_decode(cfg, params, state, tokens, numerics) -> None:
    boundary.check_config(cfg)
    if jnp.ndim(tokens) != 1:
        raise ValueError(f"tokens.shape={jnp.shape(tokens)}: decode_step takes one token per row, [B]")
    ids = boundary.concrete(tokens)
    column = jax.ShapeDtypeStruct((*jnp.shape(tokens), 1), jnp.result_type(tokens)) if ids is None else ids[:, None]
    boundary.check_chunk(cfg, state, column, None)
    boundary.check_numerics(numerics, cache_format(state.swa))


@entry_point(_check_decode, static_argnames=("cfg", "numerics"), donate_argnames=("state",), place=STEP,
             out=(ROWS, "state"))
def decode_step(cfg: ModelConfig, params: nnx.State, state: State, tokens: Array,
                numerics: str = "spec") -> tuple[Array, State]:
    """One token per row `tokens [B]` through all layers: logits [B, V] and the state with length + 1
    (`numerics` as `prefill`)."""
    ones_ = jnp.ones(tokens.shape, jnp.int32)
    p = arrays(params)
    quantize = numerics == "spec"
    out = stack(cfg, p, state, tokens[:, None], ones_, EXACT, quantize=quantize, features=DRAFTER in p)
    return _last_logits(cfg, p, out), _with_context(cfg, p, state.length, out, quantize)


def _check_verify(cfg, params, state, tokens, numerics) -> None:
    boundary.check_config(cfg)
    shape = jnp.shape(tokens)
    if len(shape) != 2 or not 1 <= shape[1] <= cfg.max_draft + 1:
        raise ValueError(f"tokens.shape={shape}: verify takes [B, γ+1] with 1 ≤ γ+1 ≤ max_draft+1 = "
                         f"{cfg.max_draft + 1}; raise ModelConfig.max_draft for longer drafts")
    boundary.check_chunk(cfg, state, tokens, None)
    boundary.check_numerics(numerics, cache_format(state.swa))


@entry_point(_check_verify, static_argnames=("cfg", "numerics"), donate_argnames=("state",), place=STEP,
             out=(ROWS, "state"))
def verify(cfg: ModelConfig, params: nnx.State, state: State, tokens: Array,
           numerics: str = "spec") -> tuple[Array, State]:
    """Score a verify block `tokens [B, γ+1]` = [R, d1 … dγ] at positions L … L+γ (SPEC §12), with
    `numerics` as `prefill`.

    Returns all logits [B, γ+1, V] and the speculative state: `length` is still L; `commit`
    then sets it to L + n + 1. Rejected positions are scratch that no valid read can reach.
    """
    b, s = tokens.shape
    p = arrays(params)
    quantize = numerics == "spec"
    out = stack(cfg, p, state, tokens, jnp.full((b,), s, jnp.int32), EXACT, quantize=quantize, features=DRAFTER in p)
    accept = state.accept.replace(tokens=state.accept.tokens.at[:, :s].set(tokens), count=jnp.zeros_like(state.length),
                                  width=jnp.full_like(state.length, s))
    # Speculative: buffers hold positions L … L+γ, but nothing is committed until `commit`.
    new = _with_context(cfg, p, state.length, out, quantize)
    return head_logits(cfg, p, out.X, out.pre), new.replace(length=state.length, accept=accept)


def emitted(block: Array, accept_lens: Array, bonus: Array) -> Array:
    """The tokens a commit of `accept_lens [B]` = n + 1 rows of the verify block `block [B, w]` = [R, d1 … ]
    emits (SPEC §12): (d1 … dn, C) with C = `bonus [B]`, then zeros, [B, w]."""
    slot = jnp.arange(block.shape[1])[None, :]
    drafts = jnp.roll(block, -1, axis=1)  # slot i holds d_{i+1}
    n = accept_lens[:, None] - 1
    return jnp.where(slot < n, drafts, jnp.where(slot == n, bonus[:, None], 0))


def commit(state: State, accept_lens: Array, bonus: Array) -> State:
    """Commit `accept_lens [B]` = n + 1 verified rows (R, d1 … dn) per row and emit (d1 … dn, C), C = `bonus [B]`
    the target's token after dn (SPEC §12): `length` grows by n + 1 (nothing is copied) and the accept
    buffer holds the emitted tokens. `accept_lens` must lie in [0, width of the verify it follows];
    checked where the values are concrete (a jitted loop passes verify's own bounds)."""
    accept_lens, bonus = jnp.asarray(accept_lens, jnp.int32), jnp.asarray(bonus, jnp.int32)
    for name, x in (("accept_lens", accept_lens), ("bonus", bonus)):
        if x.shape != state.length.shape:
            raise ValueError(f"{name}.shape={x.shape}: expected one value per row {state.length.shape}")
    counts, width = boundary.concrete(accept_lens), boundary.concrete(state.accept.width)
    if counts is not None and width is not None and ((counts < 0).any() or (counts > width).any()):
        raise ValueError(f"accept_lens={counts.tolist()}: each must lie in [0, width] with width={width.tolist()} "
                         "the rows of the verify this commit follows (R, d1 … dγ); verify again before committing")
    accept = state.accept.replace(tokens=emitted(state.accept.tokens, accept_lens, bonus), count=accept_lens,
                                  width=jnp.zeros_like(accept_lens))
    return state.replace(length=state.length + accept_lens, accept=accept)


def _check_draft(cfg, params, state, anchor, key, temperature, top_p, numerics) -> None:
    boundary.check_config(cfg)
    if not cfg.num_nextn_predict_layers:
        raise ValueError("num_nextn_predict_layers=0: this config has no DSpark drafter; use a config with "
                         "num_nextn_predict_layers ≥ 1 (the presets have one)")
    if jnp.shape(anchor) != jnp.shape(state.length):
        raise ValueError(f"anchor.shape={jnp.shape(anchor)}: draft takes one anchor per row {jnp.shape(state.length)} "
                         "(the token sampled at position length)")
    if not jnp.issubdtype(jnp.result_type(anchor), jnp.integer):
        raise ValueError(f"anchor.dtype={jnp.result_type(anchor)}: token ids must be integers")
    ids = boundary.concrete(anchor)
    if ids is not None:
        boundary.check_token_ids(cfg, ids[:, None])
    boundary.check_numerics(numerics, cache_format(state.swa))


@entry_point(_check_draft, static_argnames=("cfg", "numerics"), place=dict(params=PARAMS, state=ROWS, anchor=ROWS),
             out=ROWS)
def draft(cfg: ModelConfig, params: nnx.State, state: State, anchor: Array, key: Array,
          temperature: Array = 0.0, top_p: Array = 1.0, numerics: str = "spec") -> dspark.Proposal:
    """DSpark's γ = `dspark_block_size` drafts after `anchor [B]`, the sampled token at each row's position
    `length` (SPEC §12): tokens, the logits each was drawn from, confidences. Reads the state, writes
    nothing; `verify` then scores [anchor, drafts]. `temperature` 0 drafts greedily; `numerics` as `prefill`."""
    with jax.named_scope("drafter"):
        return dspark.propose(cfg, arrays(params), state, anchor, key, jnp.float32(temperature), jnp.float32(top_p),
                              quantize=numerics == "spec")


def fork(state: State, rows: Array) -> State:
    """A state whose row i is row `rows[i]` of `state` (beams, parallel samples): a gather, nothing shared."""
    rows = jnp.asarray(rows, jnp.int32)
    return jax.tree.map(lambda x: x[rows], state)


# ---------------------------------------------------------------------------------------------
# Training

def _check_forward(cfg, params, tokens, qat, replay, features, instrument, remat) -> None:
    boundary.check_config(cfg)
    remat_lib.check(remat)
    boundary.check_replay(cfg, replay)
    boundary.check_token_ids(cfg, tokens)
    if features and not cfg.dspark_target_layer_ids:
        raise ValueError("features=True: dspark_target_layer_ids is empty, so there are no target features")
    if not isinstance(instrument, Instrument):
        raise ValueError(f"instrument={instrument!r}: pass a csa2.hooks.Instrument (e.g. a research.selection "
                         "policy, a research.probe.Probe, csa2.index_loss.IndexLoss), or leave the default")
    instrument.check(cfg, jnp.shape(tokens), replay)


@entry_point(_check_forward, static_argnames=("cfg", "qat", "replay", "features", "remat"),
             place=dict(params=PARAMS, tokens=ROWS),
             out=(ROWS, {"load": REPLICATED, "rows": ROWS, "features": ROWS, "tap": REPLICATED}))
def forward(cfg: ModelConfig, params: nnx.State, tokens: Array, *, qat: bool = False, replay: ReplayPolicy = EXACT,
            features: bool = False, instrument: Instrument = OWN_TOPK, remat: str = "none") -> tuple[Array, dict]:
    """Teacher-forced logits for training: `tokens [B, S]` → logits of the rows that reach the head
    `[B, T, V]` (T = S in exact mode; the decoder tail under `replay`), and aux outputs
    (`load [L, E]` MoE loads for `update_router_bias`, `rows [B, T]` chunk rows of the logits, with
    `features=True` the DSpark target features `[B, T, n_t, d]` of those rows, SPEC §12, and with an
    `instrument` that taps, every layer's tap stacked `[L, ...]` under `tap`). The `instrument` decides what
    every Global-reading layer reads (default: its own top-k) and what every layer taps (`csa2.hooks`): the
    indexer loss of SPEC §13 (`csa2.index_loss.IndexLoss`), the probes and KV-selection baselines of
    `research`.

    `qat=True` runs the SPEC §8 fake-quant (straight-through) on Main KV, Indexer Q/K and window KV,
    exactly as inference stores them; `qat=False` is the float model. `remat`: what a backward pass through this
    call keeps of each layer (`csa2.remat`; the values are the same).
    """
    b, s = tokens.shape
    granule = token_granule(cfg)
    state = init_state(cfg, b, -(-s // granule) * granule, "float")
    p = arrays(params)
    out = stack(cfg, p, state, tokens, jnp.full((b,), s, jnp.int32), replay, quantize=qat, features=features,
                instrument=instrument, remat=remat)
    aux = {"load": out.load, "rows": out.rows}
    if features:
        aux["features"] = out.features
    if out.tap is not None:
        aux["tap"] = out.tap
    return head_logits(cfg, p, out.X, out.pre), aux


def update_router_bias(cfg: ModelConfig, params: nnx.State, load: Array, rate: float) -> nnx.State:
    """Aux-loss-free balancing (SPEC §9) of every layer's router bias from its load `load [L, E]`
    (`forward`'s aux), outside the optimizer: a new state, the other variables untouched."""
    loads = {("groups", gi, ri, "moe", "bias"): run_load
             for gi, group in enumerate(split_layers(cfg, load)) for ri, run_load in enumerate(group)}
    flat = [(path, v.replace(bias_update(v.get_value(), loads[path], rate)) if path in loads else v)
            for path, v in nnx.to_flat_state(params)]
    return nnx.from_flat_state(flat)
