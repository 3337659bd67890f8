"""`python -m infer.bench_spec`: DSpark speculative vs plain decoding, side by side in one run (SPEC §12).

    python -m infer.bench_spec --checkpoint runs/demo [--drafter runs/demo/dspark] [--batches 1 8]
                               [--max-new-tokens 64] [--prompt-len 64] [--sps runs/demo/sps.json]
    python -m infer.bench_spec --checkpoint runs/demo --measure-sps [--sps runs/demo/sps.json]

Prompts are `--prompt-len`-token windows of the corpus's validation documents (`pydoc_data.topics`, every
tenth document, as `train.data` splits it; the first ones are the documents' beginnings), greedy.

- `--measure-sps` fills the `SpsTable` the confidence schedule reads: for each batch size and each
  verify width w of `--sps-widths` (each one a branch the scheduled loop compiles), the steady rate of
  one speculative step (draft, verify at width w, commit) on a prefilled state, in steps per second,
  saved as JSON (`--sps`).
- Otherwise, per batch size: plain greedy `generate`, speculative decoding with fixed γ, and (when
  the table exists) scheduled verify lengths, each timed warm (its second call: the first compiles),
  interleaved `--reps` times; new tokens per second, the ratio to plain, mean accepted drafts per
  step and the acceptance per draft position. Every method must emit the same tokens (greedy), which
  is checked. One JSON line per measurement, a table at the end.
- Then (unless `--prompts 0`) the drafter's acceptance over `--prompts` held-out prompts (default 64): the
  mean acceptance length (tokens per verify step, bonus included: SPEC §12's figure) and the acceptance of
  each draft position, each with n and a 95 % interval from resampling the prompts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from csa2 import compile_cache, model
from csa2.checkpoints import layouts, native as checkpoint
from csa2.config import ModelConfig
from csa2.state import init_state, token_granule
from csa2.tokenizer import encode
from infer import generate, stats
from infer.bench_model import machine_info
from infer.schedule import SpsTable, config_fingerprint
from infer.speculative import speculative_generate
from infer.values import round_up

VALID_EVERY = 10  # train.data's validation split: documents 0, 10, 20, … of the sorted distinct topics


def validation_prompts(n: int, length: int) -> list[np.ndarray]:
    """`n` held-out prompts of at most `length` tokens: the validation documents of the embedded corpus cut into
    consecutive windows (`[0, length)`, `[length, 2·length)`, … of BOS + bytes), taken round-robin over the
    documents, so the first prompts are the documents' beginnings and no two prompts overlap."""
    from pydoc_data.topics import topics

    documents = [encode(text) for text in list(dict.fromkeys(topics[key] for key in sorted(topics)))[::VALID_EVERY]]
    windows = [doc[i:i + length] for i in range(0, max(len(d) for d in documents), length) for doc in documents
               if len(doc) - i >= max(1, length // 2)]  # a tail shorter than half a prompt is left out
    if n > len(windows):
        raise ValueError(f"n={n}: the validation documents give {len(windows)} prompts of {length} tokens; ask for "
                         "fewer prompts or shorter ones (--prompt-len)")
    return windows[:n]


# ---------------------------------------------------------------------------------------------
# Steps per second of one speculative step

def _steady_rate(cfg: ModelConfig, params, batch: int, context: int, steps: int, capacity: int, step) -> float:
    """Steady steps/s of `step(state, token) -> (state, token)`, `steps` steps in one jitted loop on a state of
    `capacity` prefilled with `context` random tokens per row (compile and prefill excluded)."""
    prompt = jax.random.randint(jax.random.PRNGKey(0), (batch, context), 0, 256, jnp.int32)

    @jax.jit
    def loop(state, token):
        return jax.lax.fori_loop(0, steps, lambda _, carry: step(*carry), (state, token))

    def fresh():
        logits, state, _ = model.prefill(cfg, params, init_state(cfg, batch, capacity), prompt)
        return state, jnp.argmax(logits, -1).astype(jnp.int32)

    jax.block_until_ready(loop(*fresh()))  # compile
    state, token = jax.block_until_ready(fresh())
    t0 = time.perf_counter()
    jax.block_until_ready(loop(state, token))
    return steps / (time.perf_counter() - t0)


def step_rate(cfg: ModelConfig, params, batch: int, width: int, context: int, steps: int) -> float:
    """Steady steps/s of draft → verify at `width` → commit one row (`_steady_rate`)."""
    ones = jnp.ones((batch,), jnp.int32)

    def step(state, anchor):
        prop = model.draft(cfg, params, state, anchor, jax.random.PRNGKey(0))
        block = jnp.concatenate([anchor[:, None], prop.tokens], axis=1)[:, :width]
        logits, state = model.verify(cfg, params, state, block)
        bonus = jnp.argmax(logits[:, 0], -1).astype(jnp.int32)
        return model.commit(state, ones, bonus), bonus

    capacity = round_up(context + steps + width + 1, token_granule(cfg))
    return _steady_rate(cfg, params, batch, context, steps, capacity, step)


def decode_rate(cfg: ModelConfig, params, batch: int, context: int, steps: int) -> float:
    """Steady steps/s of one plain greedy `model.decode_step` (`_steady_rate`), on the state `step_rate` uses at
    the widest verify block (γ_max + 1 rows), so both read states of one size and share that prefill program."""

    def step(state, token):
        logits, state = model.decode_step(cfg, params, state, token)
        return state, jnp.argmax(logits, -1).astype(jnp.int32)

    widest = min(cfg.dspark_block_size, cfg.max_draft) + 1
    capacity = round_up(context + steps + widest + 1, token_granule(cfg))
    return _steady_rate(cfg, params, batch, context, steps, capacity, step)


def measure_sps(cfg: ModelConfig, params, batches: list[int], widths: tuple[int, ...], context: int, steps: int,
                log) -> SpsTable:
    """An `SpsTable` over `widths` for each batch size, measured on this machine."""
    rates = {}
    for b in batches:
        rates[b] = tuple(round(step_rate(cfg, params, b, w, context, steps), 3) for w in widths)
        log({"measure": "sps", "batch": b, "widths": list(widths), "steps_per_s": list(rates[b])})
    meta = {"config": config_fingerprint(cfg), "context": context, "steps": steps, **machine_info(),
            "date": time.strftime("%Y-%m-%d")}
    return SpsTable(widths=widths, steps_per_s=rates, meta=meta)


# ---------------------------------------------------------------------------------------------
# Speculative vs plain

def compare(cfg: ModelConfig, params, batch: int, prompt_len: int, new_tokens: int, reps: int,
            sps: SpsTable | None, log) -> list[dict]:
    """Plain, fixed-γ and (with `sps`) scheduled decoding of the same prompts, timed warm and interleaved."""
    prompts = validation_prompts(batch, prompt_len)
    methods = {"plain": lambda: generate.generate(cfg, params, prompts, max_new_tokens=new_tokens, eos_id=None),
               f"spec_fixed_gamma{cfg.dspark_block_size}":
                   lambda: speculative_generate(cfg, params, prompts, max_new_tokens=new_tokens, eos_id=None)}
    if sps is not None:
        methods["spec_scheduled"] = lambda: speculative_generate(cfg, params, prompts, max_new_tokens=new_tokens,
                                                                 eos_id=None, sps=sps)
    results = {name: run() for name, run in methods.items()}  # compile
    for name, res in results.items():
        if not np.array_equal(res.tokens, results["plain"].tokens):
            raise AssertionError(f"{name}: greedy output differs from plain generate (batch {batch})")
    times = {name: [] for name in methods}
    for _ in range(reps):
        for name, run in methods.items():
            t0 = time.perf_counter()
            res = run()
            jax.block_until_ready(res.state.length)
            times[name].append(time.perf_counter() - t0)
    rows, plain_tps = [], None
    for name, res in results.items():
        wall = statistics.median(times[name])
        tps = float(res.lengths.sum()) / wall
        plain_tps = tps if name == "plain" else plain_tps
        row = {"measure": "decode", "method": name, "batch": batch, "prompt_len": prompt_len, "new_tokens": new_tokens,
               "wall_s": round(wall, 4), "tokens_per_s": round(tps, 2), "speedup": round(tps / plain_tps, 3)}
        if name != "plain":
            row.update(steps=res.steps, mean_accept=round(res.mean_accept, 3),
                       position_acceptance=[None if np.isnan(a) else round(float(a), 3)
                                            for a in res.position_acceptance],
                       widths_used=res.widths.tolist())
        log(row)
        rows.append(row)
    return rows


def acceptance(cfg: ModelConfig, params, n_prompts: int, prompt_len: int, new_tokens: int, batch: int,
               sps: SpsTable | None = None) -> dict:
    """Greedy speculative decoding of `n_prompts` held-out prompts in batches of `batch`: the mean acceptance
    length (tokens per verify step, bonus included) and the acceptance of each draft position (accepted /
    reached), each with its 95 % interval from resampling the prompts (`infer.stats`)."""
    prompts = validation_prompts(n_prompts, prompt_len)
    committed, steps, accepts, tries = [], [], [], []
    for i in range(0, n_prompts, batch):
        chunk = prompts[i:i + batch]
        res = speculative_generate(cfg, params, chunk + chunk[-1:] * (batch - len(chunk)), max_new_tokens=new_tokens,
                                   eos_id=None, sps=sps)  # a short last batch repeats a prompt, counted once
        committed.append(res.accepted[:len(chunk)] + res.row_steps[:len(chunk)])
        steps.append(res.row_steps[:len(chunk)])
        accepts.append(res.position_accepts[:len(chunk)])
        tries.append(res.position_tries[:len(chunk)])
    # Pooled over steps, as the figure is defined (a prompt's weight is its number of verify steps).
    (tau,) = stats.ratio_interval(np.concatenate(committed)[:, None], np.concatenate(steps)[:, None])
    per_position = stats.ratio_interval(np.concatenate(accepts), np.concatenate(tries))
    return {"measure": "acceptance",
            "method": "scheduled" if sps is not None else f"fixed_gamma{cfg.dspark_block_size}",
            "prompts": n_prompts, "prompt_len": prompt_len, "new_tokens": new_tokens, "batch": batch,
            "acceptance_length": tau.as_dict(), "position_acceptance": [x.as_dict() for x in per_position]}


def load(checkpoint_dir: str, drafter_dir: str | None, dtype: str | None = None) -> tuple[ModelConfig, object]:
    """The backbone of `checkpoint_dir` with the adapted drafter of `drafter_dir` (default: `<checkpoint>/dspark`), in
    the drafter's config (its stage count may differ from the backbone's); a released-layout `checkpoint_dir`
    holds its drafter (`mtp.*`). `dtype`: the compute dtype (default: the checkpoint's)."""
    if not os.path.isdir(checkpoint_dir):
        raise ValueError(f"--checkpoint {checkpoint_dir}: no such directory; pass the --out directory of python -m "
                         "train (e.g. runs/demo after make demo) or a released-layout directory")
    if layouts.is_released(checkpoint_dir):
        if drafter_dir is not None:
            raise ValueError(f"--drafter {drafter_dir}: the released-layout checkpoint {checkpoint_dir} carries its "
                             "drafter (mtp.*); leave --drafter out")
        cfg = layouts.load_config(checkpoint_dir)
        return layouts.load(checkpoint_dir, cfg if dtype is None else cfg.replace(dtype=dtype))
    cfg, params = checkpoint.restore_with_drafter(checkpoint_dir, drafter_dir or os.path.join(checkpoint_dir, "dspark"))
    return (cfg if dtype is None else cfg.replace(dtype=dtype)), params


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m infer.bench_spec", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True,
                    help="backbone checkpoint directory (python -m train), or a released-layout directory with its "
                         "drafter (e.g. the shipped model, csa2.checkpoints.bundled())")
    ap.add_argument("--drafter", help="adapted drafter directory (python -m train.dspark); default CHECKPOINT/dspark")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"),
                    help="compute dtype (default: the checkpoint's; a released-layout config.json names none, so "
                         "bfloat16 there)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--sps", help="SpsTable JSON: read for scheduled lengths, written by --measure-sps "
                                  "(default CHECKPOINT/sps.json)")
    ap.add_argument("--measure-sps", action="store_true", help="measure the steps/s table and save it to --sps")
    ap.add_argument("--sps-widths", type=int, nargs="+", default=[2, 4, 6])
    ap.add_argument("--sps-context", type=int, default=128)
    ap.add_argument("--sps-steps", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=64,
                    help="held-out prompts for the acceptance figures with 95 %% intervals (0: skip them)")
    ap.add_argument("--acceptance-batch", type=int, default=16, help="rows per speculative call for --prompts")
    compile_cache.add_argument(ap)
    args = ap.parse_args(argv)
    try:
        compile_cache.enable(args.compile_cache)
        cfg, params = load(args.checkpoint, args.drafter, args.dtype)
        path = args.sps or os.path.join(args.checkpoint, "sps.json")

        def log(row: dict) -> None:
            print(json.dumps(row), flush=True)

        if args.measure_sps:
            measure_sps(cfg, params, args.batches, tuple(args.sps_widths), args.sps_context, args.sps_steps,
                        log).save(path)
            print(f"# saved {path}")
            return 0
        sps = SpsTable.load(path) if os.path.exists(path) else None
        if sps is None:
            print(f"# no steps/s table at {path}: scheduled lengths skipped (measure one with --measure-sps)")
        rows = [r for b in args.batches for r in compare(cfg, params, b, args.prompt_len, args.max_new_tokens,
                                                         args.reps, sps, log)]
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("\n| batch | method | tokens/s | vs plain | mean accepted | acceptance per position |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['method']} | {r['tokens_per_s']} | {r['speedup']}× | {r.get('mean_accept', '')} "
              f"| {r.get('position_acceptance', '')} |")
    if args.prompts:
        try:
            acc = acceptance(cfg, params, args.prompts, args.prompt_len, args.max_new_tokens, args.acceptance_batch)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        log(acc)
        print(f"\nacceptance length (tokens per verify step, bonus included), greedy, γ = {cfg.dspark_block_size}, "
              f"n = {acc['prompts']} held-out prompts, 95 % interval: {stats.interval_text(acc['acceptance_length'])}")
        print("acceptance per draft position (accepted / reached): "
              + ", ".join(stats.interval_text(x) for x in acc["position_acceptance"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
