"""`python -m train.bench`: compile seconds and step time of `train_step` (DESIGN §5, §8).

    python -m train.bench [--config tiny] [--batch-size 4] [--seq-len 128] [--steps 5] [--float] [--mesh data=8]
                          [--remat layer] [--dtype-policy bfloat16] [--kernel-impl dense]
                          [--index-topk 128 --candidate-topk-blocks 32]

One JSON line per measurement with the machine and the config (the `infer.bench_model` reporter):
`compile` (lower and compile seconds of the jitted update) and `train_step` (median step seconds
after compilation, tokens per second). `--mesh` also times the step sharded on that mesh
(`train_step.on(mesh, rules)`; on simulated CPU devices when this process has fewer) and prints
`train_step_sharded` with its ratio to the one-device step measured in the same run: on CPU devices
that share the cores, the ratio shows the partitioning's overhead, not a speed-up. `--remat POLICY` also
times the step with that rematerialization policy (`csa2.remat`) and prints `train_step_remat` with its ratio
to the step without it, measured in the same run. `--kernel-impl IMPL` also times the step with the hot paths on
that backend (`pallas_kernels.ops`; the first step runs the config's, "xla") and prints `train_step_impl` with its
ratio. `--dtype-policy` sets both steps' policy; `--index-topk` and `--candidate-topk-blocks` set the read budget
(e.g. the long-context recipe's 128 and 32).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from csa2 import compile_cache, mesh as mesh_lib, remat
from csa2.presets import PRESETS, preset
from infer.bench_model import Reporter, config_info, machine_info
from pallas_kernels import ops
from train.plan import parse_mesh, rerun_with_devices
from train.step import DTYPE_POLICIES, TrainConfig, init_train_state, train_state_shardings, train_step


def _median_step(step, state, batch, steps: int) -> float:
    """Median seconds of `steps` calls of a compiled `step` after one untimed call."""
    state, _ = step(state, *batch)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, metrics = step(state, *batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m train.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="tiny", choices=PRESETS)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=5, help="timed steps after the compiled first one")
    ap.add_argument("--float", action="store_true", help="ablation: float forward (default: SPEC §8 fake-quant)")
    ap.add_argument("--mesh", default=None, help="also time the step sharded on this mesh, e.g. data=8")
    ap.add_argument("--remat", default=None, choices=remat.POLICIES[1:],
                    help="also time the step with this remat policy (csa2.remat)")
    ap.add_argument("--dtype-policy", default="float32", choices=DTYPE_POLICIES)
    ap.add_argument("--kernel-impl", default=None, choices=ops.CHOICES,
                    help="also time the step with this backend of the hot paths (pallas_kernels.ops)")
    ap.add_argument("--index-topk", type=int, default=None, help="Global entries per query (default: the preset's)")
    ap.add_argument("--candidate-topk-blocks", type=int, default=None,
                    help="candidate blocks of the decoder's pool (default: the preset's)")
    compile_cache.add_argument(ap, fallback=False)
    args = ap.parse_args(argv)
    compile_cache.enable_cli(ap, args.compile_cache, fallback=False)
    if min(args.batch_size, args.seq_len, args.steps) < 1:
        print("error: --batch-size, --seq-len and --steps must be ≥ 1", file=sys.stderr)
        return 2
    try:
        shape = None if args.mesh is None else parse_mesh(args.mesh)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    devices = 1 if shape is None else int(np.prod(list(shape.values())))
    code = rerun_with_devices("train.bench", argv, devices)
    if code is not None:
        return code
    budget = {name: getattr(args, name) for name in ("index_topk", "candidate_topk_blocks")
              if getattr(args, name) is not None}
    try:
        cfg = preset(args.config).replace(**budget)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    qat = not args.float
    tc = TrainConfig(steps=args.steps + 1, batch_size=args.batch_size, seq_len=args.seq_len,
                     dtype_policy=args.dtype_policy)
    rep = Reporter(machine_info(), {**config_info(args.config, cfg), "batch": args.batch_size, "seq_len": args.seq_len,
                                      "index_topk": cfg.index_topk, "candidate_topk_blocks": cfg.candidate_topk_blocks})
    state = init_train_state(cfg, tc)
    rng = np.random.default_rng(0)
    batch = [jnp.asarray(rng.integers(0, min(cfg.vocab_size, 256), (args.batch_size, args.seq_len)), jnp.int32)
             for _ in range(2)]
    t0 = time.perf_counter()
    lowered = train_step.lower(cfg, tc, state, *batch, qat=qat)
    t1 = time.perf_counter()
    step = lowered.compile()
    t2 = time.perf_counter()
    rep.emit("compile", fn="train_step", qat=qat, lower_s=round(t1 - t0, 3), compile_s=round(t2 - t1, 3),
             total_s=round(t2 - t0, 3))
    med = _median_step(step, state, batch, args.steps)
    rep.emit("train_step", qat=qat, steps=args.steps, median_step_s=round(med, 4),
             tokens_per_s=round(args.batch_size * args.seq_len / med, 1), dtype_policy=tc.dtype_policy)
    if args.remat is not None:
        rc = dataclasses.replace(tc, remat=args.remat)
        t0 = time.perf_counter()
        step = train_step.lower(cfg, rc, init_train_state(cfg, rc), *batch, qat=qat).compile()
        compile_s = time.perf_counter() - t0
        rematted = _median_step(step, init_train_state(cfg, rc), batch, args.steps)
        rep.emit("train_step_remat", qat=qat, remat=args.remat, compile_s=round(compile_s, 3), steps=args.steps,
                 median_step_s=round(rematted, 4), vs_no_remat=round(rematted / med, 3))
    if args.kernel_impl is not None:
        other = cfg.replace(kernel_impl=args.kernel_impl)
        t0 = time.perf_counter()
        step = train_step.lower(other, tc, init_train_state(cfg, tc), *batch, qat=qat).compile()
        compile_s = time.perf_counter() - t0
        timed = _median_step(step, init_train_state(cfg, tc), batch, args.steps)
        rep.emit("train_step_impl", qat=qat, kernel_impl=args.kernel_impl, compile_s=round(compile_s, 3),
                 steps=args.steps, median_step_s=round(timed, 4), vs_config_impl=round(timed / med, 3))
    if shape is not None:
        try:
            mesh = mesh_lib.make_mesh(shape, jax.devices()[:devices])
            rules = mesh_lib.rules_for(args.config)
            mesh_lib.check_batch(args.batch_size, mesh, "--batch-size")
            placed = [jax.device_put(b, mesh_lib.rows(mesh, rules)) for b in batch]
            state = init_train_state(cfg, tc)
            state = jax.device_put(state, train_state_shardings(state, mesh, rules))
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        step = train_step.on(mesh, rules).lower(cfg, tc, state, *placed, qat=qat).compile()
        sharded = _median_step(step, state, placed, args.steps)
        rep.emit("train_step_sharded", qat=qat, mesh=dict(mesh.shape), devices=devices, steps=args.steps,
                 median_step_s=round(sharded, 4), vs_one_device=round(sharded / med, 3))
    return 0


if __name__ == "__main__":
    sys.exit(main())
