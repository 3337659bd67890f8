"""Batched generation: ragged prompts → one jitted prefill + `lax.while_loop` decode (SPEC §11, DESIGN §2).

`generate` validates and buckets a batch on the host (`plan`), then runs `generate_loop`, a single
jitted function that builds the state, prefills every row (`n_valid` real tokens each, replay policy
of SPEC §11) and decodes all new tokens in a `jax.lax.while_loop`: no host round trip per token.

Shapes come from buckets so the loop compiles once per (batch, prompt bucket, capacity,
max_new_tokens, replay, cache format): the prompt bucket is the power of two ≥ the longest prompt
(a multiple of `token_granule`), the capacity the power of two ≥ bucket + max_new_tokens (both
capped at `max_position_embeddings`). Temperature (0 = greedy), top-p, the EOS id and the seed are
traced values, so changing them never recompiles.

Per-row EOS: a row that has sampled EOS is *done*. It still runs through the batched decode step
(feeding PAD) but its `length` is frozen, so everything it writes lands at position `length`, which
is scratch (DESIGN §2), its outputs are PAD and its new-token count stops. The loop ends when every
row is done or `max_new_tokens` tokens were drawn. The returned state holds, per row, the prompt and
every new token except the last one (`length = n_valid + lengths − 1`): the last drawn token is the
next step's input, as after a speculative commit (SPEC §12). The model may also draw PAD itself:
`lengths`, not PAD, tells where a row's output ends.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from csa2 import model
from csa2.boundary import entry_point, resolve_cache_format
from csa2.checks import is_int, is_number
from csa2.config import ModelConfig
from csa2.mesh import PARAMS, ROWS, Rules
from csa2.presets import EOS_ID, PAD_ID
from csa2.replay import ReplayPolicy
from csa2.sampling import sample
from csa2.state import State, init_state, token_granule, validate_state_args
from infer.values import pow2, round_up

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How each new token is drawn: greedy (temperature 0, top_p unused) or softmax(logits / T) over the
    top-p nucleus."""

    temperature: float = 0.0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        t, p = self.temperature, self.top_p
        if not is_number(t) or not math.isfinite(t) or t < 0:
            raise ValueError(f"Sampling.temperature={t!r}: use a finite number ≥ 0 (0 = greedy)")
        if not is_number(p) or not 0 < p <= 1:
            raise ValueError(f"Sampling.top_p={p!r}: use a number in (0, 1] (1 = no nucleus truncation)")


class GenerateResult(NamedTuple):
    """New tokens [B, max_new_tokens] int32 (PAD after a row's EOS), their count per row [B] (EOS included), state."""

    tokens: np.ndarray
    lengths: np.ndarray
    state: State


NO_EOS = -1  # the `eos_id` of a plan that never stops early: no token id equals it


class Plan(NamedTuple):
    """A validated, bucketed batch: the traced inputs of `generate_loop` and its static arguments."""

    tokens: np.ndarray  # [B, bucket] int32, PAD after each row's prompt
    n_valid: np.ndarray  # [B] int32 prompt lengths
    key: Array  # PRNG key of the seed
    eos_id: int  # NO_EOS = never stop early
    temperature: float
    top_p: float
    capacity: int
    max_new_tokens: int
    replay: ReplayPolicy
    cache_format: str
    numerics: str

    def traced(self) -> tuple:
        """The positional traced arguments of `generate_loop` after `(cfg, params)`."""
        return (self.tokens, self.n_valid, self.key, np.int32(self.eos_id), np.float32(self.temperature),
                np.float32(self.top_p))

    def static(self) -> dict:
        """The static keyword arguments of `generate_loop`."""
        return dict(capacity=self.capacity, max_new_tokens=self.max_new_tokens, replay=self.replay,
                    cache_format=self.cache_format, numerics=self.numerics)


# ---------------------------------------------------------------------------------------------
# The compiled loop

def checked_by_plan(**_) -> None:
    """The host check of the generate loops: none, their inputs come from `plan`, which validates them."""


@entry_point(checked_by_plan,
             static_argnames=("cfg", "capacity", "max_new_tokens", "replay", "cache_format", "numerics"),
             place=dict(params=PARAMS, tokens=ROWS, n_valid=ROWS), out=(ROWS, ROWS, ROWS))
def generate_loop(cfg: ModelConfig, params: dict, tokens: Array, n_valid: Array, key: Array, eos_id: Array,
                  temperature: Array, top_p: Array, *, capacity: int, max_new_tokens: int,
                  replay: ReplayPolicy, cache_format: str, numerics: str) -> tuple[Array, Array, State]:
    """Prefill `tokens [B, bucket]` (`n_valid [B]` real) and decode up to `max_new_tokens` per row.

    Returns (new tokens [B, max_new_tokens], new-token counts [B], state); see the module docstring
    for the EOS rule. Inputs must come from `plan` (it validates); this function checks nothing.
    """
    b = tokens.shape[0]
    draw = functools.partial(sample, temperature=temperature, top_p=top_p)
    state = init_state(cfg, b, capacity, cache_format)
    logits, state, _ = model.prefill(cfg, params, state, tokens, n_valid, replay, numerics=numerics)
    key, sub = jax.random.split(key)
    first = draw(logits, sub)
    out = jnp.full((b, max_new_tokens), PAD_ID, jnp.int32).at[:, 0].set(first)
    carry = (jnp.int32(1), state, out, first == eos_id, jnp.ones((b,), jnp.int32), key)

    def running(carry):
        step, _, _, done, _, _ = carry
        return (step < max_new_tokens) & ~jnp.all(done)

    def step_fn(carry):
        step, state, out, done, lengths, key = carry
        prev = jax.lax.dynamic_index_in_dim(out, step - 1, axis=1, keepdims=False)  # [B]
        logits, new = model.decode_step(cfg, params, state, prev, numerics)
        state = new.replace(length=jnp.where(done, state.length, new.length))  # done rows write scratch only
        key, sub = jax.random.split(key)
        token = jnp.where(done, PAD_ID, draw(logits, sub))
        out = jax.lax.dynamic_update_index_in_dim(out, token, step, axis=1)
        lengths = jnp.where(done, lengths, step + 1)
        return step + 1, state, out, done | (token == eos_id), lengths, key

    _, state, out, _, lengths, _ = jax.lax.while_loop(running, step_fn, carry)
    return out, lengths, state


# ---------------------------------------------------------------------------------------------
# Host side: validation and buckets (DESIGN §7)

def _rows(prompts, lengths) -> list[np.ndarray]:
    """The prompts as a list of 1-D integer arrays, from a list of sequences or a [B, S] array + lengths."""
    if isinstance(prompts, (list, tuple)):
        if lengths is not None:
            raise ValueError("lengths: pass lengths only with a [B, S] prompt array; a list of prompts carries its own")
        if not prompts:
            raise ValueError("prompts=[]: give at least one prompt")
        rows = [np.asarray(p) for p in prompts]
    else:
        arr = np.asarray(prompts)
        if arr.ndim != 2:
            raise ValueError(f"prompts.shape={arr.shape}: pass a list of 1-D token arrays, or a [B, S] array "
                             "with lengths")
        if arr.shape[0] == 0:
            raise ValueError("prompts.shape[0]=0: give at least one prompt")
        n = np.full(arr.shape[0], arr.shape[1]) if lengths is None else np.asarray(lengths)
        if n.shape != (arr.shape[0],) or not np.issubdtype(n.dtype, np.integer):
            raise ValueError(f"lengths={np.asarray(lengths).tolist()}: give one integer prompt length per row "
                             f"({arr.shape[0]} rows)")
        if (n < 1).any() or (n > arr.shape[1]).any():
            raise ValueError(f"lengths={n.tolist()}: each must lie in [1, S={arr.shape[1]}]")
        rows = [arr[i, :k] for i, k in enumerate(n.tolist())]
    for i, row in enumerate(rows):
        if row.ndim != 1:
            raise ValueError(f"prompts[{i}].shape={row.shape}: each prompt is a 1-D sequence of token ids")
        if row.size == 0:
            raise ValueError(f"prompts[{i}] is empty: every prompt needs at least one token (e.g. BOS)")
        if not np.issubdtype(row.dtype, np.integer):
            raise ValueError(f"prompts[{i}].dtype={row.dtype}: token ids must be integers")
    return rows


def plan(cfg: ModelConfig, prompts, lengths=None, *, max_new_tokens: int, sampling: Sampling = Sampling(),
         eos_id: int | None = EOS_ID, replay: ReplayPolicy = ReplayPolicy(), cache_format: str | None = None,
         numerics: str = "spec", seed: int = 0) -> Plan:
    """Validate a batch and pad it to its buckets; every bad value raises ValueError (field, value, fix).
    `cache_format` None: the cache `numerics` needs ("fp4" for "spec", "float" for "float")."""
    if not isinstance(cfg, ModelConfig):
        raise ValueError(f"cfg: expected a csa2.config.ModelConfig, got {type(cfg).__name__}")
    rows = _rows(prompts, lengths)
    if not is_int(max_new_tokens) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r}: must be an integer ≥ 1")
    if not isinstance(sampling, Sampling):
        raise ValueError(f"sampling={sampling!r}: pass an infer.generate.Sampling(temperature=..., top_p=...)")
    if eos_id is not None and (not is_int(eos_id) or not 0 <= eos_id < cfg.vocab_size):
        raise ValueError(f"eos_id={eos_id!r}: must be a token id in [0, {cfg.vocab_size}), or None for no EOS")
    if not isinstance(replay, ReplayPolicy):
        raise ValueError(f"replay={replay!r}: pass a csa2.replay.ReplayPolicy (EXACT for the reference mode)")
    replay.check(cfg)
    cache_format = resolve_cache_format(numerics, cache_format)
    if not is_int(seed) or not 0 <= seed < 2**32:
        raise ValueError(f"seed={seed!r}: must be an integer in [0, 2**32) (a 32-bit PRNG seed)")
    for i, row in enumerate(rows):
        bad = row[(row < 0) | (row >= cfg.vocab_size)]
        if bad.size:
            raise ValueError(f"prompts[{i}]: ids {sorted(set(bad.tolist()))[:5]} are outside the vocabulary "
                             f"[0, {cfg.vocab_size}); map them through the tokenizer first")
    granule = token_granule(cfg)
    limit = cfg.max_position_embeddings // granule * granule  # the largest legal state capacity
    longest = max(row.size for row in rows)
    if longest + max_new_tokens > limit:
        worst = max(range(len(rows)), key=lambda i: rows[i].size)
        raise ValueError(f"prompts[{worst}]: {longest} prompt tokens + max_new_tokens={max_new_tokens} = "
                         f"{longest + max_new_tokens} positions exceed {limit} (max_position_embeddings="
                         f"{cfg.max_position_embeddings} rounded down to a multiple of {granule}); "
                         "shorten the prompt or lower max_new_tokens")
    bucket = min(round_up(pow2(longest), granule), limit)
    capacity = min(round_up(pow2(bucket + max_new_tokens), granule), limit)
    validate_state_args(cfg, len(rows), capacity, cache_format)
    tokens = np.full((len(rows), bucket), PAD_ID, np.int32)
    for i, row in enumerate(rows):
        tokens[i, :row.size] = row
    return Plan(tokens=tokens, n_valid=np.array([row.size for row in rows], np.int32),
                key=jax.random.PRNGKey(seed), eos_id=NO_EOS if eos_id is None else int(eos_id),
                temperature=float(sampling.temperature), top_p=float(sampling.top_p), capacity=capacity,
                max_new_tokens=int(max_new_tokens), replay=replay, cache_format=cache_format, numerics=numerics)


def run(cfg: ModelConfig, params: dict, p: Plan, compiled=None, *, mesh: Mesh | None = None,
        rules: Rules | None = None) -> GenerateResult:
    """Run `generate_loop` on a plan, or `compiled`, its AOT executable (`lower(...).compile()`). With `mesh` and
    `rules`, the loop compiled for that mesh (`EntryPoint.on`: `params` placed by `csa2.sharding.shard_params`,
    the prompts, counts, new tokens and state split over `data`, traced under the mesh, so the MoE runs
    expert-parallel); one program per plan's static arguments, as on one device."""
    if compiled is not None:
        out, lengths, state = compiled(params, *p.traced())
    elif mesh is not None:
        out, lengths, state = generate_loop.on(mesh, rules)(cfg, params, *p.traced(), **p.static())
    else:
        out, lengths, state = generate_loop(cfg, params, *p.traced(), **p.static())
    return GenerateResult(tokens=np.asarray(out), lengths=np.asarray(lengths), state=state)


def lower(cfg: ModelConfig, params: dict, p: Plan):
    """`generate_loop` lowered for this plan: `.compile()` it to time compilation apart from the run."""
    return generate_loop.lower(cfg, params, *p.traced(), **p.static())


def generate(cfg: ModelConfig, params: dict, prompts: Sequence | np.ndarray, lengths=None, *, max_new_tokens: int,
             sampling: Sampling = Sampling(), eos_id: int | None = EOS_ID, replay: ReplayPolicy = ReplayPolicy(),
             cache_format: str | None = None, numerics: str = "spec", seed: int = 0) -> GenerateResult:
    """Continue each prompt by up to `max_new_tokens` tokens.

    `prompts`: a list of 1-D token arrays of any lengths, or a [B, S] array with `lengths [B]`
    (default S). `eos_id=None` never stops early. `seed` fixes the draws when sampling. `numerics`: "spec"
    (SPEC §8, on the packed FP4/FP8 cache unless `cache_format="float"`) or "float" (the float model on a
    float cache: the baseline that measures what the FP4/FP8 cache costs).
    """
    p = plan(cfg, prompts, lengths, max_new_tokens=max_new_tokens, sampling=sampling, eos_id=eos_id, replay=replay,
             cache_format=cache_format, numerics=numerics, seed=seed)
    return run(cfg, params, p)
