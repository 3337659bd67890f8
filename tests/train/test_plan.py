"""`python -m train.plan`: per-device memory of the sharded decode and train steps, from shapes alone."""

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from csa2 import mesh as mesh_lib
from train import plan

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}

PLAN = textwrap.dedent("""
    import jax, numpy as np
    from csa2 import mesh as mesh_lib, model, state
    from csa2.presets import preset
    from train import plan
    from train.step import TrainConfig
    cfg = preset("mini")
    mesh = mesh_lib.make_mesh({"data": 2, "tensor": 2, "expert": 2})
    rules = mesh_lib.with_fsdp(mesh_lib.rules_for("mini"))
    p = plan.plan(cfg, mesh, rules, context=128, batch=2, seq_len=32,
                  tc=TrainConfig(remat="layer", dtype_policy="bfloat16"))
    everything = plan.plan(cfg, mesh, rules, context=128, batch=2, seq_len=32,
                           tc=TrainConfig(remat="none", dtype_policy="bfloat16"))
    print("kept", p.kept, everything.kept, p.train.temporaries)
    whole = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(model.abstract_params(cfg)))
    print("state", p.state, state.state_bytes(state.abstract_state(cfg, 2, 128, "fp4"))["total"])
    print("params", p.params, whole)
    print("train_params", p.train_params)
    print("opt_state", p.opt_state)
    for name, program in (("decode", p.decode), ("train", p.train)):
        print(name, program.arguments, program.aliased, program.temporaries, program.peak,
              program.collectives["all-reduce"])
""")


def test_the_plan_of_mini_on_8_devices_counts_each_devices_share():
    """The request state is split over data=2 exactly; parameters over tensor and expert (so a device holds
    more than an eighth and less than all); with FSDP, training holds them over data as well (about half, a
    few small leaves data does not divide stay whole) and AdamW's two moments at most twice that. The decode step
    takes the parameters it reads and the state, and writes the new state into the donated one; the train step
    (remat and the bfloat16 policy) takes and donates the whole train state. Both combine partial sums with
    all-reduces. What the train step's backward keeps is part of its temporaries, and less under remat."""
    env = mesh_lib.simulated_cpu_env(8)
    out = subprocess.run([sys.executable, "-c", PLAN], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {line.split()[0]: [int(v) for v in line.split()[1:]] for line in out.stdout.splitlines()}
    held, total = rows["state"]
    assert held * 2 == total
    params, whole = rows["params"]
    assert whole / 8 < params < whole
    train_params = rows["train_params"][0]
    assert params / 2 <= train_params < 0.6 * params
    assert train_params < rows["opt_state"][0] <= 2 * train_params + 1024
    arguments, aliased, temporaries, peak, all_reduce = rows["decode"]
    assert held < arguments <= params + held + 64 and aliased == held
    assert temporaries > 0 and peak >= arguments + temporaries - aliased and all_reduce > 0
    arguments, aliased, temporaries, peak, all_reduce = rows["train"]
    assert arguments >= aliased >= train_params + rows["opt_state"][0] and temporaries > 0 and all_reduce > 0
    # What the backward keeps: part of the temporaries, and less with each layer rematerialized than with nothing.
    kept, kept_without_remat, temporaries = rows["kept"]
    assert 0 < kept < temporaries and kept < kept_without_remat


def test_the_command_prints_its_table():
    """The command runs itself again on as many simulated devices as its mesh names. (The plan of the test above:
    its programs load from the run's compilation cache.)"""
    out = subprocess.run([sys.executable, "-m", "train.plan", "--preset", "mini", "--mesh", "data=2,tensor=2,expert=2",
                          "--context", "128", "--batch", "2", "--seq-len", "32", "--fsdp", "--remat", "layer",
                          "--dtype-policy", "bfloat16"], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert text.startswith("plan: mini (Engram tables: float) on mesh data=2 × tensor=2 × expert=2 (8 devices)"), text
    assert "AdamW; fsdp on, remat layer, dtype policy bfloat16" in text.splitlines()[0], text
    for label in ("parameters (held)", "optimizer state (held)", "request state (held)", "temporaries",
                  "kept for backward", "peak",
                  "all-reduce", "largest buffers of the train step"):
        assert label in text, label


def test_largest_buffers_reads_materialized_values_only():
    """A fusion body's values are never materialized and parameters are the held bytes: neither counts; each op
    scope reports its biggest value, wrappers (jit, jvp, transpose, remat) stripped from the scope."""
    hlo = textwrap.dedent('''
        %fused_computation.1 (p: f32[8,8]) -> f32[64,64] {
          %big = f32[64,64]{1,0} broadcast(%p), metadata={op_name="jit(train_step)/jit(forward)/attention/inner"}
        }
        ENTRY %main (a: f32[4,4]) -> f32[16] {
          %a = f32[4,4]{1,0} parameter(0), metadata={op_name="jit(train_step)/param"}
          %g = f32[2,3,4]{2,1,0} gather(%a), metadata={op_name="transpose(jvp(jit(forward)))/attention/gather"}
          %h = bf16[2,3,4]{2,1,0} convert(%g), metadata={op_name="jit(train_step)/jit(forward)/attention/gather"}
          %k = u8[100]{0} copy(%a), metadata={op_name="jit(train_step)/jit(forward)/squeeze"}
        }
    ''')
    assert plan.largest_buffers(hlo) == ((100, "u8[100]", "forward/squeeze"),
                                         (96, "f32[2,3,4]", "forward/attention/gather"))


@pytest.mark.parametrize("argv, message", [
    (["--mesh", "data=x"], r"'data=x' is not axis=size"),
    (["--mesh", "model=2"], r"mesh axes \['model'\] are unknown"),
    (["--mesh", "data=2", "--batch", "3"], r"batch: batch 3 does not split over mesh axis 'data' of size 2"),
    (["--mesh", "expert=3"], r"'experts' of size 4 does not split over mesh axis 'expert' of size 3; pick a mesh size"),
    (["--fit", "--mesh", "data=2"], r"--fit plans its own meshes \(FIT_MESHES\) with one row per data shard"),
])
def test_bad_meshes_are_refused_with_the_fix(argv, message, capfd):
    code = plan.main(["--preset", "mini", "--context", "128", "--seq-len", "16", *argv])
    err = capfd.readouterr().err
    assert code == 2
    assert re.search(message, err), err
