"""`python -m infer.bench_model`: compile time, decode step time, donation, batched throughput and the
bounded-replay saving (SPEC §11, DESIGN §8).

    python -m infer.bench_model [--config tiny] [--contexts 2048 8192] [--decode-contexts 512 2048]
                                [--reps 3] [--decode-steps 20] [--decode-fill prefill|length]
                                [--donation-context 64512] [--donation-batch 16] [--batches 1 8 32]
                                [--batch-rounds 6] [--quick]

Prints one JSON line per measurement; every line carries the machine and the config, so a line read
alone says where it was measured. On a shared CPU absolute times are noisy, so what this script is
for is the **ratios measured side by side in the same run**: bounded (`ReplayPolicy(window=128)`)
vs exact prefill wall time, interleaved rep by rep, next to the token×layer work ratio that
`prefill` reports in its aux output (rows entering each layer: `(21·N + 19·T) / (40·N)` for the released
split, whose layer 20 compresses every row; SPEC §11's idealised count is `(20·N + 20·T) / (40·N)`).

Measurements (cache format fp4):
- `compile`: lower and compile seconds of `decode_step` (per state capacity) and `prefill`
  (per prompt length and replay policy), via `.lower(...).compile()`;
- `decode`: median steady-state `decode_step` seconds at each decode context (batch 1), the contexts
  interleaved step by step, and their ratio;
- `donation`: a host-driven decode loop at `--donation-context` tokens × `--donation-batch` rows
  with the state donated (as `decode_step` is) and with the undonated twin, steps interleaved: step
  times and what XLA plans for the outputs (without donation every step writes a new copy of the
  state; with it the outputs alias the inputs);
- `host_loop`: a greedy host loop (argmax fed back) at `--decode-contexts[0]` tokens × 8 rows
  through `decode_step` (checked: it reads the tokens and the state's length back, so each step
  waits for the last) and `decode_step.trusted` (shapes only: steps overlap), loops alternated;
- `batch`: `infer.generate` on random weights, prompt 256 and 64 new tokens (greedy, no EOS), at
  each of `--batches`: new tokens per second after compilation and the ratio to batch 1, end to end
  and for the decode loop alone (the wall minus that of a one-token `generate`: prefill + first draw),
  every program's fastest of `--batch-rounds` interleaved rounds;
- `prefill_replay`: median bounded and exact prefill seconds at each prompt length (capacity = prompt
  length, batch 1), their ratio, and the work ratio.

Before running a prefill the compiled executable's `memory_analysis()` is checked against the
memory budget (`--mem-budget-gib`, default 24, and what the OS says is available); a context that
does not fit (or fails) is reported in a JSON line and halved until it fits (`fallback` field).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from csa2 import compile_cache, model
from csa2.presets import PRESETS, preset
from csa2.replay import EXACT, ReplayPolicy, token_layers
from csa2.state import init_state, state_bytes, token_granule
from infer import generate
from infer.values import round_up

CACHE_FORMAT = "fp4"
GIB = 1 << 30


# ---------------------------------------------------------------------------------------------
# Reporting

def machine_info() -> dict:
    """Where the numbers come from: platform, backend, CPUs, versions (repeated on every line)."""
    import jaxlib

    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        usable = os.cpu_count()
    dev = jax.devices()[0]
    return {
        "platform": platform.platform(), "machine": platform.machine(), "python": platform.python_version(),
        "backend": jax.default_backend(), "device": getattr(dev, "device_kind", str(dev)),
        "device_count": jax.device_count(), "cpu_count": os.cpu_count(), "cpus_usable": usable,
        "jax": jax.__version__, "jaxlib": jaxlib.__version__,
        "compilation_cache_dir": jax.config.jax_compilation_cache_dir,
    }


def config_info(name: str, cfg) -> dict:
    return {"name": name, "layers": cfg.num_hidden_layers, "first_decoder_layer": cfg.first_decoder_layer,
            "hidden_size": cfg.hidden_size, "dtype": cfg.dtype, "kernel_impl": cfg.kernel_impl,
            "cache_format": CACHE_FORMAT, "batch": 1}


class Reporter:
    """Prints one JSON line per measurement with the machine, the config and the load at that moment."""

    def __init__(self, machine: dict, config: dict):
        self.machine, self.config = machine, config

    def emit(self, bench: str, **fields) -> None:
        line = {"bench": bench, **fields, "loadavg_1m": _loadavg(), "peak_rss_gib": _peak_rss_gib(),
                "config": self.config, "machine": self.machine}
        print(json.dumps(line), flush=True)


def _loadavg() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def _peak_rss_gib() -> float:
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return round(kib / (1 << 20), 3)


def _proc_gib(path: str, field: str) -> float | None:
    """A `field: N kB` line of a /proc file, in GiB (None off Linux)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / (1 << 20)
    except OSError:
        pass
    return None


def _rss_gib() -> float:
    """Current resident memory of this process (falls back to the peak off Linux)."""
    rss = _proc_gib("/proc/self/status", "VmRSS")
    return _peak_rss_gib() if rss is None else rss


def _available_gib() -> float | None:
    return _proc_gib("/proc/meminfo", "MemAvailable")


def _log(msg: str) -> None:
    print(f"[bench_model] {msg}", file=sys.stderr, flush=True)


def _r(x: float, digits: int = 4) -> float:
    return round(float(x), digits)


# ---------------------------------------------------------------------------------------------
# Helpers

def _tokens(cfg, n: int, seed: int) -> jax.Array:
    """`[1, n]` random byte-level token ids inside the vocabulary."""
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.integers(0, min(cfg.vocab_size, 256), size=(1, n)), jnp.int32)


def _compile(fn, *args):
    """(compiled, lower seconds, compile seconds) of a jitted function; static args passed positionally."""
    t0 = time.perf_counter()
    lowered = fn.lower(*args)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    return compiled, t1 - t0, t2 - t1


def _memory(compiled) -> dict | None:
    """Bytes XLA plans for the executable (arguments, outputs, temporaries), when the backend says."""
    try:
        ma = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - not every backend implements it
        return None
    if ma is None:
        return None
    return {"argument_gib": _r(ma.argument_size_in_bytes / GIB), "output_gib": _r(ma.output_size_in_bytes / GIB),
            "temp_gib": _r(ma.temp_size_in_bytes / GIB), "aliased_gib": _r(ma.alias_size_in_bytes / GIB)}


def _timed(fn, *args) -> tuple[float, tuple]:
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    return time.perf_counter() - t0, out


def _policy_name(replay: ReplayPolicy) -> str:
    return "exact" if replay.window is None else f"bounded_R{replay.window}"


# ---------------------------------------------------------------------------------------------
# Decode: compile time and steady-state step time

def bench_decode(rep: Reporter, cfg, params, contexts: list[int], steps: int, warmup: int, fill: str,
                 seed: int) -> None:
    """Steady-state `decode_step` at each context (tokens already in the state), contexts interleaved."""
    runs = []
    for ctx in contexts:
        cap = round_up(ctx + warmup + steps, max(64, token_granule(cfg)))
        state = init_state(cfg, 1, cap, CACHE_FORMAT)
        if fill == "prefill":
            # A real prompt of `ctx` tokens through the default (bounded) replay prefill.
            prefill_c, lower_s, compile_s = _compile(model.prefill, cfg, params, state, _tokens(cfg, ctx, seed),
                                                     jnp.full((1,), ctx, jnp.int32), ReplayPolicy())
            rep.emit("compile", fn="prefill", context=ctx, capacity=cap, replay=_policy_name(ReplayPolicy()),
                     lower_s=_r(lower_s, 3), compile_s=_r(compile_s, 3), purpose="fill decode state",
                     memory=_memory(prefill_c))
            _, state, _ = prefill_c(params, state, _tokens(cfg, ctx, seed), jnp.full((1,), ctx, jnp.int32))
        else:
            # Same shapes and the same compute (reads are masked by `length`); the cache holds zeros.
            state = state.replace(length=jnp.full((1,), ctx, jnp.int32))
        jax.block_until_ready(state)
        tok = jnp.full((1,), 65, jnp.int32)
        step, lower_s, compile_s = _compile(model.decode_step, cfg, params, state, tok)
        rep.emit("compile", fn="decode_step", context=ctx, capacity=cap, lower_s=_r(lower_s, 3),
                 compile_s=_r(compile_s, 3), total_s=_r(lower_s + compile_s, 3), memory=_memory(step),
                 state_gib=_r(state_bytes(state)["total"] / GIB, 5))
        first_s, (logits, state) = _timed(step, params, state, tok)
        runs.append({"ctx": ctx, "cap": cap, "step": step, "state": state, "tok": tok, "first_s": first_s,
                     "times": []})
        _log(f"decode ctx {ctx}: compiled in {lower_s + compile_s:.1f} s")

    for _ in range(warmup - 1):
        for r in runs:
            _, (_, r["state"]) = _timed(r["step"], params, r["state"], r["tok"])
    for _ in range(steps):  # interleaved: both contexts see the same machine load
        for r in runs:
            dt, (_, r["state"]) = _timed(r["step"], params, r["state"], r["tok"])
            r["times"].append(dt)

    base = statistics.median(runs[0]["times"])
    for r in runs:
        med = statistics.median(r["times"])
        rep.emit("decode", context=r["ctx"], capacity=r["cap"], fill=fill, steps=steps, warmup=warmup,
                 median_step_s=_r(med, 6), min_step_s=_r(min(r["times"]), 6), max_step_s=_r(max(r["times"]), 6),
                 first_call_s=_r(r["first_s"], 4), tokens_per_s=_r(1.0 / med, 2),
                 ratio_to_first_context=_r(med / base), first_context=runs[0]["ctx"],
                 final_length=int(r["state"].length[0]))


# ---------------------------------------------------------------------------------------------
# Donation: a host-driven decode loop with and without donating the state

def bench_donation(rep: Reporter, cfg, params, context: int, batch: int, steps: int) -> None:
    """`decode_step` (state donated) and its undonated twin on equal states of `batch` rows at `context`
    tokens, steps interleaved. Without donation each step allocates and writes a new copy of the whole
    state; with it the outputs alias the inputs (`aliased_gib`)."""
    cap = round_up(context + steps + 2, max(64, token_granule(cfg)))
    tok = jnp.full((batch,), 65, jnp.int32)
    runs = {}
    for key, fn in (("donated", model.decode_step), ("undonated", model.decode_step.without_donation())):
        state = init_state(cfg, batch, cap, CACHE_FORMAT).replace(length=jnp.full((batch,), context, jnp.int32))
        compiled = fn.lower(cfg, params, state, tok).compile()
        _, state = compiled(params, state, tok)  # warm-up
        runs[key] = {"step": compiled, "state": state, "times": [], "memory": _memory(compiled)}
    for _ in range(steps):
        for r in runs.values():
            dt, (_, r["state"]) = _timed(r["step"], params, r["state"], tok)
            r["times"].append(dt)
    med = {k: statistics.median(r["times"]) for k, r in runs.items()}
    rep.emit("donation", context=context, capacity=cap, batch=batch, steps=steps,
             state_gib=_r(state_bytes(runs["donated"]["state"])["total"] / GIB, 5),
             median_step_s={k: _r(v, 6) for k, v in med.items()},
             undonated_over_donated=_r(med["undonated"] / med["donated"]),
             memory={k: r["memory"] for k, r in runs.items()})


# ---------------------------------------------------------------------------------------------
# Host loop: checked calls (each reads the state's length and the tokens back) vs `trusted`

def bench_host_loop(rep: Reporter, cfg, params, context: int, batch: int, steps: int, rounds: int = 3) -> None:
    """A host-driven greedy loop (argmax fed back) through `decode_step` and through `decode_step.trusted`,
    whole loops alternated `rounds` times: the checked call waits for the previous step to read its
    values; the trusted one only checks shapes, so the next step is dispatched while this one runs."""
    cap = round_up(context + rounds * (steps + 3) + 2, max(64, token_granule(cfg)))

    def loop(call) -> float:
        state = init_state(cfg, batch, cap, CACHE_FORMAT).replace(length=jnp.full((batch,), context, jnp.int32))
        tok = jnp.full((batch,), 65, jnp.int32)
        for i in range(steps + 3):  # 3 untimed steps first
            if i == 3:
                jax.block_until_ready(tok)
                t0 = time.perf_counter()
            logits, state = call(cfg, params, state, tok)
            tok = jnp.argmax(logits, -1).astype(jnp.int32)
        jax.block_until_ready(tok)
        return (time.perf_counter() - t0) / steps

    times = {"checked": [], "trusted": []}
    for _ in range(rounds):
        times["checked"].append(loop(model.decode_step))
        times["trusted"].append(loop(model.decode_step.trusted))
    med = {k: statistics.median(v) for k, v in times.items()}
    rep.emit("host_loop", context=context, batch=batch, steps=steps, rounds=rounds,
             median_step_s={k: _r(v, 6) for k, v in med.items()},
             checked_over_trusted=_r(med["checked"] / med["trusted"]))


# ---------------------------------------------------------------------------------------------
# Batched generation throughput

def bench_batch(rep: Reporter, cfg, params, batches: list[int], prompt_len: int, new_tokens: int, seed: int,
                rounds: int) -> None:
    """`generate` at each batch size on the same kind of input: tokens/s after compilation and its ratio
    to the first batch, end to end and for the decode loop alone (the wall minus that of a one-token
    `generate`, which is the prefill and the first draw).

    Every program is compiled and run once first; then `rounds` rounds run each program once, in turn, and
    each program's time is its fastest round. Interleaving puts every batch size under the same machine
    conditions (a shared CPU drifts by tens of percent within minutes), so the ratios compare like with like."""
    rng = np.random.default_rng(seed)
    programs = {}
    for b in batches:
        prompts = rng.integers(0, min(cfg.vocab_size, 256), size=(b, prompt_len)).astype(np.int32)
        for n in (new_tokens, 1):
            plan = generate.plan(cfg, prompts, max_new_tokens=n, eos_id=None, seed=seed)
            t0 = time.perf_counter()
            compiled = generate.lower(cfg, params, plan).compile()
            compile_s = time.perf_counter() - t0
            generate.run(cfg, params, plan, compiled)  # warm-up
            programs[b, n] = (plan, compiled, compile_s)
    times = {key: [] for key in programs}
    for _ in range(rounds):
        for key, (plan, compiled, _) in programs.items():
            times[key].append(_timed(lambda: generate.run(cfg, params, plan, compiled).tokens)[0])
    rates, decode_rates = {}, {}
    for b in batches:
        total, prefill = min(times[b, new_tokens]), min(times[b, 1])
        rates[b] = b * new_tokens / total
        decode_rates[b] = b * (new_tokens - 1) / max(total - prefill, 1e-9)
        rep.emit("batch", batch=b, prompt=prompt_len, new_tokens=new_tokens, rounds=rounds,
                 compile_s=_r(programs[b, new_tokens][2], 2), wall_s=_r(total),
                 wall_median_s=_r(float(np.median(times[b, new_tokens]))), prefill_s=_r(prefill),
                 tokens_per_s=_r(rates[b], 1), decode_tokens_per_s=_r(decode_rates[b], 1),
                 ratio_to_batch=batches[0], ratio=_r(rates[b] / rates[batches[0]], 3),
                 decode_ratio=_r(decode_rates[b] / decode_rates[batches[0]], 3))
        _log(f"batch {b}: {rates[b]:.1f} tokens/s end to end, {decode_rates[b]:.1f} in the decode loop")


# ---------------------------------------------------------------------------------------------
# Prefill: bounded replay vs exact

def _fits(mem: dict | None, budget_gib: float) -> tuple[bool, str]:
    """Whether the executable's planned temporaries + outputs fit what is left of the budget."""
    if mem is None:
        return True, "memory_analysis unavailable; running unchecked"
    need = mem["temp_gib"] + mem["output_gib"]
    left = budget_gib - _rss_gib()
    avail = _available_gib()
    if avail is not None:
        left = min(left, avail * 0.9)
    if need > left:
        return False, (f"planned temp+output {need:.2f} GiB > {left:.2f} GiB left "
                       f"(budget {budget_gib} GiB, MemAvailable {avail and round(avail, 2)} GiB)")
    return True, f"planned temp+output {need:.2f} GiB ≤ {left:.2f} GiB left"


def bench_prefill(rep: Reporter, cfg, params, n: int, reps: int, budget_gib: float, seed: int,
                  slow_s: float, requested: int | None = None) -> bool:
    """One prompt length: compile both policies, check memory, time them interleaved. False = did not fit."""
    policies = {"bounded": ReplayPolicy(window=128), "exact": EXACT}
    state = init_state(cfg, 1, n, CACHE_FORMAT)
    tokens, n_valid = _tokens(cfg, n, seed), jnp.full((1,), n, jnp.int32)
    compiled, memory = {}, {}
    for key, replay in policies.items():
        replay.check(cfg)
        # Timed reps reuse one input state, so the prefill here keeps it (no donation).
        c, lower_s, compile_s = _compile(model.prefill.without_donation(), cfg, params, state, tokens, n_valid,
                                         replay)
        compiled[key], memory[key] = c, _memory(c)
        rep.emit("compile", fn="prefill", context=n, capacity=n, replay=_policy_name(replay), lower_s=_r(lower_s, 3),
                 compile_s=_r(compile_s, 3), total_s=_r(lower_s + compile_s, 3), memory=memory[key])
        _log(f"prefill {n} {key}: compiled in {lower_s + compile_s:.1f} s, memory {memory[key]}")
    for key in policies:
        ok, why = _fits(memory[key], budget_gib)
        if not ok:
            rep.emit("prefill_replay", context=n, context_requested=requested or n, status="skipped: does not fit",
                     policy=key, reason=why)
            return False
    fit_note = {k: _fits(memory[k], budget_gib)[1] for k in policies}

    # Warm-up (first execution) of each, which also gives the work counts.
    first, work = {}, {}
    try:
        for key in policies:
            first[key], (_, _, aux) = _timed(compiled[key], params, state, tokens, n_valid)
            work[key] = int(aux["work"])
    except Exception as e:  # noqa: BLE001 - e.g. RESOURCE_EXHAUSTED: report and let the caller fall back
        rep.emit("prefill_replay", context=n, context_requested=requested or n, status="failed",
                 error=f"{type(e).__name__}: {str(e)[:400]}")
        return False
    reps_used = reps if sum(first.values()) < slow_s else max(1, min(reps, 2))
    _log(f"prefill {n}: warm-up bounded {first['bounded']:.2f} s, exact {first['exact']:.2f} s; {reps_used} reps")

    times = {k: [] for k in policies}
    for i in range(reps_used):  # interleaved, alternating which goes first
        order = list(policies) if i % 2 == 0 else list(policies)[::-1]
        for key in order:
            dt, _ = _timed(compiled[key], params, state, tokens, n_valid)
            times[key].append(dt)
    med = {k: statistics.median(v) for k, v in times.items()}
    pair_ratios = [b / e for b, e in zip(times["bounded"], times["exact"])]
    expected = token_layers(cfg, ReplayPolicy(window=128), n) / token_layers(cfg, EXACT, n)
    rep.emit(
        "prefill_replay", context=n, context_requested=requested or n,
        status="ok" if requested in (None, n) else "fallback",
        fallback=None if requested in (None, n) else f"{requested} did not fit or failed; measured {n}",
        window=128, reps=reps_used,
        wall_s_bounded=_r(med["bounded"]), wall_s_exact=_r(med["exact"]),
        wall_ratio=_r(med["bounded"] / med["exact"]), wall_ratio_pairs_median=_r(statistics.median(pair_ratios)),
        wall_ratio_pairs=[_r(x) for x in pair_ratios],
        work_bounded=work["bounded"], work_exact=work["exact"], work_ratio=_r(work["bounded"] / work["exact"]),
        work_ratio_expected=_r(expected),
        wall_over_work=_r((med["bounded"] / med["exact"]) / (work["bounded"] / work["exact"])),
        first_call_s={k: _r(v) for k, v in first.items()},
        samples_s={k: [_r(x) for x in v] for k, v in times.items()},
        memory_check=fit_note,
    )
    return True


# ---------------------------------------------------------------------------------------------
# CLI

def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m infer.bench_model", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="tiny", choices=PRESETS, help="preset (v41_flash will not fit on a CPU)")
    ap.add_argument("--contexts", type=int, nargs="+", default=None,
                    help="prefill prompt lengths, bounded vs exact (default 2048 8192; --quick: 256 1024)")
    ap.add_argument("--decode-contexts", type=int, nargs="+", default=None,
                    help="tokens already in the state for the decode timing (default 512 2048; --quick: 128 512)")
    ap.add_argument("--reps", type=int, default=3,
                    help="timed prefill reps per policy (cut to 2 when a warm-up pair takes > --slow-s)")
    ap.add_argument("--slow-s", type=float, default=60.0, help="warm-up pair seconds above which reps ≤ 2")
    ap.add_argument("--decode-steps", type=int, default=None, help="timed decode steps (default 20; --quick: 10)")
    ap.add_argument("--decode-warmup", type=int, default=3, help="untimed decode steps first (≥ 1)")
    ap.add_argument("--decode-fill", choices=("prefill", "length"), default="prefill",
                    help="fill the decode state by a real bounded prefill, or only set its length (no extra compile)")
    ap.add_argument("--mem-budget-gib", type=float, default=24.0, help="RAM budget for one prefill")
    ap.add_argument("--donation-context", type=int, default=None,
                    help="tokens in the state for the donation comparison "
                         "(default max_position_embeddings − 1024; --quick: 16384)")
    ap.add_argument("--donation-batch", type=int, default=None,
                    help="rows in the state for the donation comparison (default 16; --quick: 1)")
    ap.add_argument("--batches", type=int, nargs="+", default=None,
                    help="generate batch sizes (default 1 8 32; --quick: 1 8)")
    ap.add_argument("--batch-rounds", type=int, default=None,
                    help="interleaved timed rounds of every generate program, each program's fastest counting "
                         "(default 6; --quick: 2)")
    ap.add_argument("--skip", choices=("decode", "donation", "host_loop", "batch", "prefill"), action="append",
                    default=[],
                    help="skip a part")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="small sizes: a smoke test of the script")
    compile_cache.add_argument(ap, fallback=False)
    return ap


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    compile_cache.enable_cli(parser, args.compile_cache, fallback=False)
    contexts = args.contexts or ([256, 1024] if args.quick else [2048, 8192])
    decode_contexts = args.decode_contexts or ([128, 512] if args.quick else [512, 2048])
    steps = args.decode_steps or (10 if args.quick else 20)
    rounds = args.batch_rounds if args.batch_rounds is not None else (2 if args.quick else 6)
    if args.reps < 1 or steps < 1 or args.decode_warmup < 1 or rounds < 1:
        print("error: --reps, --decode-steps, --decode-warmup and --batch-rounds must be ≥ 1", file=sys.stderr)
        return 2
    t_run = time.perf_counter()
    cfg = preset(args.config)
    granule = token_granule(cfg)
    bad = [c for c in contexts + decode_contexts if c < 1 or c % granule]
    if bad:
        print(f"error: contexts {bad} must be positive multiples of {granule} (the compress ratios)", file=sys.stderr)
        return 2
    rep = Reporter(machine_info(), config_info(args.config, cfg))

    t0 = time.perf_counter()
    params = jax.block_until_ready(model.init_params(cfg, jax.random.PRNGKey(args.seed)))
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(params))
    rep.emit("setup", init_params_s=_r(time.perf_counter() - t0, 3), params=int(n_params),
             contexts=contexts, decode_contexts=decode_contexts, quick=args.quick)

    if "decode" not in args.skip:
        bench_decode(rep, cfg, params, decode_contexts, steps, args.decode_warmup, args.decode_fill, args.seed)
    if "donation" not in args.skip:
        context = args.donation_context or (16384 if args.quick else cfg.max_position_embeddings - 1024)
        bench_donation(rep, cfg, params, context, args.donation_batch or (1 if args.quick else 16), steps)
    if "host_loop" not in args.skip:
        bench_host_loop(rep, cfg, params, decode_contexts[0], 8, steps)
    if "batch" not in args.skip:
        bench_batch(rep, cfg, params, args.batches or ([1, 8] if args.quick else [1, 8, 32]), 256,
                    16 if args.quick else 64, args.seed, rounds)
    if "prefill" not in args.skip:
        for n in contexts:
            m = n
            while not bench_prefill(rep, cfg, params, m, args.reps, args.mem_budget_gib, args.seed, args.slow_s,
                                    requested=n):
                m //= 2
                if m < max(256, granule) or m % granule:
                    rep.emit("prefill_replay", context_requested=n, status="gave up: nothing ≥ 256 fits")
                    break
                _log(f"prefill {n} did not fit; falling back to {m}")
    rep.emit("run", wall_s=_r(time.perf_counter() - t_run, 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
