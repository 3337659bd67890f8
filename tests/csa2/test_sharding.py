"""csa2.sharding: meshes, the rules tables, and a released checkpoint loaded straight into its shards
(on 8 simulated CPU devices, in a subprocess: the device count is fixed when JAX starts)."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from csa2 import sharding
from csa2.config import PRESETS, preset

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", PRESETS)
def test_every_parameter_of_every_preset_has_a_rule(name):
    mesh = sharding.make_mesh({})
    specs = sharding.param_shardings(preset(name), mesh, sharding.rules_for(name))
    assert all(isinstance(s.spec, PartitionSpec) for s in jax.tree.leaves(specs))


def test_the_released_model_splits_over_the_documented_axes():
    """Specs alone (an abstract 8-device mesh): heads, vocab, expert width over `tensor`, experts over `expert`."""
    mesh = jax.sharding.AbstractMesh((1, 8, 8), sharding.MESH_AXES)
    rules = sharding.rules_for("v41_flash")
    cfg = preset("v41_flash")
    assert sharding.spec(("groups", "layers", "q_lora", "heads"), (1, 1, 1280, 32768), mesh, rules, "wq_b") == \
        PartitionSpec(None, None, None, "tensor")
    assert sharding.spec(("experts", "embed", "mlp"), (384, 5120, 2304), mesh, rules, "w1") == \
        PartitionSpec("expert", None, "tensor")
    assert sharding.spec(("vocab", "embed"), (cfg.vocab_size, 5120), mesh, rules, "embed") == PartitionSpec("tensor", None)


@pytest.mark.parametrize("shape, message", [
    ({"data": 2}, r"holds 2 devices but 1 are given"),
    ({"model": 1}, r"mesh axes \['model'\] are unknown"),
    ({"data": 0}, r"must be ≥ 1"),
])
def test_bad_meshes_are_refused(shape, message):
    with pytest.raises(ValueError, match=message):
        sharding.make_mesh(shape)


def test_bad_rules_are_refused_by_parameter_and_axis():
    mesh = jax.sharding.AbstractMesh((1, 2, 8), sharding.MESH_AXES)
    rules = sharding.rules_for("mini")
    with pytest.raises(ValueError, match=r"wq_b: logical axis 'nope' has no rule"):
        sharding.spec(("nope",), (4,), mesh, rules, "wq_b")
    with pytest.raises(ValueError, match=r"w1: dimension 'experts' of size 4 does not split over mesh axis 'expert' of size 8"):
        sharding.spec(("experts", "embed"), (4, 64), mesh, rules, "w1")
    with pytest.raises(ValueError, match=r"mesh axis 'tensor' would shard two dimensions; map 'mlp' to None"):
        sharding.spec(("heads", "mlp"), (4, 4), mesh, rules, "x")
    with pytest.raises(ValueError, match=r"rule 'heads' → 'tensor', but the mesh has axes \('data',\)"):
        sharding.spec(("heads",), (4,), jax.sharding.AbstractMesh((2,), ("data",)), rules, "x")
    with pytest.raises(ValueError, match=r"no rules table for 'huge'"):
        sharding.rules_for("huge")


EIGHT_DEVICES = textwrap.dedent("""
    import sys, tempfile
    import jax, numpy as np
    from flax import nnx
    from csa2 import sharding, model
    from csa2.checkpoints import hf, load_hf, save_hf
    from csa2.config import preset
    assert jax.device_count() == 8
    cfg = preset("mini")
    rng = np.random.default_rng(0)
    tree = jax.tree.map(lambda a: (0.05 * rng.standard_normal(a.shape)).astype(np.float32),
                        nnx.to_pure_dict(model.abstract_params(cfg)))
    path = tempfile.mkdtemp() + "/mini"
    save_hf(hf.as_params(cfg, tree), cfg, path, formats="released")
    _, whole = load_hf(path, cfg)
    whole = jax.tree.map(np.asarray, nnx.to_pure_dict(whole))
    for shape in ({"data": 8}, {"data": 2, "tensor": 2, "expert": 2}, {"tensor": 2, "expert": 4}):
        mesh = sharding.make_mesh(shape)
        rules = sharding.rules_for("mini")
        _, params = load_hf(path, cfg, mesh=mesh, rules=rules)
        got = nnx.to_pure_dict(params)
        want = sharding.param_shardings(cfg, mesh, rules)
        for (p, a), s, w in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want), jax.tree.leaves(whole)):
            assert a.sharding.is_equivalent_to(s, a.ndim), (jax.tree_util.keystr(p), a.sharding, s)
            assert np.asarray(a).tobytes() == w.tobytes(), jax.tree_util.keystr(p)
        w1 = got["groups"][0][0]["moe"]["w1"]
        print(shape, "w1 per-device shard", w1.addressable_shards[0].data.shape, "of", w1.shape)
""")


def test_a_released_checkpoint_loads_straight_into_its_shards_on_8_devices():
    """Three meshes (8×1×1, 2×2×2, 1×2×4; mini's drafter has 4 experts): every parameter comes back with the rules' sharding and the values
    of the single-device load, bit for bit; each device holds only its shard."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    out = subprocess.run([sys.executable, "-c", EIGHT_DEVICES], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert "{'data': 8} w1 per-device shard (1, 1, 8, 64, 64) of (1, 1, 8, 64, 64)" in lines
    assert "{'data': 2, 'tensor': 2, 'expert': 2} w1 per-device shard (1, 1, 4, 64, 32) of (1, 1, 8, 64, 64)" in lines
    assert "{'tensor': 2, 'expert': 4} w1 per-device shard (1, 1, 2, 64, 32) of (1, 1, 8, 64, 64)" in lines
