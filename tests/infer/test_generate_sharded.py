"""The generate loop on a device mesh (`infer.generate.Sharded`), on 8 simulated CPU devices in a subprocess:
the same tokens as one device, the state split over `data`."""

import subprocess
import sys
import textwrap
from pathlib import Path

from csa2 import sharding

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import jax, numpy as np
    from csa2 import model, sharding
    from csa2.presets import preset
    from infer import generate as gen

    cfg = preset("mini")
    params = model.init_params(cfg, jax.random.PRNGKey(0))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, n) for n in (5, 9, 3, 12, 7, 1, 10, 4)]  # ragged: one bucket, PAD tails
    p = gen.plan(cfg, prompts, max_new_tokens=6, eos_id=None)
    want = gen.run(cfg, params, p)
    mesh = sharding.make_mesh({"data": 2, "tensor": 2, "expert": 2})
    rules = sharding.rules_for("mini")
    got = gen.Sharded(cfg, mesh, rules).run(sharding.shard_params(cfg, params, mesh, rules), p)
    assert all(a.sharding.is_equivalent_to(sharding.rows(mesh), a.ndim) for a in jax.tree.leaves(got.state))
    print("tokens", int(np.sum(got.tokens != want.tokens)), got.tokens.size)
    print("lengths", int(np.sum(got.lengths != want.lengths)))
""")


def test_sharded_generate_emits_the_one_device_tokens():
    """Greedy decoding of 8 ragged prompts on mesh 2×2×2 (data, tensor, expert): every new token and count equal."""
    env = sharding.simulated_cpu_env(8)
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "tokens 0 48" in out.stdout.splitlines(), out.stdout
    assert "lengths 0" in out.stdout.splitlines(), out.stdout
