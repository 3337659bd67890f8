"""`python -m infer.fuzz`: draw random cases of the state properties on `mini` and check each against its reference.

    python -m infer.fuzz [--property NAME ...] [--cases 1000] [--seed 0] [--numerics float|spec] [--rows 8]
                         [--first-batch K] [--mutants] [--json FILE]

Properties (`infer.fuzz.properties`): chunk_exact, chunk_replay, commit, fork, fork_moved, prefix_hit,
verify_scratch, generate_stops, sharded (default: all). A case is one row of a batch of `--rows` independent rows.
Prints one line per property (cases, violations, the largest difference and the tolerance, how many cases differed
at all, seconds, the first failing batch: rerun it alone with `--seed S --first-batch K --cases 1`).

`--numerics float` (default) checks the float model to float rounding (1e-5). `spec` runs the SPEC §8 numerics
(tolerance 1e-2), where a rare FP4/FP8 element flips at a rounding midpoint: a case beyond the tolerance is drawn
again under the float numerics, and counts as explained when it holds there (the difference came from the FP4/FP8
rounding alone); such flips must stay rare (at most 5 % of the cases, or one). `--mutants` plants each property's bug
(`infer.fuzz.mutants`) and checks that the property catches it within `--cases` (it stops at the first failing
batch). The command simulates 8 CPU devices (for `sharded`) when JAX has not started.

Exit status: 0 when every property held, every violation explained (with `--mutants`: every mutant caught),
1 otherwise, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

NAMES = ("chunk_exact", "chunk_replay", "commit", "fork", "fork_moved", "prefix_hit", "verify_scratch",
         "generate_stops", "sharded")
DEVICES = 8


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m infer.fuzz", description=__doc__.split("\n")[0])
    ap.add_argument("--property", action="append", choices=NAMES, help="a property to run (repeatable; default all)")
    ap.add_argument("--cases", type=int, default=1000, help="cases per property (rounded up to whole batches)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--numerics", choices=("float", "spec"), default="float", help="float: the float model "
                    "(tolerance 1e-5); spec: the SPEC §8 numerics (1e-2, rounding flips explained)")
    ap.add_argument("--rows", type=int, default=8, help="cases per batch (rows of every call); a multiple of 2")
    ap.add_argument("--first-batch", type=int, default=0, help="start at this batch (to rerun a failing one)")
    ap.add_argument("--mutants", action="store_true", help="plant each property's mutant; it must be caught")
    ap.add_argument("--json", default=None, help="also write the reports to this file")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    bad = [f"--{flag} {value}: {fix}" for flag, value, wrong, fix in (
        ("cases", args.cases, args.cases < 1, "run at least 1 case"),
        ("rows", args.rows, args.rows < 2 or args.rows % 2, "use an even number ≥ 2 (the sharded mesh splits rows "
                                                            "in two)"),
        ("first-batch", args.first_batch, args.first_batch < 0, "use a batch index ≥ 0"),
        ("seed", args.seed, args.seed < 0, "use a seed ≥ 0")) if wrong]
    if bad:
        print(f"error: {bad[0]}", file=sys.stderr)
        return 2
    if "jax" not in sys.modules and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (f"{os.environ.get('XLA_FLAGS', '')} "
                                   f"--xla_force_host_platform_device_count={DEVICES}").strip()
    import jax

    from csa2 import model
    from csa2.presets import preset
    from infer.fuzz import mutants, run
    from infer.fuzz.bench import Bench
    from infer.fuzz.properties import PROPERTIES

    cfg = preset("mini")
    bench = Bench(cfg, model.init_params(cfg, jax.random.PRNGKey(args.seed)), numerics=args.numerics, rows=args.rows)
    reference = Bench(cfg, bench.params, numerics="float", rows=args.rows) if args.numerics == "spec" else None
    reports, failed = [], False
    for name in args.property or NAMES:
        if args.mutants:
            with mutants.planted(name) as what:
                report = run.run(bench, PROPERTIES[name], args.cases, args.seed, args.first_batch, reference,
                                 until_failure=True)
            caught = not report.holds
            failed |= not caught
            print(f"mutant of {name}: {'caught' if caught else 'NOT CAUGHT'} — {what.strip()} "
                  f"({report.violations}/{report.cases} cases, largest {report.largest:.3g})", flush=True)
        else:
            report = run.run(bench, PROPERTIES[name], args.cases, args.seed, args.first_batch, reference)
            failed |= not report.holds
            print(report.line(), flush=True)
        reports.append({**report._asdict(), "mutant": args.mutants})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(reports, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
