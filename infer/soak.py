"""`python -m infer.soak`: a long greedy generation that wraps every ring many times, checked at intervals against
an exact re-prefill of the same tokens, and run into its state's capacity.

    python -m infer.soak [--preset tiny] [--tokens 10000] [--check-every 1000] [--prompt-len 64] [--chunk 512]
                         [--numerics spec] [--seed 0] [--checkpoint DIR]

A prompt of `--prompt-len` random bytes is prefilled (exact, in chunks of `--chunk`) into a state whose capacity is
exactly prompt + `--tokens` (rounded up to the compress ratios); then `decode_step` feeds back its own greedy token
`--tokens` times, on the host. Every `--check-every` tokens the whole sequence so far is prefilled again, exactly,
into a fresh state, and the decode's logits are compared with the re-prefill's last logits. With `--chunk 1` the
re-prefill feeds one token per call as the decode does, and the two are bit for bit equal; with larger chunks
they reach the same position through programs of other shapes, so they agree to the rounding of the SPEC §8
numerics (`csa2.state`): FP4/FP8 elements at rounding midpoints flip and top-k selections can follow, and a longer
context holds more of them. `--numerics float` runs the float model on a float cache instead (no FP4/FP8 rounding),
where the two agree to float rounding. The greedy token must agree. Once the state is full, one more `decode_step` must
refuse with a ValueError naming the capacity, never wrap onto valid entries. Prints one JSON line per check and a
summary (ring wraps, the largest logit difference, greedy agreement, the capacity error).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from csa2 import compile_cache, model
from csa2.config import ModelConfig
from csa2.quant import NUMERICS
from csa2.replay import EXACT, Extend
from csa2.state import default_cache_format, init_state, ring_slots, token_granule
from infer.pd import random_prompt
from infer.values import round_up


def prefill(cfg: ModelConfig, params, tokens: np.ndarray, capacity: int, chunk: int, numerics: str):
    """Exact prefill of `tokens` (1-D) in chunks of `chunk` columns into a fresh one-row state: (last logits, state)."""
    state, last = init_state(cfg, 1, capacity, default_cache_format(numerics)), None
    extend = Extend.cold(jnp.asarray([len(tokens)], jnp.int32))
    for start in range(0, len(tokens), chunk):
        piece = tokens[start:start + chunk]
        cols = np.zeros((1, chunk), np.int32)
        cols[0, :len(piece)] = piece
        last, state, _ = model.prefill(cfg, params, state, jnp.asarray(cols), jnp.asarray([len(piece)], jnp.int32),
                                       EXACT, extend, numerics)
    return last, state


def soak(cfg: ModelConfig, params, *, tokens: int, check_every: int, prompt_len: int, chunk: int,
         numerics: str = "spec", seed: int = 0, log=print) -> dict:
    """Generate `tokens` greedy tokens after a random prompt, checking every `check_every` against a re-prefill, then
    run one step past the state's capacity. Returns the summary (also logged as the last JSON line)."""
    for name, value in (("tokens", tokens), ("check_every", check_every), ("prompt_len", prompt_len),
                        ("chunk", chunk)):
        if value < 1:
            raise ValueError(f"soak: {name}={value} must be ≥ 1")
    capacity = round_up(prompt_len + tokens, token_granule(cfg))
    if capacity > cfg.max_position_embeddings:
        raise ValueError(f"soak: prompt_len + tokens = {prompt_len + tokens} exceeds max_position_embeddings="
                         f"{cfg.max_position_embeddings}; generate fewer tokens")
    prompt = random_prompt(cfg, prompt_len, seed)
    logits, state = prefill(cfg, params, prompt, capacity, chunk, numerics)
    checks, t0, drawn = [], time.perf_counter(), []  # drawn: [1] device arrays, read back only at a check
    for generated in range(1, capacity - prompt_len + 1):
        drawn.append(jnp.argmax(logits, -1).astype(jnp.int32))
        logits, state = model.decode_step(cfg, params, state, drawn[-1], numerics)
        if generated % check_every == 0 or prompt_len + generated == capacity:
            sequence = np.concatenate([prompt, np.asarray(jnp.concatenate(drawn))])
            again, _ = prefill(cfg, params, sequence, capacity, chunk, numerics)
            a, b = np.asarray(logits[0]), np.asarray(again[0])
            check = {"position": len(sequence), "generated": generated,
                     "ring_wraps": len(sequence) // ring_slots(cfg),
                     "max_abs_logit_diff": float(np.abs(a - b).max()),
                     "greedy_agrees": bool(a.argmax() == b.argmax()), "elapsed_s": round(time.perf_counter() - t0, 1)}
            checks.append(check)
            log(json.dumps(check))
    try:
        model.decode_step(cfg, params, state, jnp.asarray([0], jnp.int32), numerics)
        refusal = None
    except ValueError as err:
        refusal = str(err)
    summary = {"generated": len(sequence) - prompt_len, "capacity": capacity, "checks": len(checks),
               "ring_wraps": len(sequence) // ring_slots(cfg),
               "max_abs_logit_diff": max(c["max_abs_logit_diff"] for c in checks),
               "greedy_agreements": sum(c["greedy_agrees"] for c in checks), "capacity_refusal": refusal,
               "distinct_generated_tokens": len(set(sequence[prompt_len:].tolist())),
               "seconds": round(time.perf_counter() - t0, 1)}
    log(json.dumps({"summary": summary}))
    return summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m infer.soak", description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--checkpoint", default=None, help="a run directory to generate with (default: random weights)")
    ap.add_argument("--tokens", type=int, default=10_000)
    ap.add_argument("--check-every", type=int, default=1_000)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--numerics", choices=NUMERICS, default="spec",
                    help="spec: SPEC §8 FP4/FP8 cache; float: the float model on a float cache")
    ap.add_argument("--seed", type=int, default=0)
    compile_cache.add_argument(ap)
    args = ap.parse_args(argv)
    compile_cache.enable_cli(ap, args.compile_cache)
    from csa2.checkpoints import native
    from csa2.presets import preset
    try:
        if args.checkpoint:
            cfg, params = native.restore_params(args.checkpoint)
        else:
            cfg = preset(args.preset)
            params = model.init_params(cfg, jax.random.PRNGKey(args.seed))
        summary = soak(cfg, params, tokens=args.tokens, check_every=args.check_every, prompt_len=args.prompt_len,
                       chunk=args.chunk, numerics=args.numerics, seed=args.seed)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0 if summary["capacity_refusal"] and summary["greedy_agreements"] == summary["checks"] else 1


if __name__ == "__main__":
    sys.exit(main())
