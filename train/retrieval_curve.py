"""Pass-key retrieval over a long-context run's saved steps: when does retrieval emerge?

    python -m train.retrieval_curve RUN [--lengths 256 512] [--samples 4] [--follow] [--poll 60]

RUN is a directory that `python -m train --recipe longctx` or `train.longctx.fit` writes (its `recipe.json` and
checkpoints). Each saved step not yet scored is restored and its pass keys read at `--lengths` tokens, at every
depth of the recipe, `--samples` keys per depth, as the recipe scores them (`train.longctx.passkey_figures`:
teacher-forced, SPEC §8 numerics, a 95 % Wilson interval on each share). One JSON line per step is appended to
`RUN/retrieval.jsonl` and printed; a step already there is not scored again. A run keeps only its newest
checkpoints, so `--follow` scores each new one while the run trains, polling every `--poll` seconds, and stops
after the run's last step. It reads the checkpoints and never takes the run's lock.

Exit status: 0; 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import time
from typing import Callable

from csa2.checkpoints import native
from train import longctx

CURVE = "retrieval.jsonl"


def scored_steps(run: pathlib.Path) -> set[int]:
    """The steps `RUN/retrieval.jsonl` already holds."""
    path = run / CURVE
    if not path.exists():
        return set()
    return {json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()}


def score(run: pathlib.Path, step: int, lengths: tuple[int, ...], samples: int) -> dict:
    """The pass-key figures of saved step `step` of `run` at `lengths` tokens, `samples` keys per depth."""
    recipe = dataclasses.replace(longctx.read_recipe(run), eval_lengths=tuple(lengths), eval_samples=samples)
    cfg, params = native.restore_params(run, step=step)
    return {"step": step, "samples": samples, "depths": list(recipe.eval_depths),
            "passkey": longctx.passkey_figures(cfg, params, recipe)}


def update(run: pathlib.Path, lengths: tuple[int, ...], samples: int, log: Callable[[str], None] = print) -> list[dict]:
    """Score every saved step of `run` that `RUN/retrieval.jsonl` lacks, append each line; returns the new lines."""
    done, new = scored_steps(run), []
    for step in native.saved_steps(run):
        if step in done:
            continue
        row = score(run, step, lengths, samples)
        with (run / CURVE).open("a") as f:
            f.write(json.dumps(row) + "\n")
        log(json.dumps(row))
        new.append(row)
    return new


def follow(run: pathlib.Path, lengths: tuple[int, ...], samples: int, poll_s: float,
           log: Callable[[str], None] = print, sleep: Callable[[float], None] = time.sleep) -> None:
    """`update` until the run's last step (`recipe.steps`) is scored, waiting `poll_s` seconds between looks."""
    last = longctx.read_recipe(run).steps
    while True:
        update(run, lengths, samples, log)
        if last in scored_steps(run):
            return
        sleep(poll_s)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m train.retrieval_curve", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=pathlib.Path, help="a long-context run directory (recipe.json and checkpoints)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 512], help="prompt lengths in tokens")
    ap.add_argument("--samples", type=int, default=4, help="keys per length and depth")
    ap.add_argument("--follow", action="store_true", help="keep scoring new checkpoints until the run's last step")
    ap.add_argument("--poll", type=float, default=60.0, help="seconds between looks with --follow")
    args = ap.parse_args(argv)
    bad = [f"--{flag} {value}: {fix}" for flag, value, wrong, fix in (
        ("lengths", args.lengths, min(args.lengths) < 1, "give prompt lengths ≥ 1 token"),
        ("samples", args.samples, args.samples < 1, "read at least 1 key per length and depth"),
        ("poll", args.poll, not args.poll > 0, "wait a positive number of seconds")) if wrong]
    if bad:
        print(f"error: {bad[0]}", file=sys.stderr)
        return 2
    try:
        longctx.read_recipe(args.run)
        if args.follow:
            follow(args.run, tuple(args.lengths), args.samples, args.poll)
        else:
            update(args.run, tuple(args.lengths), args.samples)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
