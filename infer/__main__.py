"""`python -m infer`: continue text prompts with a trained checkpoint (byte vocabulary, SPEC §11).

    python -m infer --checkpoint DIR --prompt "..." [--prompt ...] [--batch-file F] [--max-new-tokens N]
                    [--temperature T] [--top-p P] [--replay-window R | --exact] [--numerics spec|float]
                    [--seed S] [--step K] [--dtype float32|bfloat16]

All prompts run as one batch (`infer.generate`); each is BOS + its UTF-8 bytes. Prints every
continuation, then one line with the compile time and the tokens/s of the compiled call (new tokens
over its wall time, compilation excluded). Bad input prints one `error: ...` line and exits 2.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from csa2 import compile_cache

EXIT_BAD_INPUT = 2


class CliError(Exception):
    """A user error: printed as one `error:` line, exit status 2."""


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m infer", description="Batched generation from a checkpoint.")
    ap.add_argument("--checkpoint", required=True,
                    help="a run directory of python -m train (latest step unless --step), or a checkpoint in the "
                         "released layout (config.json + shards; e.g. the shipped model, csa2.checkpoints.bundled())")
    ap.add_argument("--step", type=int, default=None, help="checkpoint step to restore (default: latest)")
    ap.add_argument("--prompt", action="append", default=[], help="a prompt; repeat for a batch")
    ap.add_argument("--batch-file", type=Path, help="UTF-8 text file, one prompt per non-empty line")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--top-p", type=float, default=1.0, help="nucleus mass in (0, 1]")
    replay = ap.add_mutually_exclusive_group()
    replay.add_argument("--replay-window", type=int, default=128, help="decoder replay window R (SPEC §11)")
    replay.add_argument("--exact", action="store_true", help="exact prefill: every position through every layer")
    ap.add_argument("--numerics", choices=("spec", "float"), default="spec",
                    help="spec: the SPEC §8 FP4/FP8 cache (default); float: the float model on a float cache")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"),
                    help="compute dtype (default: the checkpoint's; a released-layout config.json names none, so "
                         "bfloat16 there)")
    ap.add_argument("--seed", type=int, default=0)
    compile_cache.add_argument(ap)
    return ap


def _prompts(args) -> list[str]:
    """The --prompt texts, then the non-empty lines of --batch-file (strict UTF-8)."""
    from csa2.tokenizer import validate_utf8

    texts = list(args.prompt)
    if args.batch_file is not None:
        try:
            data = args.batch_file.read_bytes()
        except OSError as err:
            raise CliError(f"--batch-file {args.batch_file}: {err.strerror.lower()}; pass a UTF-8 text file, one "
                           "prompt per line") from None
        for lineno, line in enumerate(data.split(b"\n"), start=1):
            line = line.removesuffix(b"\r")
            if line:
                texts.append(validate_utf8(line, field=f"{args.batch_file}:{lineno}"))
    if not texts:
        raise CliError("no prompts: pass --prompt TEXT (repeatable) or --batch-file FILE")
    return texts


def _main(args) -> None:
    if not Path(args.checkpoint).is_dir():
        raise CliError(f"checkpoint directory {args.checkpoint} does not exist; pass the --out directory of a "
                       "training run (python -m train) or a released-layout directory")
    texts = _prompts(args)
    compile_cache.enable(args.compile_cache)
    import jax

    from csa2.checkpoints.layouts import load, load_config
    from csa2.replay import EXACT, ReplayPolicy
    from csa2.tokenizer import decode, encode
    from infer.generate import Sampling, lower, plan, run

    cfg = load_config(args.checkpoint, args.step)
    if args.dtype is not None:
        cfg = cfg.replace(dtype=args.dtype)
    replay = EXACT if args.exact else ReplayPolicy(window=args.replay_window)
    batch = plan(cfg, [encode(t, bos=True) for t in texts], max_new_tokens=args.max_new_tokens,
                 sampling=Sampling(temperature=args.temperature, top_p=args.top_p), replay=replay,
                 numerics=args.numerics, seed=args.seed)
    cfg, params = load(args.checkpoint, cfg, args.step)
    t0 = time.perf_counter()
    compiled = lower(cfg, params, batch).compile()
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    result = run(cfg, params, batch, compiled)
    jax.block_until_ready(result.state)
    wall = time.perf_counter() - t0
    for i, (tokens, n) in enumerate(zip(result.tokens, result.lengths)):
        print(f"[{i}] {decode(tokens[:n])}")
    total = int(result.lengths.sum())
    print(f"compile {compile_s:.2f} s; {total} new tokens in {wall:.3f} s = {total / wall:.1f} tokens/s "
          f"(batch {len(texts)}, prompt bucket {batch.tokens.shape[1]}, capacity {batch.capacity})")


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; user errors become one `error:` line on stderr and exit status 2."""
    args = _parser().parse_args(argv)
    try:
        _main(args)
    except (CliError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return 0


if __name__ == "__main__":
    sys.exit(main())
