"""`python -m train.plan --preset v41_flash --mesh tensor=8,expert=32 --context 1048576 --batch 1`: the
per-device memory of the decode step and the train step on a device mesh, ahead of time.

Nothing is materialized: parameters, optimizer state, request state and tokens are `jax.ShapeDtypeStruct`s
carrying their shardings (`csa2.mesh`, `csa2.sharding`), the two steps are lowered and compiled for the mesh
(`model.decode_step.on(mesh, rules)`, `train_step.on(mesh, rules)`), and the figures come from the shardings (bytes each
device holds) and from the compiled programs' memory analysis (arguments, outputs, donated aliases, temporaries),
next to the collectives the partitioner put in each program. A mesh needs as many devices as it names; when
this process has fewer, the command runs itself again on that many simulated CPU devices.

The train step is planned as it would run: `--fsdp` splits parameters and AdamW moments over `data` as well
(`csa2.mesh.with_fsdp`; decode keeps the plain rules), `--remat` chooses what the backward pass keeps
(`csa2.remat`), `--dtype-policy bfloat16` runs bf16 weights and compute on float32 masters. `--fit` plans a
v41_flash-sized step on the meshes of `FIT_MESHES` (one row of `--seq-len` tokens per data shard) in order and
names the smallest whose train step peaks under `--budget-gb` (default 141, an H200).

The held bytes (parameters, optimizer state, request state) are what any backend holds. The temporaries are
XLA:CPU's buffer assignment of the XLA reference paths: the MoE's grouped matmul works in tiles (the routed rows'
size, `pallas_kernels.grouped`) and the reference sparse attention and indexer read in blocks of queries
(`pallas_kernels.reference.by_query_blocks`), as the Pallas kernels of an accelerator do; what still gathers every
query's entries at once is the SPEC §13 indexer loss's attention target (`[4096, 640, 512]` float32 at 4096 tokens
per row, 5.4 GB). So on v41_flash the train step's temporaries are an upper bound of an accelerator's, and the
held bytes are exact. The report lists the train step's largest buffers by op scope (`largest_buffers`, read from
the compiled program), which is how it knows where the temporaries come from.

It lives in `train` because it compiles the train step (`csa2` does not import `train`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

from csa2 import mesh as mesh_lib, model, remat, sharding, state as state_lib
from csa2.config import ENGRAM_TABLE_FORMATS, ModelConfig
from csa2.presets import PRESETS, preset
from csa2.state import CACHE_FORMATS
from train.step import (
    DTYPE_POLICIES,
    TrainConfig,
    init_train_state,
    saved_for_backward,
    train_state_shardings,
    train_step,
)

FIT_MESHES = ({"data": 2, "tensor": 8, "expert": 16}, {"data": 4, "tensor": 8, "expert": 16},
              {"data": 8, "tensor": 8, "expert": 16})  # `--fit`: the meshes to try, smallest first
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_COLLECTIVE = re.compile(r"\s(" + "|".join(COLLECTIVES) + r")(?:-start)?\(")
_ENV = "CSA2_PLAN_DEVICES"  # set in the re-run, so it never re-runs itself twice


@dataclasses.dataclass(frozen=True)
class Program:
    """One compiled step's memory analysis (bytes per device), its collective ops by kind and its largest
    buffers: (bytes, shape, op scope) of the biggest value each op scope materializes, largest first."""
    arguments: int
    outputs: int
    aliased: int  # outputs written into donated arguments
    temporaries: int
    collectives: dict[str, int]
    largest: tuple[tuple[int, str, str], ...] = ()

    @property
    def peak(self) -> int:
        """Arguments + outputs − aliased + temporaries: what the step needs live at once."""
        return self.arguments + self.outputs - self.aliased + self.temporaries


@dataclasses.dataclass(frozen=True)
class Plan:
    """Bytes per device of what a mesh holds and of the two steps: `params` as decode holds them (by the rules
    without FSDP), `train_params` and `opt_state` as training holds them (by the rules, FSDP included), `state`
    the request state."""
    mesh: dict[str, int]
    params: int
    train_params: int
    opt_state: int
    state: int
    decode: Program
    train: Program
    kept: int  # of the train step's temporaries: what its backward pass keeps from the forward (`saved_for_backward`)


def parse_mesh(text: str) -> dict[str, int]:
    """`"data=8,expert=64"` → `{"data": 8, "expert": 64}` (axes of `csa2.mesh.MESH_AXES`)."""
    shape = {}
    for part in filter(None, text.split(",")):
        axis, _, size = part.partition("=")
        if not size.isdigit() or int(size) < 1:
            raise ValueError(f"--mesh {text!r}: {part!r} is not axis=size; write e.g. data=8,tensor=8,expert=8")
        shape[axis.strip()] = int(size)
    return shape


def held_bytes(tree) -> int:
    """Bytes one device holds of `tree`'s arrays (`ShapeDtypeStruct`s or arrays with a `NamedSharding`)."""
    return sum(int(np.prod(a.sharding.shard_shape(a.shape))) * np.dtype(a.dtype).itemsize
               for a in jax.tree.leaves(tree))


_VALUE = re.compile(r'^\s*(?:ROOT )?%\S+ = (\w+)\[([\d,]*)\]\S* ([\w-]+)\(.*?op_name="([^"]+)"', re.M)
_NOT_BUFFERS = ("parameter", "bitcast", "get-tuple-element", "tuple")
_HLO_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e8m0fnu": 1, "s16": 2, "u16": 2, "f16": 2,
              "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
_SCOPE_NOISE = re.compile(r"\b(jit|jvp|transpose)\(|\)|\b(train_step|decode_step|rematted_computation|while|body|"
                          r"closed_call|checkpoint)/")


def largest_buffers(hlo: str, n: int = 6) -> tuple[tuple[int, str, str], ...]:
    """The `n` op scopes whose biggest value is largest in a compiled program's text (computations that are not
    fusion bodies; a fusion's inner values are never materialized), as (bytes, shape, scope)."""
    best: dict[str, tuple[int, str]] = {}
    for computation in re.split(r"\n(?=\S)", hlo):
        if "fused" in computation.split("(", 1)[0]:
            continue
        for dtype, dims, op, name in _VALUE.findall(computation):
            if op in _NOT_BUFFERS or dtype not in _HLO_BYTES:
                continue
            size = int(np.prod([int(d) for d in dims.split(",") if d], dtype=np.int64)) * _HLO_BYTES[dtype]
            scope = _SCOPE_NOISE.sub("", _SCOPE_NOISE.sub("", name.split(":")[0]))  # wrappers, then their names
            if size > best.get(scope, (0, ""))[0]:
                best[scope] = (size, f"{dtype}[{dims}]")
    ranked = sorted(((size, shape, scope) for scope, (size, shape) in best.items()), reverse=True)
    return tuple(ranked[:n])


def _program(compiled: jax.stages.Compiled) -> Program:
    stats = compiled.memory_analysis()
    text = compiled.as_text()
    found = _COLLECTIVE.findall(text)
    return Program(arguments=stats.argument_size_in_bytes, outputs=stats.output_size_in_bytes,
                   aliased=stats.alias_size_in_bytes, temporaries=stats.temp_size_in_bytes,
                   collectives={op: found.count(op) for op in COLLECTIVES}, largest=largest_buffers(text))


def _placed(tree, shardings):
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)


def plan(cfg: ModelConfig, mesh: jax.sharding.Mesh, rules: mesh_lib.Rules, context: int, batch: int, seq_len: int,
         cache_format: str = "fp4", tc: TrainConfig = TrainConfig()) -> Plan:
    """Compile `decode_step` (a `batch`-row state of `context` tokens) and `train_step` (`batch` × `seq_len`, with
    `tc`'s remat and dtype policies) for `mesh` from shapes alone and measure them. An FSDP entry in `rules`
    (`csa2.mesh.with_fsdp`) splits the train step's parameters and moments; decode places them without it."""
    for name, value in (("context", context), ("batch", batch), ("seq_len", seq_len)):
        if value < 1:
            raise ValueError(f"{name}={value}: must be ≥ 1")
    mesh_lib.check_batch(batch, mesh, "batch")
    row = mesh_lib.rows(mesh, rules)
    serving = {k: v for k, v in rules.items() if k != mesh_lib.FSDP}
    params = _placed(model.abstract_params(cfg), sharding.param_state_shardings(cfg, mesh, serving))
    abstract = state_lib.abstract_state(cfg, batch, context, cache_format)
    state = _placed(abstract, sharding.state_shardings(abstract, mesh))
    tokens = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=row)
    decode = _program(model.decode_step.on(mesh, serving).lower(cfg, params, state, tokens).compile())
    abstract_train = jax.eval_shape(lambda: init_train_state(cfg, tc))
    train_state = _placed(abstract_train, train_state_shardings(abstract_train, mesh, rules))
    batch_tokens = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32, sharding=row)
    train = _program(train_step.on(mesh, rules).lower(cfg, tc, train_state, batch_tokens, batch_tokens).compile())
    with jax.set_mesh(mesh), mesh_lib.use_rules(rules):  # as the train step traces on the mesh
        saved = jax.jit(saved_for_backward, static_argnums=(0, 1)).lower(cfg, tc, train_state, batch_tokens,
                                                                         batch_tokens).compile()
    return Plan(mesh=dict(mesh.shape), params=held_bytes(params), train_params=held_bytes(train_state.params),
                opt_state=held_bytes(train_state.opt_state), state=held_bytes(state), decode=decode, train=train,
                kept=saved.memory_analysis().output_size_in_bytes)


def _gb(n: int) -> str:
    return f"{n / 1e9:,.2f} GB" if n >= 1e8 else f"{n / 1e6:,.3f} MB"


def report(name: str, p: Plan, context: int, batch: int, seq_len: int, cache_format: str,
           training: str = "") -> str:
    """The plan as a table (per device; GB = 1e9 bytes, MB = 1e6). `training`: how the train step was set up
    (FSDP, remat and dtype policies), for the header."""
    mesh = " × ".join(f"{a}={n}" for a, n in p.mesh.items())
    rows = [
        f"plan: {name} on mesh {mesh} ({int(np.prod(list(p.mesh.values())))} devices); decode: batch {batch}, "
        f"{cache_format} state of {context:,} tokens; train: batch {batch} × {seq_len} tokens, AdamW{training}",
        "per device                          decode step     train step",
        f"  parameters (held)             {_gb(p.params):>14} {_gb(p.train_params):>14}",
        f"  optimizer state (held)        {'':>14} {_gb(p.opt_state):>14}",
        f"  request state (held)          {_gb(p.state):>14} {'':>14}",
        f"  program arguments             {_gb(p.decode.arguments):>14} {_gb(p.train.arguments):>14}",
        f"  program outputs               {_gb(p.decode.outputs):>14} {_gb(p.train.outputs):>14}",
        f"  donated (outputs in place)    {_gb(p.decode.aliased):>14} {_gb(p.train.aliased):>14}",
        f"  temporaries                   {_gb(p.decode.temporaries):>14} {_gb(p.train.temporaries):>14}",
        f"    of which kept for backward  {'':>14} {_gb(p.kept):>14}",
        f"  peak (args + out − donated + temp) {_gb(p.decode.peak):>9} {_gb(p.train.peak):>14}",
        "  (temporaries: XLA:CPU's buffer assignment of the XLA reference paths; see train.plan. Kept for backward:",
        "   the forward's residuals under the remat policy, other than the step's arguments, as placed on the mesh)",
        "collectives in the compiled programs (a scanned body's ops count once)",
    ]
    for op in COLLECTIVES:
        rows.append(f"  {op:<28}  {p.decode.collectives[op]:>14} {p.train.collectives[op]:>14}")
    rows.append("largest buffers of the train step (biggest value per op scope, from the compiled program)")
    rows += [f"  {_gb(size):>11}  {shape:<28} {scope}" for size, shape, scope in p.train.largest]
    return "\n".join(rows)


def rerun_with_devices(module: str, argv: list[str] | None, devices: int) -> int | None:
    """When this process has fewer than `devices` devices, run `python -m module argv` again on that many
    simulated CPU devices and return its exit code; None when this process has enough (or is the re-run)."""
    if jax.device_count() >= devices or os.environ.get(_ENV):
        return None
    env = {**mesh_lib.simulated_cpu_env(devices), _ENV: "1"}
    return subprocess.run([sys.executable, "-m", module, *(sys.argv[1:] if argv is None else argv)], env=env).returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m train.plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="v41_flash", choices=PRESETS)
    parser.add_argument("--mesh", default=None,
                        help="axis=size,… over data, tensor, expert (default tensor=8,expert=32)")
    parser.add_argument("--context", type=int, default=1 << 20, help="tokens per row of the decode state")
    parser.add_argument("--batch", type=int, default=None, help="rows of the decode state and of the train batch "
                        "(default 1)")
    parser.add_argument("--seq-len", type=int, default=4096, help="train sequence length")
    parser.add_argument("--format", default="fp4", choices=CACHE_FORMATS, dest="cache_format")
    parser.add_argument("--engram-table", default=None, choices=ENGRAM_TABLE_FORMATS,
                        help="Engram tables in float (trainable; the preset's default) or as released FP8 rows")
    parser.add_argument("--fsdp", action="store_true",
                        help="also split every parameter and its AdamW moments over data (csa2.mesh.with_fsdp)")
    parser.add_argument("--remat", default="none", choices=remat.POLICIES, help="what the backward pass keeps")
    parser.add_argument("--dtype-policy", default="float32", choices=DTYPE_POLICIES,
                        help="bfloat16: bf16 weights and compute on float32 master weights")
    parser.add_argument("--fit", action="store_true",
                        help="plan the meshes of FIT_MESHES in order (batch = data) and name the smallest that fits")
    parser.add_argument("--budget-gb", type=float, default=141.0, help="device memory for --fit (default: H200)")
    args = parser.parse_args(argv)
    try:
        if args.fit and (args.mesh is not None or args.batch is not None):
            raise ValueError("--fit plans its own meshes (FIT_MESHES) with one row per data shard; drop --mesh and "
                             "--batch, or plan one mesh without --fit")
        shapes = list(FIT_MESHES) if args.fit else [parse_mesh(args.mesh or "tensor=8,expert=32")]
        devices = max(int(np.prod(list(shape.values()))) for shape in shapes)
        code = rerun_with_devices("train.plan", argv, devices)
        if code is not None:
            return code
        cfg = preset(args.preset)
        cfg = cfg if args.engram_table is None else cfg.replace(engram_table_format=args.engram_table)
        rules = mesh_lib.rules_for(args.preset)
        rules = mesh_lib.with_fsdp(rules) if args.fsdp else rules
        tc = TrainConfig(remat=args.remat, dtype_policy=args.dtype_policy)
        training = f"; fsdp {'on' if args.fsdp else 'off'}, remat {args.remat}, dtype policy {args.dtype_policy}"
        for shape in shapes:
            n = int(np.prod(list(shape.values())))
            mesh = mesh_lib.make_mesh(shape, jax.devices()[:n])
            batch = mesh.shape["data"] if args.fit else args.batch or 1
            p = plan(cfg, mesh, rules, args.context, batch, args.seq_len, args.cache_format, tc)
            print(report(f"{args.preset} (Engram tables: {cfg.engram_table_format})", p, args.context, batch,
                         args.seq_len, args.cache_format, training), flush=True)
            if args.fit and p.train.peak <= args.budget_gb * 1e9:
                print(f"fits: the train step peaks at {_gb(p.train.peak)} ≤ {args.budget_gb:g} GB per device on "
                      f"{n} devices ({', '.join(f'{a}={k}' for a, k in shape.items())})")
                return 0
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.fit:
        print(f"fits on none of the {len(shapes)} meshes: the train step peaks above {args.budget_gb:g} GB per "
              "device on each (XLA:CPU temporaries; see the module docstring)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
