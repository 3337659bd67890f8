"""Bounded decoder replay against the exact reference (SPEC §11): what a replay window R and a split layer cost
in next-token error, and what they save in token×layer work and wall time; the same for prefix hits.

Every comparison runs the SPEC §8 inference numerics (fp4 cache) on the same prompts, and reports:
- `kl_end`, `top1_end`: KL(exact ‖ bounded) of the next-token distribution at the prompt end (nats, mean over
  prompts) and how often the two argmaxes agree;
- `kl_steps`, `top1_steps`: the same over the first k generated tokens, both states fed the exact run's greedy
  tokens (teacher forcing, so the error is the state's, not a diverged text's);
- `work_ratio`: token×layer work of the bounded prefill over the exact one (`prefill`'s aux `work`);
- `wall_ratio`: median wall time of the bounded prefill over the exact one, warm, measured interleaved;
- `intervals`: each error measure with n (prompts) and a 95 % interval over prompts, the independent unit
  (`prompt_intervals`; None with one prompt).

`layer_savings` splits replay's wall-time saving over the tail layers, `sweep_windows` lists the windows where
the exactness of the last position changes (one per tail layer, up to `csa2.replay.exact_window`), and
`format_table` prints rows with their intervals.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from csa2 import model
from csa2.config import ModelConfig
from csa2.replay import EXACT, ReplayPolicy, exact_window
from csa2.state import init_state, token_granule
from infer import prefix_cache, stats
from infer.values import pow2, round_up


def _capacity(cfg: ModelConfig, n: int) -> int:
    return round_up(pow2(n), token_granule(cfg))


def _kl_top1(p_logits, q_logits) -> tuple[np.ndarray, np.ndarray]:
    """KL(p ‖ q) in nats and argmax agreement (0/1) of each row of `[B, V]` logits, `[B]` each."""
    lp, lq = jax.nn.log_softmax(p_logits, -1), jax.nn.log_softmax(q_logits, -1)
    kl = jnp.sum(jnp.exp(lp) * (lp - lq), -1)
    return np.asarray(kl, np.float64), np.asarray(jnp.argmax(p_logits, -1) == jnp.argmax(q_logits, -1), np.float64)


def prompt_intervals(kl_end, top1_end, kl_steps, top1_steps) -> dict | None:
    """{measure: interval dict} over the prompts (`[B]` per prompt at the prompt end, `[steps, B]` over the
    generated tokens): `top1_end` as a share of independent prompts (Wilson), the KLs and the per-prompt share of
    steps whose argmax agreed by a bootstrap over prompts (`infer.stats.prompt_intervals`); None with one
    prompt, and no step
    measures without steps."""
    per_prompt = {"kl_end": kl_end, "top1_end": top1_end}
    if len(kl_steps):
        per_prompt |= {"kl_steps": np.mean(kl_steps, axis=0), "top1_steps": np.mean(top1_steps, axis=0)}
    return stats.prompt_intervals(per_prompt, shares=("top1_end",), digits=8)  # KLs of 1e-6 need the digits


def _timed_prefills(cfg, params, prompts, policies: dict, reps: int):
    """Each policy's prefill of `prompts [B, N]` on a fresh state: its (logits, state, work) and its `reps` warm
    wall times, interleaved (round i runs the policies in order, reversed when i is odd; the first run of each
    compiles and is not timed)."""
    b, n = prompts.shape
    cap = _capacity(cfg, n + 64)
    tokens = jnp.asarray(prompts)

    def run(policy):
        state = init_state(cfg, b, cap, "fp4")
        jax.block_until_ready(state)
        t0 = time.perf_counter()
        out = model.prefill(cfg, params, state, tokens, replay=policy)
        jax.block_until_ready(out)
        return out, time.perf_counter() - t0

    results = {name: run(p)[0] for name, p in policies.items()}
    times = {name: [] for name in policies}
    for i in range(reps):
        for name in (list(policies) if i % 2 == 0 else list(policies)[::-1]):
            times[name].append(run(policies[name])[1])
    return results, times


def sweep_windows(cfg: ModelConfig, split_layer: int | None = None, *, most: int = 20) -> list[int]:
    """The replay windows R worth sweeping, ascending: W/4 and W/2, then every `k·(W − 1) + 1` for k = 1 … D (the
    window from which the last position's receptive field is whole through k of the D tail layers, so the k-th
    point is where the k-th layer from the top stops being cut; the last is `csa2.replay.exact_window`, from
    which the last position is exact), then `most · W`. Between two of these points only a layer's far edge moves.
    """
    w, bound = cfg.sliding_window, exact_window(cfg, split_layer)  # exact_window refuses a bad split by name
    d = cfg.num_hidden_layers - ReplayPolicy(window=1, split_layer=split_layer).split(cfg)
    return sorted({max(w // 4, 1), max(w // 2, 1), *(k * (w - 1) + 1 for k in range(1, d)), bound, most * w})


def sweep(cfg: ModelConfig, params, prompts: np.ndarray, windows, splits, *, steps: int = 8,
          reps: int = 3) -> list[dict]:
    """`replay_error` for every (R, split layer) pair, one exact run shared: rows of the error-vs-R table
    (`split=None`: the first decoder layer). `reps=0` measures the error and the work only (no `wall_ratio`)."""
    policies = {"exact": EXACT}
    for split in splits:
        for window in windows:
            policies[(window, split)] = ReplayPolicy(window=window, split_layer=split)
    results, times = _timed_prefills(cfg, params, prompts, policies, reps)
    wall = {name: statistics.median(t) for name, t in times.items() if t}
    (le, se, we) = results["exact"]
    rows = []
    for key, policy in policies.items():
        if key == "exact":
            continue
        lb, sb, wb = results[key]
        rows.append({"window": policy.window, "split": policy.split(cfg),
                     **_compare(cfg, params, (le, se), (lb, sb), steps),
                     "work_ratio": int(wb["work"]) / int(we["work"])}
                    | ({"wall_ratio": wall[key] / wall["exact"]} if reps else {}))
    return rows


def layer_savings(cfg: ModelConfig, params, prompts: np.ndarray, window: int, *, reps: int = 5,
                  first: int | None = None) -> dict:
    """Where bounded replay saves wall time, layer by layer: the prefill of `prompts [B, N]` with replay window
    `window` split at each tail layer s from `first` on (default: the first decoder layer; layers before s run
    every row, s and later the tail), and exact. Moving the split from s to s + 1 puts layer s back on every row,
    so the time it adds is what replay saves on layer s (exact counts as the split after the last layer).
    {"layers": [{"layer": s, "saved_s": mean of the paired per-round differences with its bootstrap interval
    (n = reps)}], "exact_s", "replay_s": median wall times (split at `first`), "saved_s": the exact − `first`
    interval, the sum of the layers' means}."""
    policy = ReplayPolicy(window=window, split_layer=first)
    policy.check(cfg)  # a first split outside the decoder is refused by name
    first = policy.split(cfg)
    splits = list(range(first, cfg.num_hidden_layers))
    policies = {s: ReplayPolicy(window=window, split_layer=s) for s in splits} | {"exact": EXACT}
    _, times = _timed_prefills(cfg, params, prompts, policies, reps)
    t = [np.asarray(times[s]) for s in splits] + [np.asarray(times["exact"])]
    return {"layers": [{"layer": s, "saved_s": stats.mean_interval(t[i + 1] - t[i]).as_dict(digits=6)}
                       for i, s in enumerate(splits)],
            "exact_s": statistics.median(times["exact"]), "replay_s": statistics.median(times[first]),
            "saved_s": stats.mean_interval(t[-1] - t[0]).as_dict(digits=6)}


def _compare(cfg, params, exact, bounded, steps: int) -> dict:
    """The error measures of `bounded` against `exact`, each a (last logits [B, V], state) pair."""
    (le, se), (lb, sb) = exact, bounded
    kl_end, top1_end = _kl_top1(le, lb)  # [B] each
    se, sb = model.fork(se, jnp.arange(se.batch)), model.fork(sb, jnp.arange(sb.batch))  # keep the inputs intact
    kls, top1s, tok = [], [], jnp.argmax(le, -1).astype(jnp.int32)
    for _ in range(steps):
        le, se = model.decode_step(cfg, params, se, tok)
        lb, sb = model.decode_step(cfg, params, sb, tok)
        kl, top1 = _kl_top1(le, lb)
        kls.append(kl)
        top1s.append(top1)
        tok = jnp.argmax(le, -1).astype(jnp.int32)
    return {"kl_end": float(np.mean(kl_end)), "top1_end": float(np.mean(top1_end)),
            "kl_steps": [float(np.mean(k)) for k in kls], "top1_steps": [float(np.mean(t)) for t in top1s],
            "intervals": prompt_intervals(kl_end, top1_end, kls, top1s)}


def prefix_hits(cfg: ModelConfig, params, prompts: np.ndarray, hits, policy: ReplayPolicy, *, chunk: int = 256,
                steps: int = 8) -> list[dict]:
    """Prefix-hit scenarios (SPEC §11) against the cold exact prefill of the whole prompts `[B, N]`: for each hit
    size P, the prefix is prefilled and stored first, then the prompt is served from the store with its snapshot
    (both short-extend modes) and without it (encoder replay). Rows: hit, scenario, the error measures, the
    token×layer work of serving the prompt and its wall time."""
    b, n = prompts.shape
    cap = _capacity(cfg, n + steps)
    logits, state, _ = model.prefill(cfg, params, init_state(cfg, b, cap, "fp4"), jnp.asarray(prompts), replay=EXACT)
    reference = (logits, state)
    scenarios = [(0, "cold", True, policy.short_extend)]
    for hit in hits:
        scenarios += [(hit, "snapshot, truncate", True, "truncate"), (hit, "snapshot, borrow", True, "borrow"),
                      (hit, "encoder replay", False, policy.short_extend)]
    rows = []
    for hit, scenario, snapshot, mode in scenarios:
        replay = ReplayPolicy(window=policy.window, split_layer=policy.split_layer, short_extend=mode)
        logits, state, work, wall = _serve(cfg, params, prompts, hit, replay, cap, chunk, snapshot)
        rows.append({"hit": hit, "scenario": scenario, **_compare(cfg, params, reference, (logits, state), steps),
                     "work": work, "wall_s": wall})
    return rows


def _serve(cfg, params, prompts, hit: int, replay, cap: int, chunk: int, snapshot: bool):
    """Serve `prompts` from a store holding their first `hit` tokens (0: an empty store): the last logits, the
    state, the token×layer work and the warm wall time of serving them."""
    def store():
        s = prefix_cache.PrefixCache(cfg, records=2 * len(prompts), snapshots=2 * len(prompts) if snapshot else 0,
                                     block=max(hit, 1))
        if hit:
            prefix_cache.prefill(cfg, params, s, list(prompts[:, :hit]), capacity=cap, replay=replay, chunk=chunk)
        return s

    def serve(s):
        return prefix_cache.prefill(cfg, params, s, list(prompts), capacity=cap, replay=replay, chunk=chunk)

    serve(store())  # compile the suffix's shapes: the timed call below is warm
    s = store()
    t0 = time.perf_counter()
    logits, state, info = serve(s)
    jax.block_until_ready(logits)
    return logits, state, info["work"], time.perf_counter() - t0


MEASURES = ("kl_end", "top1_end", "kl_steps", "top1_steps")


def format_table(rows: list[dict]) -> str:
    """`sweep` or `prefix_hits` rows as text, one line each: every error measure as `value [lo, hi]` (a KL in
    nats, top-1 as a share; the plain mean where a row has no interval), then the cost columns the rows hold, and
    a last line stating n."""
    key = ("hit", "scenario") if "scenario" in rows[0] else ("split", "window")
    costs = [c for c in ("work_ratio", "wall_ratio", "work", "wall_s") if c in rows[0]]
    width = {m: 28 if m.startswith("kl") else 19 for m in MEASURES}

    def cell(r, m):
        form = ".1e" if m.startswith("kl") else ".2f"
        iv = (r["intervals"] or {}).get(m)
        text = f"{np.mean(r[m]):{form}}" if iv is None else stats.interval_text(iv, form)
        return f" {text:>{width[m] - 1}}"

    lines = [f"{key[0]:>5} {key[1]:<19}" + "".join(f"{m:>{width[m]}}" for m in MEASURES)
             + "".join(f"{c:>11}" for c in costs)]
    lines += [f"{r[key[0]]:>5} {r[key[1]]!s:<19}" + "".join(cell(r, m) for m in MEASURES)
              + "".join(f"{r[c]:>11.4g}" for c in costs) for r in rows]
    n = sorted({iv["n"] for r in rows for iv in (r["intervals"] or {}).values()})
    if n:
        lines.append(f"intervals: 95 % over prompts, n = {', '.join(map(str, n))}")
    return "\n".join(lines)
