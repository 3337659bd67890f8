"""The persistent XLA compilation cache of the command-line tools and notebooks.

A compiled program is stored on disk under a key of its HLO, the compile options, the backend and the jax/jaxlib
versions, and the next process that compiles the same program loads it instead: the second `python -m infer` on
the same shapes skips its compiles. The CLIs (`python -m infer`, `python -m train`, `python -m infer.bench_spec`,
`python -m train.demo`, `python -m experiments.notebooks`, `python -m infer.pd`) and the notebooks call `enable`
first (a CLI whose errors are not otherwise caught through `enable_cli`).

Where, in order: the `--compile-cache` flag (a directory, or `off`); the `CSA2_COMPILE_CACHE` environment variable
(the same values); a directory already given to JAX (`JAX_COMPILATION_CACHE_DIR` or `jax.config`), which is left
alone; else `$XDG_CACHE_HOME/csa2/xla` (`~/.cache/csa2/xla`). The benchmarks (`infer.bench_model`, `train.bench`)
measure compile times, so they have no default directory (`fallback=False`): only a flag, the variable or JAX's
own setting turns it on there. Entries are only written for programs that took at least `MIN_COMPILE_S` to
compile; delete the directory to drop them.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import jax

ENV = "CSA2_COMPILE_CACHE"
OFF = "off"
MIN_COMPILE_S = 0.5  # programs that compile faster are not written (the test suite uses the same threshold)


def default_dir() -> Path:
    """`$XDG_CACHE_HOME/csa2/xla`, or `~/.cache/csa2/xla`."""
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "csa2" / "xla"


def add_argument(parser: argparse.ArgumentParser, fallback: bool = True) -> None:
    """`--compile-cache DIR|off` on a CLI's parser; `fallback=False` (benchmarks): no default directory."""
    last = f"else {default_dir()}" if fallback else "else off"
    parser.add_argument("--compile-cache", default=None, metavar="DIR|off",
                        help=f"persistent XLA compilation cache directory, or '{OFF}' (default: ${ENV}, else "
                             f"JAX's own setting, {last})")


def _choice(flag: str | None) -> str | None:
    """The flag, else `$CSA2_COMPILE_CACHE`; None when neither is given."""
    return flag if flag is not None else os.environ.get(ENV)


def resolve(flag: str | None = None, fallback: bool = True) -> Path | None:
    """The directory `enable(flag, fallback)` turns on: the flag, else `$CSA2_COMPILE_CACHE`, else none when JAX
    already has one or `fallback` is False, else `default_dir()`. None also when the flag or variable says off."""
    choice = _choice(flag)
    if choice is not None:
        if not choice.strip():
            raise ValueError(f"compile cache: empty value (--compile-cache or ${ENV}); give a directory or '{OFF}'")
        return None if choice == OFF else Path(choice).expanduser()
    if jax.config.jax_compilation_cache_dir or not fallback:
        return None
    return default_dir()


def enable(flag: str | None = None, fallback: bool = True) -> str | None:
    """Set the persistent cache as `resolve(flag, fallback)` says (call it before the first compile); returns the
    directory in use (JAX's own when it already had one), or None when off."""
    path = resolve(flag, fallback)
    if path is not None:
        path.mkdir(parents=True, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", str(path))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_S)
    elif _choice(flag) == OFF:
        jax.config.update("jax_compilation_cache_dir", None)
    return jax.config.jax_compilation_cache_dir


def enable_cli(parser: argparse.ArgumentParser, flag: str | None, fallback: bool = True) -> str | None:
    """`enable` for a CLI: a bad value (an empty flag or variable) exits through `parser.error` (one `error:` line,
    status 2) instead of a traceback."""
    try:
        return enable(flag, fallback)
    except ValueError as err:
        parser.error(str(err))
