"""`python -m experiments.notebooks [NAME ...]`: execute the notebooks and save them with their outputs (a full
run, what is committed), or with `--fast` check that they run at CI sizes without writing anything."""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

import nbformat
from nbclient import NotebookClient

from csa2 import compile_cache
from train.longctx import FAST_ENV

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"


def paths(names=()) -> list[pathlib.Path]:
    """The notebooks called `names` (stems), or all of them."""
    found = sorted(NOTEBOOKS.glob("*.ipynb"))
    if not names:
        return found
    unknown = sorted(set(names) - {p.stem for p in found})
    if unknown:
        raise ValueError(f"notebooks {unknown}: not in {NOTEBOOKS}; choose from {[p.stem for p in found]}")
    return [p for p in found if p.stem in names]


def execute(path: pathlib.Path, *, fast: bool, timeout: int | None = 3600) -> nbformat.NotebookNode:
    """Run every cell of `path` in a fresh kernel started in the repository root (so `runs/` is shared) with
    `CSA2_FAST` set from `fast`, each cell for at most `timeout` seconds (None: no limit); raises
    `nbclient.exceptions.CellExecutionError` on the first failing cell."""
    nb = nbformat.read(path, as_version=4)
    previous = os.environ.get(FAST_ENV)
    os.environ[FAST_ENV] = "1" if fast else "0"  # the kernel inherits the environment
    try:
        NotebookClient(nb, timeout=timeout, kernel_name="python3",
                       resources={"metadata": {"path": str(ROOT)}}).execute()
    finally:
        if previous is None:
            os.environ.pop(FAST_ENV)
        else:
            os.environ[FAST_ENV] = previous
    return nb


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.notebooks", description=__doc__)
    p.add_argument("names", nargs="*", help="notebook stems (default: all)")
    p.add_argument("--fast", action="store_true", help="CI sizes; nothing is written")
    compile_cache.add_argument(p)
    args = p.parse_args(argv)
    if args.compile_cache is not None:  # each notebook enables the cache in its own kernel, which reads this
        os.environ[compile_cache.ENV] = args.compile_cache
    try:
        selected = paths(args.names)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for path in selected:
        t0 = time.perf_counter()
        nb = execute(path, fast=args.fast, timeout=3600 if args.fast else None)  # a full-size cell may take hours
        if not args.fast:
            nbformat.write(nb, path)
        print(f"{path.relative_to(ROOT)}: {time.perf_counter() - t0:.0f} s{'' if args.fast else ', saved'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
