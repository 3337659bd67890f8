"""`python -m pallas_kernels.device_check [--dry-run]`: the kernels on this machine's accelerator, in one command.

1. **Parity**: every Pallas op (`impl="pallas"`), and sparse attention's backward kernel (gradients on float
   buffers), against the XLA reference on the device, at V4.1 dims (64 heads
   × 512 latent, indexer 32 × 128, top-k 512, window 128) and with the CPU tests' edge cases: −1 and
   out-of-range ids, a row with no valid entry, `visible` 0 and past N, odd sizes. One JSON line per case
   (`"check": "parity"`, the largest difference where both are finite, whether the −inf/0 pattern agrees).
2. **Speed**: `pallas_kernels.bench --kernels` at 8K–128K: the decode step of an attention group and each kernel
   next to XLA, with bytes/s against the HBM roofline.

The exit status is 1 when a parity case fails. It needs only jax, numpy and ml_dtypes (the device image has
them), so on a lent GPU it runs from the repository root as `PYTHONPATH=. python3 -m pallas_kernels.device_check`
within a few minutes. `--dry-run` runs the same checks on CPU at small sizes through the Pallas interpreter (CI
runs it), so the script is known to work before a device is lent.
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import bench, formats, ops
from pallas_kernels.stored import Stored

TOL = 1e-4  # |pallas − xla| / (1 + |xla|), both float32 at HIGHEST precision


def _cases(dry_run: bool, seed: int = 0) -> list[tuple[str, str, tuple]]:
    """(op, case, args) for every op: decode (S = 1) and a verify-sized block (S = 4), edge cases planted."""
    heads, latent, ih, idim, topk, window, n = ((4, 64, 4, 64, 16, 8, 100) if dry_run else
                                               (bench.HEADS, bench.LATENT, bench.INDEX_HEADS, bench.INDEX_DIM,
                                                bench.TOPK, bench.WINDOW, 8191))
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    out = []
    for s in (1, 4):
        main = Stored.quantized(normal(1, n, latent), formats.MAIN)
        win = Stored.quantized(normal(1, window + 3, latent), formats.WINDOW)
        main_idx = rng.integers(0, n, (1, s, topk)).astype(np.int32)
        main_idx[0, 0, topk // 2:] = -1  # a short selection
        main_idx[0, -1, :3] = n + 5  # out of range reads nothing
        win_idx = np.tile(np.arange(window, dtype=np.int32), (1, s, 1))
        win_idx[0, 0, window // 3:] = -1
        if s > 1:
            main_idx[0, 1], win_idx[0, 1] = -1, -1  # a row with no valid entry: all mass on the sink → 0
        out.append(("sparse_attention", f"S={s}", (normal(1, s, heads, latent), normal(heads), main,
                                                   jnp.asarray(main_idx), win, jnp.asarray(win_idx))))
        ikey = Stored.quantized(normal(1, n, idim), formats.INDEX)
        q, w = normal(1, s, ih, idim), normal(1, s, ih) * (ih * idim) ** -0.5
        visible = jnp.asarray([[0, n, n + 7, n // 3][:s]], jnp.int32)
        out.append(("indexer_scores", f"S={s}", (q, w, ikey, visible)))
        ids = rng.integers(-1, n + 3, (1, s, 2 * topk)).astype(np.int32)
        out.append(("indexer_scores_gathered", f"S={s}", (q, w, ikey, jnp.asarray(ids), visible)))
        scores = normal(1, s, n).at[0, 0, n // 2:].set(-jnp.inf)
        out.append(("block_max", f"S={s}", (scores, 8)))
        # Training reads float (QAT) buffers: the backward kernel's gradient against the reference's.
        float_main, float_win = (Stored(x.decode(), None, x.fmt) for x in (main, win))
        out.append(("sparse_attention_grad", f"S={s}", (normal(1, s, heads, latent), normal(heads), float_main,
                                                        jnp.asarray(main_idx), float_win, jnp.asarray(win_idx))))
    return out


def sparse_attention_grad(q, sink, main: Stored, main_idx, window: Stored, window_idx, *, impl: str) -> jax.Array:
    """d/d(q, sink, main, window) of Σ r · sparse_attention, r fixed, flattened into one vector."""
    r = jnp.cos(jnp.arange(q.size, dtype=jnp.float32)).reshape(q.shape)

    def loss(q, sink, main_payload, window_payload):
        out = ops.sparse_attention(q, sink, Stored(main_payload, None, main.fmt), main_idx,
                                   Stored(window_payload, None, window.fmt), window_idx, impl=impl)
        return jnp.sum(out * r)

    grads = jax.grad(loss, argnums=(0, 1, 2, 3))(q, sink, main.payload, window.payload)
    return jnp.concatenate([g.ravel() for g in grads])


def compare(got: np.ndarray, want: np.ndarray) -> tuple[float, bool]:
    """(largest relative difference where both are finite, whether the non-finite pattern is the same)."""
    finite = np.isfinite(want) & np.isfinite(got)
    same = bool(np.array_equal(np.isfinite(got), np.isfinite(want)) and np.array_equal(got[~finite], want[~finite]))
    err = float(np.max(np.abs(got[finite] - want[finite]) / (1 + np.abs(want[finite])), initial=0.0))
    return err, same


def parity(dry_run: bool) -> list[dict]:
    """One line per (op, case): Pallas against the XLA reference on this backend."""
    lines = []
    for op, case, args in _cases(dry_run):
        fn = sparse_attention_grad if op == "sparse_attention_grad" else getattr(ops, op)
        got, want = (np.asarray(fn(*args, impl=impl)) for impl in ("pallas", "xla"))
        err, same = compare(got, want)
        lines.append({"check": "parity", **bench.machine(), "op": op, "case": case, "shape": list(want.shape),
                      "max_rel_err": err, "same_masks": same, "ok": same and err <= TOL})
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pallas_kernels.device_check", description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU: small sizes through the Pallas interpreter")
    parser.add_argument("--contexts", default="8192,32768,131072", help="bench contexts (--dry-run: 512)")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    if not args.dry_run and jax.default_backend() == "cpu":
        print("error: no accelerator here (backend cpu); pass --dry-run to check the script on CPU", file=sys.stderr)
        return 2
    lines = parity(args.dry_run)
    for line in lines:
        print(json.dumps(line), flush=True)
    bench.main(["--contexts", "512" if args.dry_run else args.contexts, "--reps", "1" if args.dry_run else
                str(args.reps), "--kernels"])
    failed = [f"{line['op']} {line['case']}" for line in lines if not line["ok"]]
    print(json.dumps({"check": "summary", "parity_cases": len(lines), "failed": failed}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
