"""DSpark speculative decoding measured (SPEC §12): acceptance per draft position against γ, temperature and context
length; the drafter's confidences against observed acceptance (reliability, ECE); fixed γ against the confidence
schedule in tokens per verify step and tokens per second. The measuring code behind notebooks/dspark.ipynb.

Acceptance and calibration come from `decode`, a host loop over one jitted speculative step that does what
`infer.speculative.speculative_loop` does (draft γ → verify → `accept` → commit, per-row EOS and budget, the same
PRNG key splits) and also returns, per step, every draft's confidence c_k and whether it was reached and accepted:
`SpecResult` carries only the counts. Differences from the compiled loop, both chosen so that every γ, temperature
and context length of a figure runs in two compiled programs (on CPU a program takes 15–30 s to compile):
- the verify block is always the full γ_max + 1 = `dspark_block_size` + 1 rows; fixed γ < γ_max caps the accepted
  drafts at γ (`accept`'s cap, as the loop does for rows whose verify length is below the block width), so the
  drafts past γ are scored but never reached. The loop verifies only γ + 1 rows: the result is the same up to
  float rounding across shapes;
- `bucket` / `capacity` may be set larger than `speculative_generate` would choose (prompts padded, `n_valid` their
  lengths), so prompts of several lengths share one prefill program; the defaults are the loop's.
At the default bucket and capacity the records reproduce `speculative_generate`'s tokens, steps and per-position
counts, greedy and with stochastic acceptance (tests/experiments/test_dspark.py, at γ = 3 < γ_max on a small model).

Intervals are over prompts (`infer.stats`, percentile bootstrap, 95 %): the prompt is the independent unit.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from csa2 import model
from csa2.config import ModelConfig
from csa2.presets import EOS_ID, PAD_ID
from csa2.replay import ReplayPolicy
from csa2.sampling import distribution, sample
from csa2.state import init_state, token_granule
from infer import generate, stats
from infer.bench_spec import validation_prompts
from infer.schedule import SpsTable
from infer.speculative import accept, speculative_generate
from infer.values import pow2, round_up

Array = jax.Array


def held_out(n: int, length: int) -> list[np.ndarray]:
    """The first `n` held-out prompts of at most `length` tokens (`infer.bench_spec.validation_prompts`: windows of
    the validation documents), or all there are when the documents give fewer."""
    lo, hi = 0, n  # the largest count that validation_prompts gives (it refuses more)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        try:
            validation_prompts(mid, length)
            lo = mid
        except ValueError:
            hi = mid - 1
    return validation_prompts(lo, length)


# ---------------------------------------------------------------------------------------------
# The host loop: one jitted speculative step, per-draft records


@functools.partial(jax.jit, static_argnames=("cfg", "capacity", "replay", "cache_format"))
def _start(cfg: ModelConfig, params, tokens: Array, n_valid: Array, key: Array, temperature: Array, top_p: Array, *,
           capacity: int, replay: ReplayPolicy, cache_format: str):
    """Prefill and the first token, as `speculative_loop` begins: (state, first [B], key)."""
    state = init_state(cfg, tokens.shape[0], capacity, cache_format)
    logits, state, _ = model.prefill(cfg, params, state, tokens, n_valid, replay)
    key, sub = jax.random.split(key)
    return state, sample(logits, sub, temperature, top_p), key


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("state",))
def _step(cfg: ModelConfig, params, state, anchor: Array, done: Array, room: Array, key: Array, gamma: Array,
          eos_id: Array, temperature: Array, top_p: Array):
    """One step of `speculative_loop` at fixed γ (verify block γ_max + 1 rows, at most `gamma` drafts accepted),
    for rows with `room [B]` tokens left in their budget. Returns the new (state, anchor, done, key), the emitted
    tokens [B, γ_max + 1] with the count kept per row [B], the accepted drafts n [B], and per draft [B, γ_max]:
    confidence c_k, reached (verified after k accepted drafts), accepted."""
    gamma_max = cfg.dspark_block_size
    key, k_draft, k_accept = jax.random.split(key, 3)
    proposal = model.draft(cfg, params, state, anchor, k_draft, temperature, top_p)
    block = jnp.concatenate([anchor[:, None], proposal.tokens], axis=1)  # [B, γ_max + 1]
    logits, state_v = model.verify(cfg, params, state, block)
    cap = jnp.where(done, 0, gamma)
    target = distribution(logits, temperature, top_p)
    drafted = distribution(proposal.logits, temperature, top_p)
    n, bonus = accept(target, drafted, proposal.tokens, cap, k_accept)

    emitted = model.emitted(block, n + 1, bonus)
    j = jnp.arange(gamma_max + 1)[None]
    eos_at = jnp.min(jnp.where((emitted == eos_id) & (j <= n[:, None]), j, gamma_max + 1), axis=1)
    keep = jnp.minimum(jnp.minimum(n + 1, eos_at + 1), room)
    keep = jnp.where(done, 0, keep)
    last = jnp.take_along_axis(emitted, jnp.maximum(keep - 1, 0)[:, None], axis=1)[:, 0]
    state = model.commit(state_v, keep, last)
    ended = (eos_at < keep) | (room - keep <= 0)
    k = jnp.arange(gamma_max)[None]
    reached = k < jnp.minimum(n + 1, cap)[:, None]
    took = k < n[:, None]
    return (state, jnp.where(done, anchor, last), done | ended, key), (emitted, keep, n, proposal.confidence,
                                                                      reached, took)


@dataclasses.dataclass(frozen=True)
class Decoded:
    """Speculative decoding of n prompts by the host loop, at fixed γ.

    Per prompt (row i = prompt i): `tokens [n, max_new_tokens]` (PAD after the end), `lengths [n]`, `row_steps [n]`
    verify steps it ran in, `accepted [n]` drafts accepted, `position_accepts` / `position_tries [n, γ]` (draft k
    accepted / reached). Per draft reached (m of them, in step order): `confidence [m]` (the drafter's c_k),
    `accept [m]` bool (accepted given the drafts before it were), `position [m]` (k, 0-based), `prompt [m]` (row).
    `meta`: what was run (γ, temperature, sizes)."""

    tokens: np.ndarray
    lengths: np.ndarray
    row_steps: np.ndarray
    accepted: np.ndarray
    position_accepts: np.ndarray
    position_tries: np.ndarray
    confidence: np.ndarray
    accept: np.ndarray
    position: np.ndarray
    prompt: np.ndarray
    meta: dict

    @property
    def n(self) -> int:
        return len(self.lengths)

    def per_position(self, **kw) -> list[stats.Interval]:
        """Acceptance of each draft position (accepted / reached, pooled over prompts) with its interval."""
        return stats.ratio_interval(self.position_accepts, self.position_tries, **kw)

    def acceptance_length(self, **kw) -> stats.Interval:
        """Tokens per verify step, bonus included (SPEC §12's acceptance length τ), pooled over steps."""
        (tau,) = stats.ratio_interval((self.accepted + self.row_steps)[:, None], self.row_steps[:, None], **kw)
        return tau


def _concat(parts: list[Decoded], meta: dict) -> Decoded:
    offsets = np.cumsum([0] + [p.n for p in parts[:-1]])
    cat = lambda name: np.concatenate([getattr(p, name) for p in parts])  # noqa: E731
    return Decoded(tokens=cat("tokens"), lengths=cat("lengths"), row_steps=cat("row_steps"), accepted=cat("accepted"),
                   position_accepts=cat("position_accepts"), position_tries=cat("position_tries"),
                   confidence=cat("confidence"), accept=cat("accept"), position=cat("position"),
                   prompt=np.concatenate([p.prompt + o for p, o in zip(parts, offsets)]), meta=meta)


def shapes(cfg: ModelConfig, prompts: Sequence, max_new_tokens: int) -> tuple[int, int]:
    """The (bucket, capacity) `speculative_generate` gives these prompts at the widest verify block: pass the
    largest over several prompt sets to `decode` so they share its compiled programs."""
    longest = max(len(p) for p in prompts)
    granule = token_granule(cfg)
    bucket = round_up(pow2(longest), granule)
    plain = round_up(pow2(bucket + max_new_tokens), granule)
    need = longest + max_new_tokens + min(cfg.dspark_block_size, cfg.max_draft) + 1
    return bucket, max(plain, round_up(pow2(need), granule))


def decode_batch(cfg: ModelConfig, params, prompts: Sequence, *, max_new_tokens: int, gamma: int | None = None,
                 sampling: generate.Sampling = generate.Sampling(), eos_id: int | None = EOS_ID,
                 replay: ReplayPolicy = ReplayPolicy(), cache_format: str = "fp4", seed: int = 0,
                 bucket: int | None = None, capacity: int | None = None) -> Decoded:
    """One batch of `prompts` (one row each) decoded speculatively by the host loop at fixed `gamma` (default
    `dspark_block_size`); arguments as `speculative_generate`, plus `bucket` / `capacity` (module docstring)."""
    gamma_max = cfg.dspark_block_size
    if gamma_max > cfg.max_draft:
        raise ValueError(f"dspark_block_size={gamma_max} > max_draft={cfg.max_draft}: the host loop verifies the "
                         "whole draft block; use a config whose max_draft holds it")
    gamma = gamma_max if gamma is None else gamma
    if replay.window is not None and replay.window < cfg.sliding_window:
        raise ValueError(f"replay={replay}: a drafting caller prefills at least the sliding window W = "
                         f"{cfg.sliding_window} through the decoder (the drafter's first context); use window ≥ W")
    if not isinstance(gamma, (int, np.integer)) or not 1 <= gamma <= gamma_max:
        raise ValueError(f"gamma={gamma!r}: drafts per verify must be an integer in [1, {gamma_max}]")
    p = generate.plan(cfg, prompts, max_new_tokens=max_new_tokens, sampling=sampling, eos_id=eos_id, replay=replay,
                      cache_format=cache_format, seed=seed)
    own_bucket, own_capacity = shapes(cfg, prompts, max_new_tokens)
    bucket, capacity = bucket or own_bucket, capacity or own_capacity
    if bucket < own_bucket or capacity < own_capacity:
        raise ValueError(f"bucket={bucket}, capacity={capacity}: these prompts need at least {own_bucket} and "
                         f"{own_capacity}")
    tokens = np.pad(p.tokens, ((0, 0), (0, bucket - p.tokens.shape[1])), constant_values=PAD_ID)
    b = len(p.n_valid)
    temperature, top_p = np.float32(p.temperature), np.float32(p.top_p)
    state, anchor, key = _start(cfg, params, tokens, p.n_valid, p.key, temperature, top_p, capacity=capacity,
                                replay=p.replay, cache_format=p.cache_format)
    first = np.asarray(anchor)
    out = np.full((b, max_new_tokens), PAD_ID, np.int32)
    out[:, 0] = first
    count = np.ones(b, np.int64)
    done = (first == p.eos_id) | (max_new_tokens == 1)
    row_steps, accepted = np.zeros(b, np.int64), np.zeros(b, np.int64)
    accepts, tries = np.zeros((b, gamma), np.int64), np.zeros((b, gamma), np.int64)
    conf, acc, pos, row = [], [], [], []
    done_d = jnp.asarray(done)
    while not done.all():
        room = jnp.asarray(max_new_tokens - count, jnp.int32)
        (state, anchor, done_d, key), rec = _step(cfg, params, state, anchor, done_d, room, key, np.int32(gamma),
                                                  np.int32(p.eos_id), temperature, top_p)
        emitted, keep, n, c, reached, took = jax.device_get(rec)
        for i in np.flatnonzero(keep):
            out[i, count[i]:count[i] + keep[i]] = emitted[i, :keep[i]]
        running = ~done
        row_steps += running
        accepted += np.where(running, n, 0)
        accepts += took[:, :gamma]
        tries += reached[:, :gamma]
        r, k = np.nonzero(reached)
        conf.append(c[r, k])
        acc.append(took[r, k])
        pos.append(k)
        row.append(r)
        count += keep
        done = np.asarray(done_d)
    cat = lambda xs, dtype: np.concatenate(xs).astype(dtype) if xs else np.zeros(0, dtype)  # noqa: E731
    return Decoded(tokens=out, lengths=count.astype(np.int32), row_steps=row_steps, accepted=accepted,
                   position_accepts=accepts, position_tries=tries, confidence=cat(conf, np.float32),
                   accept=cat(acc, bool), position=cat(pos, np.int32), prompt=cat(row, np.int32),
                   meta=dict(gamma=int(gamma), temperature=float(p.temperature), top_p=float(p.top_p),
                             max_new_tokens=max_new_tokens, bucket=bucket, capacity=capacity, seed=seed))


def decode(cfg: ModelConfig, params, prompts: Sequence, *, batch: int, max_new_tokens: int, gamma: int | None = None,
           sampling: generate.Sampling = generate.Sampling(), eos_id: int | None = None, seed: int = 0,
           bucket: int | None = None, capacity: int | None = None) -> Decoded:
    """`decode_batch` over `prompts` in batches of `batch` rows (a short last batch is filled with repeats of its
    last prompt, counted once, so every call runs one compiled batch size); batch i draws with seed `seed + i`.
    `eos_id` defaults to None: every prompt decodes `max_new_tokens` tokens."""
    if not prompts:
        raise ValueError("prompts: empty; pass at least one prompt")
    bucket_, capacity_ = shapes(cfg, prompts, max_new_tokens)
    bucket, capacity = max(bucket or 0, bucket_), max(capacity or 0, capacity_)
    parts = []
    for i in range(0, len(prompts), batch):
        chunk = list(prompts[i:i + batch])
        full = chunk + chunk[-1:] * (batch - len(chunk))
        d = decode_batch(cfg, params, full, max_new_tokens=max_new_tokens, gamma=gamma, sampling=sampling,
                         eos_id=eos_id, seed=seed + i // batch, bucket=bucket, capacity=capacity)
        parts.append(_rows(d, len(chunk)))
    return _concat(parts, {**parts[0].meta, "seed": seed, "batch": batch, "prompts": len(prompts)})


def _rows(d: Decoded, k: int) -> Decoded:
    """The first `k` rows of `d` (the records of the other rows dropped)."""
    keep = d.prompt < k
    return dataclasses.replace(d, tokens=d.tokens[:k], lengths=d.lengths[:k], row_steps=d.row_steps[:k],
                               accepted=d.accepted[:k], position_accepts=d.position_accepts[:k],
                               position_tries=d.position_tries[:k], confidence=d.confidence[keep],
                               accept=d.accept[keep], position=d.position[keep], prompt=d.prompt[keep])


def by_gamma(cfg: ModelConfig, params, prompts: Sequence, gammas: Sequence[int], **kw) -> dict[int, Decoded]:
    """`decode` of the same prompts at each fixed γ (one compiled step serves every γ)."""
    return {int(g): decode(cfg, params, prompts, gamma=int(g), **kw) for g in gammas}


def by_temperature(cfg: ModelConfig, params, prompts: Sequence, temperatures: Sequence[float], *, seed: int = 0,
                   **kw) -> dict[float, Decoded]:
    """`decode` of the same prompts at each temperature (top-p 1, stochastic acceptance above 0; the same seeds at
    every temperature). Temperature is a traced value: one compiled step serves all."""
    return {float(t): decode(cfg, params, prompts, sampling=generate.Sampling(temperature=float(t), top_p=1.0),
                             seed=seed, **kw) for t in temperatures}


def by_context(cfg: ModelConfig, params, prompt_sets: dict[int, Sequence], *, max_new_tokens: int,
               bucket: int | None = None, capacity: int | None = None, **kw) -> dict[int, Decoded]:
    """`decode` of each prompt set (context length → prompts), all at the bucket and capacity of the longest (or
    the given ones, if larger), so they share one prefill and one step program."""
    every = [p for ps in prompt_sets.values() for p in ps]
    own = shapes(cfg, every, max_new_tokens)
    bucket, capacity = max(bucket or 0, own[0]), max(capacity or 0, own[1])
    return {int(n): decode(cfg, params, ps, max_new_tokens=max_new_tokens, bucket=bucket, capacity=capacity, **kw)
            for n, ps in prompt_sets.items()}


# ---------------------------------------------------------------------------------------------
# Calibration: the drafter's confidences against observed acceptance


def _bin(confidence: np.ndarray, bins: int) -> np.ndarray:
    """Equal-width bins over [0, 1]: bin b holds [b/bins, (b+1)/bins), the last one also 1."""
    if not isinstance(bins, (int, np.integer)) or bins < 1:
        raise ValueError(f"bins={bins!r}: use an integer ≥ 1")
    return np.clip((np.asarray(confidence, np.float64) * bins).astype(np.int64), 0, bins - 1)


def ece(confidence, accepted, bins: int = 10) -> float:
    """Expected calibration error: Σ_b (n_b / N) · |mean confidence_b − observed acceptance_b| over equal-width bins
    (empty bins weigh 0); = Σ_b |Σ c − Σ accepted| / N."""
    c, a = np.asarray(confidence, np.float64), np.asarray(accepted, np.float64)
    if c.shape != a.shape or c.ndim != 1 or not c.size:
        raise ValueError(f"confidence.shape={c.shape}, accepted.shape={a.shape}: expected equal non-empty [m]")
    b = _bin(c, bins)
    gap = np.bincount(b, c, minlength=bins) - np.bincount(b, a, minlength=bins)
    return float(np.abs(gap).sum() / c.size)


@dataclasses.dataclass(frozen=True)
class Reliability:
    """A reliability diagram over `bins` equal-width confidence bins: `edges [bins + 1]`, `count [bins]` drafts per
    bin, `confidence [bins]` their mean confidence (NaN when empty), `observed` the acceptance per bin with its
    interval over prompts (NaN when empty), `ece` with its interval over prompts, `n` prompts, `m` drafts."""

    edges: np.ndarray
    count: np.ndarray
    confidence: np.ndarray
    observed: list
    ece: stats.Interval
    n: int
    m: int


def _per_prompt(d: Decoded, bins: int, keep: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per prompt and bin [n, bins]: drafts, Σ confidence, Σ accepted."""
    b, p = _bin(d.confidence[keep], bins), d.prompt[keep]
    shape = (d.n, bins)
    count, conf, acc = np.zeros(shape), np.zeros(shape), np.zeros(shape)
    np.add.at(count, (p, b), 1)
    np.add.at(conf, (p, b), d.confidence[keep])
    np.add.at(acc, (p, b), d.accept[keep])
    return count, conf, acc


def reliability(d: Decoded, bins: int = 10, position: int | None = None, *, level: float = stats.LEVEL,
                resamples: int = stats.RESAMPLES, seed: int = 0) -> Reliability:
    """The reliability diagram and ECE of the drafts `d` reached (those at `position`, 0-based, if given). The ECE
    interval is a percentile bootstrap over prompts, as `infer.stats` does for rates: each resample draws n prompts
    with replacement and recomputes the ECE from their pooled per-bin sums."""
    keep = np.ones(d.confidence.shape, bool) if position is None else d.position == position
    if not keep.any():
        raise ValueError(f"position={position}: no draft was reached there; choose a position < γ that was reached")
    count, conf, acc = _per_prompt(d, bins, keep)
    total = count.sum(0)
    mean_conf = np.where(total > 0, conf.sum(0) / np.maximum(total, 1), np.nan)
    observed = stats.ratio_interval(acc, count, level=level, resamples=resamples, seed=seed)
    value = float(np.abs(conf.sum(0) - acc.sum(0)).sum() / total.sum())
    idx = np.random.default_rng(seed).integers(0, d.n, size=(resamples, d.n))  # infer.stats' draws
    r_count, r_gap = count[idx].sum(1).sum(1), np.abs(conf[idx].sum(1) - acc[idx].sum(1)).sum(1)
    ok = r_count > 0
    lo, hi = np.quantile(r_gap[ok] / r_count[ok], [(1 - level) / 2, (1 + level) / 2])
    return Reliability(edges=np.linspace(0, 1, bins + 1), count=total.astype(np.int64), confidence=mean_conf,
                       observed=observed, ece=stats.Interval(value, float(lo), float(hi), d.n, level), n=d.n,
                       m=int(keep.sum()))


def confidence_by_position(d: Decoded, **kw) -> list[stats.Interval]:
    """Mean confidence c_k of the drafts reached at each position, pooled over prompts, with its interval: beside
    `Decoded.per_position` (the observed acceptance) it is the calibration per position."""
    gamma = d.position_tries.shape[1]
    conf = np.zeros((d.n, gamma))
    np.add.at(conf, (d.prompt, d.position), d.confidence)
    return stats.ratio_interval(conf, d.position_tries, **kw)


# ---------------------------------------------------------------------------------------------
# Fixed γ against the confidence schedule: tokens per verify step, tokens per second, cost ratios


def cost_ratios(sps: SpsTable, decode_steps_per_s: dict[int, float]) -> dict[int, dict[int, float]]:
    """{batch: {width: time of one speculative step at that verify width / time of one plain decode step}}: a
    speculative step pays for itself when it commits more tokens than this ratio (the speed-up is τ / ratio)."""
    return {b: {w: decode_steps_per_s[b] / s for w, s in zip(sps.widths, sps.row(b))} for b in decode_steps_per_s}


def _width_index(sps: SpsTable, width: int) -> int:
    if width not in sps.widths:
        raise ValueError(f"SpsTable.widths={sps.widths}: fixed γ verifies {width} rows; measure that width too")
    return sps.widths.index(width)


def compare(cfg: ModelConfig, params, prompts: Sequence, sps: SpsTable, decode_steps_per_s: float, *, batch: int,
            max_new_tokens: int, reps: int, log: Callable[[str], None] = lambda _: None) -> dict[str, dict]:
    """Plain greedy `generate`, fixed γ = γ_max and the confidence schedule (`speculative_generate` with `sps`) on
    `prompts` in batches of `batch` (a multiple of it), all greedy, tokens checked equal. Each method is run once to
    compile, then `reps` times interleaved (the order reversed every other rep); its wall time is the median over
    reps of the sum over batches.

    Per method: `tokens_per_s` measured (new tokens / wall time of the whole calls, prefill included),
    `predicted_tokens_per_s` (the tokens after the first / the decode time the tables predict: verify steps at
    each width over `sps`, or max_new_tokens − 1 plain steps over `decode_steps_per_s`; prefill excluded), and for
    the speculative methods `tau` (tokens per verify step with its interval over prompts), `widths` (verify steps
    run at each of `sps.widths`) and `cost_ratio` (the mean time of those steps in plain decode steps: the tables
    predict a speed-up of τ / cost_ratio)."""
    if len(prompts) % batch:
        raise ValueError(f"{len(prompts)} prompts: pass a multiple of batch={batch}")
    gamma = min(cfg.dspark_block_size, cfg.max_draft)
    rates = sps.row(batch)
    chunks = [list(prompts[i:i + batch]) for i in range(0, len(prompts), batch)]
    methods = {
        "plain": lambda c: generate.generate(cfg, params, c, max_new_tokens=max_new_tokens, eos_id=None),
        f"fixed γ = {gamma}": lambda c: speculative_generate(cfg, params, c, max_new_tokens=max_new_tokens,
                                                             eos_id=None),
        "scheduled": lambda c: speculative_generate(cfg, params, c, max_new_tokens=max_new_tokens, eos_id=None,
                                                    sps=sps)}
    results = {name: [run(c) for c in chunks] for name, run in methods.items()}  # compile, and the statistics
    for name, res in results.items():
        for r, ref in zip(res, results["plain"]):
            if not np.array_equal(r.tokens, ref.tokens):
                raise AssertionError(f"{name}: greedy output differs from plain generate (batch {batch})")
    times = {name: [] for name in methods}
    for rep in range(reps):
        for name in (list(methods) if rep % 2 == 0 else list(methods)[::-1]):
            total = 0.0
            for c in chunks:
                t0 = time.perf_counter()
                jax.block_until_ready(methods[name](c).state.length)
                total += time.perf_counter() - t0
            times[name].append(total)
        log(f"batch {batch}: rep {rep + 1}/{reps}")
    out = {}
    for name, res in results.items():
        new = sum(int(r.lengths.sum()) for r in res)
        wall = statistics.median(times[name])
        row = {"batch": batch, "prompts": len(prompts), "wall_s": wall, "walls_s": times[name],
               "tokens_per_s": new / wall}
        if name == "plain":
            predicted = len(chunks) * (max_new_tokens - 1) / decode_steps_per_s
        else:
            widths = np.sum([r.widths for r in res], axis=0)
            if name != "scheduled":
                widths = np.bincount([_width_index(sps, gamma + 1)], weights=widths, minlength=len(sps.widths))
            predicted = float(np.sum(widths / rates))
            row["cost_ratio"] = predicted * decode_steps_per_s / widths.sum()  # a mean step, in plain decode steps
            accepted = np.concatenate([r.accepted for r in res])
            steps = np.concatenate([r.row_steps for r in res])
            (tau,) = stats.ratio_interval((accepted + steps)[:, None], steps[:, None])
            row.update(tau=tau, widths=dict(zip(sps.widths, widths.astype(int).tolist())), steps=int(widths.sum()),
                       position_accepts=np.concatenate([r.position_accepts for r in res]),
                       position_tries=np.concatenate([r.position_tries for r in res]))
        row["predicted_tokens_per_s"] = (new - len(prompts)) / predicted
        out[name] = row
    return out


# ---------------------------------------------------------------------------------------------
# The notebook's results as JSON (experiments.results)


def _stored(iv: stats.Interval) -> dict | None:
    """An interval as `experiments.results` stores it; None where there is no estimate (a position never reached)."""
    return None if np.isnan(iv.value) else iv.as_dict()


def acceptance_results(runs: dict) -> dict:
    """{key: {"n", "tau", "per_position"}} of `Decoded` runs keyed by γ, temperature or context length: τ and each
    position's acceptance as stored intervals (None for a position never reached)."""
    return {str(k): {"n": d.n, "tau": _stored(d.acceptance_length()),
                     "per_position": [_stored(x) for x in d.per_position()]} for k, d in runs.items()}


def compare_results(compared: dict[int, dict[str, dict]]) -> dict:
    """`compare` rows by batch size as JSON values: the timings, τ as a stored interval, the widths run."""
    keep = ("prompts", "wall_s", "walls_s", "tokens_per_s", "predicted_tokens_per_s", "cost_ratio", "widths", "steps")
    return {str(b): {name: {k: ({str(w): c for w, c in r[k].items()} if k == "widths" else r[k])
                            for k in keep if k in r} | ({"tau": r["tau"].as_dict()} if "tau" in r else {})
                     for name, r in rows.items()} for b, rows in compared.items()}
