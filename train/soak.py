"""`python -m train.soak`: a training run killed with SIGKILL at a random moment and resumed ends bit for bit where an
uninterrupted run ends.

    python -m train.soak [--preset mini] [--steps 2000] [--save-every 100] [--batch-size 2] [--seq-len 64]
                         [--seed 0] [--kill-seed 0] [--out DIR]

Three `python -m train` processes with the same flags (and `--save-every`; their output in `OUT/*.log`): an
uninterrupted reference into `OUT/reference`; a run into `OUT/killed` that gets SIGKILL at a random moment after its
second checkpoint (the delay drawn from `--kill-seed`, up to the time the rest of the run should take); then `--resume`
of that run, which continues from its latest complete checkpoint. The two final checkpoints are compared leaf by leaf
(parameters, optimizer state, RNG, data position), and so are the losses of every step (metrics.jsonl is written with
each checkpoint, so the killed run keeps the records its resume starts from). Prints one JSON summary; exit status 1
unless everything is identical.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import signal
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np

from csa2 import compile_cache
from csa2.checkpoints import native as checkpoint


def _wait_for(run: pathlib.Path, step: int, proc: subprocess.Popen, timeout: float = 3600.0) -> float:
    """Seconds until `run` holds a checkpoint at `step` or later (ValueError if the process ends first)."""
    t0 = time.perf_counter()
    while (checkpoint.latest_step(run) or 0) < step:
        if proc.poll() is not None:
            raise ValueError(f"train.soak: the run into {run} ended (exit {proc.returncode}) before step {step}")
        if time.perf_counter() - t0 > timeout:
            raise ValueError(f"train.soak: no checkpoint at step {step} in {run} after {timeout:.0f} s")
        time.sleep(0.05)
    return time.perf_counter() - t0


def _final(run: pathlib.Path, argv: list[str]) -> dict:
    """The final checkpoint of a `python -m train` run of `argv`, restored into the pytrees that run trains."""
    from csa2.presets import preset
    from train.__main__ import parse, train_config
    from train.step import init_train_state

    args = parse(argv)
    cfg, tc = preset(args.preset or "tiny"), train_config(args)
    like = jax.eval_shape(lambda: init_train_state(cfg, tc))
    return checkpoint.restore(run, cfg, params_like=like.params, opt_state_like=like.opt_state)


def _same(x, y) -> bool:
    x, y = np.asarray(x), np.asarray(y)
    return x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()


def _losses(run: pathlib.Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


def soak(out: pathlib.Path, flags: list[str], *, steps: int, every: int, kill_seed: int, cache: str | None) -> dict:
    """Run the reference, the killed and the resumed run of `python -m train <flags> --steps S --save-every K` into
    `out`; compare."""
    args = [*flags, "--steps", str(steps), "--save-every", str(every), "--quiet", "--compile-cache", cache or "off"]
    if steps < 3 * every:
        raise ValueError(f"train.soak: --steps {steps} < 3 × --save-every {every}: the kill needs room after the "
                         "second checkpoint")
    reference, killed = out / "reference", out / "killed"
    out.mkdir(parents=True, exist_ok=True)

    def train(name: str, run: pathlib.Path, *extra: str) -> subprocess.Popen:
        """A `python -m train` process, its output in `out/<name>.log`."""
        with open(out / f"{name}.log", "w") as log:
            return subprocess.Popen([sys.executable, "-m", "train", *args, "--out", str(run), *extra], stdout=log,
                                    stderr=subprocess.STDOUT)

    def finish(proc: subprocess.Popen, name: str) -> None:
        if proc.wait():
            raise ValueError(f"train.soak: the {name} run failed (exit {proc.returncode}); see {out / name}.log")

    t0 = time.perf_counter()
    finish(train("reference", reference), "reference")
    reference_s = time.perf_counter() - t0
    proc = train("killed", killed)
    _wait_for(killed, every, proc)
    interval = _wait_for(killed, 2 * every, proc)  # one checkpoint interval, compile excluded
    delay = random.Random(kill_seed).uniform(0, interval * (steps - 2 * every) / every)
    time.sleep(delay)
    finished_before_kill = proc.poll() is not None
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    resumed_from = checkpoint.latest_step(killed)
    finish(train("resumed", killed, "--resume"), "resumed")
    a, b = _final(reference, args), _final(killed, args)
    leaves = {name: all(_same(x, y) for x, y in zip(jax.tree.leaves(a[name]), jax.tree.leaves(b[name]), strict=True))
              for name in ("params", "opt_state", "rng")}
    summary = {"steps": steps, "save_every": every, "kill_delay_s": round(delay, 2),
               "killed_before_finishing": not finished_before_kill, "resumed_from_step": resumed_from,
               "final_step": (a["step"], b["step"]), "data_step": (a["data_step"], b["data_step"]),
               **{f"identical_{k}": v for k, v in leaves.items()},
               "identical_losses": _losses(reference) == _losses(killed),
               "reference_s": round(reference_s, 1)}
    summary["identical"] = (all(leaves.values()) and summary["identical_losses"] and a["step"] == b["step"]
                            and a["data_step"] == b["data_step"])
    return summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m train.soak", description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="mini")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--save-every", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kill-seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="run directory (default: a new temporary one)")
    compile_cache.add_argument(ap)
    args = ap.parse_args(argv)
    cache = compile_cache.enable_cli(ap, args.compile_cache)
    out = pathlib.Path(args.out or tempfile.mkdtemp(prefix="csa2-train-soak-"))
    if out.exists() and any(out.iterdir()):
        print(f"error: --out {out} is not empty; pass a new directory", file=sys.stderr)
        return 2
    flags = ["--preset", args.preset, "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
             "--seed", str(args.seed)]
    try:
        summary = soak(out, flags, steps=args.steps, every=args.save_every, kill_seed=args.kill_seed, cache=cache)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps({"summary": summary, "out": str(out)}))
    return 0 if summary["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
