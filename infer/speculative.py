"""DSpark speculative decoding (SPEC §12): draft γ → verify → accept → commit n + 1 → emit n + 1, on device.

`speculative_generate` validates and buckets a batch like `infer.generate` (`generate.plan`), then
runs `speculative_loop`: one jitted function that prefills every row and loops in a
`jax.lax.while_loop` (no host round trip per step) over

1. `model.draft`: γ = `dspark_block_size` drafts after each row's last sampled token R (the anchor);
2. the verify-length choice: a fixed width γ + 1, or with an `SpsTable` the confidence schedule of
   `infer.schedule` (per-row lengths inside one of the compiled widths, picked at run time by
   `lax.switch`: one compile holds every width);
3. `model.verify` of `[R, d1 … d_{w−1}]`;
4. `accept`: per row, the number n of leading drafts accepted (at most its verify length − 1) and the
   bonus token C. Greedy and stochastic acceptance are one rule: accept d_i with probability
   min(1, p(d_i)/q(d_i)), on rejection draw C from norm(max(p − q, 0)), after n = cap draw C from p;
   p and q are the distributions `csa2.sampling` draws from (one-hot argmax at temperature 0, where
   the rule is "accept while d_i equals the target's argmax"), so the output has the target's
   distribution and greedy speculative output equals greedy `generate` token for token. Top-p
   truncates q as well as p: the drafts are drawn from the drafter's tempered nucleus, and q must be
   the distribution they were drawn from. That truncation is free, since min(1, p/q) with the residual
   norm(max(p − q, 0)) yields exactly p for any proposal q: it changes acceptance rates, never the
   output distribution (accepting against the untruncated q instead would bias it);
5. `model.commit(n + 1, C)` and emit (d1 … dn, C) into each row's output.

Per-row EOS and the token budget: a row whose emitted tokens reach EOS or `max_new_tokens` keeps
only the tokens up to there, commits only those (so its state holds exactly prompt + output − 1
tokens, as after `generate`) and is done: later steps commit nothing for it.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from csa2 import model
from csa2.boundary import entry_point
from csa2.checks import is_int
from csa2.config import ModelConfig
from csa2.mesh import PARAMS, REPLICATED, ROWS, Rules
from csa2.presets import EOS_ID, PAD_ID
from csa2.replay import ReplayPolicy, drafting_replay
from csa2.sampling import distribution, sample
from csa2.state import State, init_state, token_granule, validate_state_args
from infer import generate
from infer.schedule import SpsTable, config_fingerprint, schedule
from infer.values import pow2, round_up

Array = jax.Array


class SpecResult(NamedTuple):
    """New tokens [B, max_new_tokens] (PAD after a row's end), their count per row [B], the state, and
    statistics: `steps` (verify steps run), per row `accepted [B]` drafts accepted, `row_steps [B]` verify
    steps it ran in, `position_accepts [B, γ]` / `position_tries [B, γ]` (how often draft k was accepted /
    reached, i.e. verified after k accepted drafts: their ratio is the conditional acceptance per position),
    and `widths [len(widths)]` (how many steps ran at each compiled width). Per-row counts let a figure be
    resampled over prompts (`infer.stats`)."""

    tokens: np.ndarray
    lengths: np.ndarray
    state: State
    steps: int
    accepted: np.ndarray
    row_steps: np.ndarray
    position_accepts: np.ndarray
    position_tries: np.ndarray
    widths: np.ndarray

    @property
    def mean_accept(self) -> float:
        """Mean accepted drafts per verify step of a running row."""
        steps = self.row_steps.sum()
        return float(self.accepted.sum() / steps) if steps else 0.0

    @property
    def position_acceptance(self) -> np.ndarray:
        """[γ] accepted / reached drafts at each position, over every row (NaN where no draft was reached)."""
        accepts, tries = self.position_accepts.sum(0), self.position_tries.sum(0)
        return np.where(tries > 0, accepts / np.maximum(tries, 1), np.nan)


# ---------------------------------------------------------------------------------------------
# Acceptance (inside jit)

def accept(target: Array, draft: Array, drafts: Array, cap: Array, key: Array) -> tuple[Array, Array]:
    """Speculative acceptance (SPEC §12) of drafts `[B, γ]` drawn from `draft [B, γ, V]` against the target
    distributions `target [B, γ + 1, V]` (row i predicts the token after d_i, d_0 = R), at most `cap [B]`
    drafts per row. Returns n [B] (accepted drafts) and the bonus C [B]: d_i is accepted with probability
    min(1, p(d_i)/q(d_i)); the first rejection draws C from norm(max(p − q, 0)); after n = cap, from p."""
    b, gamma = drafts.shape
    k_accept, k_bonus = jax.random.split(key)
    p_d = jnp.take_along_axis(target[:, :gamma], drafts[..., None], axis=-1)[..., 0]
    q_d = jnp.take_along_axis(draft, drafts[..., None], axis=-1)[..., 0]
    u = jax.random.uniform(k_accept, (b, gamma))
    ok = (u * q_d < p_d) & (jnp.arange(gamma)[None] < cap[:, None])  # u < p/q, q > 0 for a drawn token
    n = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)
    rows = jnp.arange(b)
    p_n, q_n = target[rows, n], draft[rows, jnp.minimum(n, gamma - 1)]
    residual = jnp.where((n < cap)[:, None], jnp.maximum(p_n - q_n, 0.0), p_n)
    residual = jnp.where(jnp.sum(residual, axis=-1, keepdims=True) > 0, residual, p_n)
    return n.astype(jnp.int32), jax.random.categorical(k_bonus, jnp.log(residual), axis=-1).astype(jnp.int32)


def _emit(out: Array, count: Array, tokens: Array, n_new: Array) -> Array:
    """`out [B, M]` with `tokens[b, :n_new[b]]` written at columns `count[b] …` (columns past M dropped)."""
    cols = count[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
    cols = jnp.where(jnp.arange(tokens.shape[1])[None] < n_new[:, None], cols, out.shape[1])
    return out.at[jnp.arange(out.shape[0])[:, None], cols].set(tokens, mode="drop")


# ---------------------------------------------------------------------------------------------
# The compiled loop

@entry_point(generate.checked_by_plan,
             static_argnames=("cfg", "capacity", "max_new_tokens", "replay", "cache_format", "numerics", "widths"),
             place=dict(params=PARAMS, tokens=ROWS, n_valid=ROWS),
             out=(ROWS, ROWS, ROWS, dict(steps=REPLICATED, accepted=ROWS, row_steps=ROWS, position_accepts=ROWS,
                                        position_tries=ROWS, widths=REPLICATED)))
def speculative_loop(cfg: ModelConfig, params, tokens: Array, n_valid: Array, key: Array, eos_id: Array,
                     temperature: Array, top_p: Array, sps: Array, *, capacity: int, max_new_tokens: int,
                     replay: ReplayPolicy, cache_format: str, numerics: str, widths: tuple[int, ...]):
    """Prefill `tokens [B, bucket]` and decode speculatively up to `max_new_tokens` per row.

    `widths`: the compiled verify widths; one width runs fixed γ = width − 1, several run the confidence
    schedule with `sps [len(widths)]` the steps/s of this batch at each. Inputs come from
    `speculative_generate` (it validates, and raises a replay window below W with `drafting_replay`); this
    function checks nothing and prefills with `replay` as given.
    """
    b, gamma = tokens.shape[0], cfg.dspark_block_size
    state = init_state(cfg, b, capacity, cache_format)
    logits, state, _ = model.prefill(cfg, params, state, tokens, n_valid, replay, numerics=numerics)
    key, sub = jax.random.split(key)
    first = sample(logits, sub, temperature, top_p)
    out = jnp.full((b, max_new_tokens), PAD_ID, jnp.int32).at[:, 0].set(first)
    zeros_b = jnp.zeros((b,), jnp.int32)
    stats = dict(steps=jnp.int32(0), accepted=zeros_b, row_steps=zeros_b,
                 position_accepts=jnp.zeros((b, gamma), jnp.int32), position_tries=jnp.zeros((b, gamma), jnp.int32),
                 widths=jnp.zeros((len(widths),), jnp.int32))
    done = (first == eos_id) | (max_new_tokens == 1)
    carry = (state, out, jnp.ones((b,), jnp.int32), done, first, key, stats)

    def verify_at(width):
        def run(state, block):
            logits, new = model.verify(cfg, params, state, block[:, :width], numerics)
            return jnp.pad(logits, ((0, 0), (0, gamma + 1 - width), (0, 0))), new
        return run

    branches = [verify_at(w) for w in widths]

    def running(carry):
        return ~jnp.all(carry[3])

    def step(carry):
        state, out, count, done, anchor, key, stats = carry
        key, k_draft, k_accept = jax.random.split(key, 3)
        proposal = model.draft(cfg, params, state, anchor, k_draft, temperature, top_p, numerics)
        if len(widths) == 1:
            which, lengths = jnp.int32(0), jnp.full((b,), widths[0], jnp.int32)
        else:
            lengths, which, _ = schedule(proposal.confidence, ~done, sps, widths, temperature > 0)
        block = jnp.concatenate([anchor[:, None], proposal.tokens], axis=1)  # [B, γ + 1]
        logits, state_v = jax.lax.switch(which, branches, state, block)
        width = jnp.asarray(widths, jnp.int32)[which]
        cap = jnp.where(done, 0, jnp.minimum(lengths, width) - 1)
        target = distribution(logits, temperature, top_p)  # [B, γ + 1, V]
        drafted = distribution(proposal.logits, temperature, top_p)  # [B, γ, V]
        n, bonus = accept(target, drafted, proposal.tokens, cap, k_accept)

        # Emitted (d1 … dn, C), cut at EOS and at the budget; commit exactly the kept tokens.
        emitted = model.emitted(block, n + 1, bonus)
        j = jnp.arange(gamma + 1)[None]
        eos_at = jnp.min(jnp.where((emitted == eos_id) & (j <= n[:, None]), j, gamma + 1), axis=1)
        keep = jnp.minimum(jnp.minimum(n + 1, eos_at + 1), max_new_tokens - count)
        keep = jnp.where(done, 0, keep)
        last = jnp.take_along_axis(emitted, jnp.maximum(keep - 1, 0)[:, None], axis=1)[:, 0]
        state = model.commit(state_v, keep, last)
        out = _emit(out, count, emitted, keep)
        count = count + keep
        ended = (eos_at < keep) | (count >= max_new_tokens)
        tried = (jnp.arange(gamma)[None] < jnp.minimum(n + 1, cap)[:, None]).astype(jnp.int32)  # drafts reached
        took = (jnp.arange(gamma)[None] < n[:, None]).astype(jnp.int32)
        stats = dict(steps=stats["steps"] + 1, accepted=stats["accepted"] + jnp.where(done, 0, n),
                     row_steps=stats["row_steps"] + (~done).astype(jnp.int32),
                     position_accepts=stats["position_accepts"] + took,
                     position_tries=stats["position_tries"] + tried,
                     widths=stats["widths"].at[which].add(1))
        return state, out, count, done | ended, jnp.where(done, anchor, last), key, stats

    state, out, count, _, _, _, stats = jax.lax.while_loop(running, step, carry)
    return out, count, state, stats


# ---------------------------------------------------------------------------------------------
# Host side

def _check_widths(cfg: ModelConfig, widths: tuple[int, ...]) -> tuple[int, ...]:
    """An `SpsTable`'s widths (validated sorted positive integers) must fit this config's verify block."""
    most = min(cfg.dspark_block_size, cfg.max_draft) + 1
    if widths[-1] > most:
        raise ValueError(f"SpsTable.widths={widths}: the widest verify block here is {most} rows (γ + 1 with "
                         f"dspark_block_size = {cfg.dspark_block_size}, max_draft = {cfg.max_draft}); measure a table "
                         "for this config")
    return widths


def speculative_generate(cfg: ModelConfig, params, prompts: Sequence | np.ndarray, lengths=None, *,
                         max_new_tokens: int, sampling: generate.Sampling = generate.Sampling(),
                         eos_id: int | None = EOS_ID, replay: ReplayPolicy = ReplayPolicy(),
                         cache_format: str | None = None, numerics: str = "spec", seed: int = 0,
                         gamma: int | None = None,
                         sps: SpsTable | None = None, mesh: Mesh | None = None,
                         rules: Rules | None = None) -> SpecResult:
    """Continue each prompt by up to `max_new_tokens` tokens with DSpark speculative decoding.

    Arguments as `infer.generate.generate`, plus `gamma` (fixed drafts per verify, default
    `dspark_block_size`) or `sps` (a measured `SpsTable`: confidence-scheduled verify lengths over its
    widths, SPEC §12); not both.

    `replay`: the prompts are prefilled with `csa2.replay.drafting_replay(cfg, replay)`, a decoder replay of at
    least the sliding window W: a window R < W runs as `ReplayPolicy(window=W)` (exact stays exact). The drafter's
    first context `[L − W, L − 1]` needs decoder features of W prompt rows, and only running the decoder on them
    makes them; with R < W as given the first drafts would see R rows (`csa2.dspark` gives the acceptance lost).
    So greedy output with R < W equals `generate` with the raised window, not with R.

    `mesh` and `rules`: the loop compiled for that mesh (`EntryPoint.on`; `params` placed by
    `csa2.sharding.shard_params`, the prompts, new tokens, state and per-row statistics split over `data`).
    """
    if not cfg.num_nextn_predict_layers:
        raise ValueError("num_nextn_predict_layers=0: this config has no DSpark drafter; speculative decoding "
                         "needs one (the presets have one)")
    if gamma is not None and sps is not None:
        raise ValueError(f"gamma={gamma} and sps: pass a fixed gamma or an SpsTable for scheduled lengths, not both")
    p = generate.plan(cfg, prompts, lengths, max_new_tokens=max_new_tokens, sampling=sampling, eos_id=eos_id,
                      replay=replay, cache_format=cache_format, numerics=numerics, seed=seed)
    most = min(cfg.dspark_block_size, cfg.max_draft)
    if gamma is not None and (not is_int(gamma) or not 0 <= gamma <= most):
        raise ValueError(f"gamma={gamma!r}: drafts per verify must be an integer in [0, {most}] (the drafter proposes "
                         f"dspark_block_size = {cfg.dspark_block_size}, verify holds max_draft = {cfg.max_draft})")
    if sps is None:
        widths = (most + 1 if gamma is None else gamma + 1,)
        rates = np.ones((1,), np.float32)
    else:
        if not isinstance(sps, SpsTable):
            raise ValueError(f"sps={sps!r}: pass an infer.schedule.SpsTable (measure one with "
                             "python -m infer.bench_spec --measure-sps)")
        sps.check(config_fingerprint(cfg))
        widths = _check_widths(cfg, sps.widths)
        rates = np.asarray(sps.row(len(p.n_valid)), np.float32)
    # A verify block writes up to γ + 1 positions past the committed length.
    need = int(p.n_valid.max()) + max_new_tokens + widths[-1]
    granule = token_granule(cfg)
    capacity = max(p.capacity, round_up(pow2(need), granule))
    if capacity > cfg.max_position_embeddings:
        raise ValueError(f"max_new_tokens={max_new_tokens}: the longest prompt + new tokens + a verify block "
                         f"({need} positions) exceeds max_position_embeddings={cfg.max_position_embeddings}")
    validate_state_args(cfg, len(p.n_valid), capacity, p.cache_format)
    loop = speculative_loop if mesh is None else speculative_loop.on(mesh, rules)
    out, count, state, stats = loop(
        cfg, params, *p.traced(), rates, capacity=capacity, max_new_tokens=p.max_new_tokens,
        replay=drafting_replay(cfg, p.replay), cache_format=p.cache_format, numerics=p.numerics, widths=widths)
    stats = jax.device_get(stats)
    return SpecResult(tokens=np.asarray(out), lengths=np.asarray(count), state=state, steps=int(stats["steps"]),
                      accepted=stats["accepted"], row_steps=stats["row_steps"],
                      position_accepts=stats["position_accepts"],
                      position_tries=stats["position_tries"], widths=stats["widths"])
