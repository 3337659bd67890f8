"""The generate loops on a device mesh (`EntryPoint.on`: `infer.generate.run(..., mesh=, rules=)` and
`infer.speculative.speculative_generate(..., mesh=, rules=)`), on 8 simulated CPU devices in a subprocess: the
same tokens as one device, the state split over `data`."""

import subprocess
import sys
import textwrap
from pathlib import Path

from csa2 import mesh as mesh_lib

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import jax, numpy as np
    from csa2 import mesh as mesh_lib, model, sharding
    from csa2.presets import preset
    from infer import generate as gen
    from infer.speculative import speculative_generate

    cfg = preset("mini")
    params = model.init_params(cfg, jax.random.PRNGKey(0))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, n) for n in (5, 9, 3, 12, 7, 1, 10, 4)]  # ragged: one bucket, PAD tails
    mesh = mesh_lib.make_mesh({"data": 2, "tensor": 2, "expert": 2})
    rules = mesh_lib.rules_for("mini")
    placed = sharding.shard_params(cfg, params, mesh, rules)
    p = gen.plan(cfg, prompts, max_new_tokens=6, eos_id=None)
    want = gen.run(cfg, params, p)
    got = gen.run(cfg, placed, p, mesh=mesh, rules=rules)
    assert all(a.sharding.is_equivalent_to(mesh_lib.rows(mesh), a.ndim) for a in jax.tree.leaves(got.state))
    print("tokens", int(np.sum(got.tokens != want.tokens)), got.tokens.size)
    print("lengths", int(np.sum(got.lengths != want.lengths)))
    one = speculative_generate(cfg, params, prompts, max_new_tokens=8, eos_id=None)
    many = speculative_generate(cfg, placed, prompts, max_new_tokens=8, eos_id=None, mesh=mesh, rules=rules)
    assert all(a.sharding.is_equivalent_to(mesh_lib.rows(mesh), a.ndim) for a in jax.tree.leaves(many.state))
    print("speculative tokens", int(np.sum(many.tokens != one.tokens)), many.tokens.size)
    print("speculative accepted", int(np.sum(many.accepted != one.accepted)), int(one.steps), int(many.steps))
""")


def test_sharded_generate_and_speculative_decoding_emit_the_one_device_tokens():
    """Greedy decoding of 8 ragged prompts on mesh 2×2×2 (data, tensor, expert), plain and speculative (DSpark
    draft → verify → commit): every new token, count and accepted draft equal to one device's."""
    env = mesh_lib.simulated_cpu_env(8)
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=1200)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert "tokens 0 48" in lines, out.stdout
    assert "lengths 0" in lines, out.stdout
    assert "speculative tokens 0 64" in lines, out.stdout
    spec = next(line for line in lines if line.startswith("speculative accepted")).split()
    assert spec[2] == "0" and spec[3] == spec[4], out.stdout
