"""csa2.mesh and csa2.sharding: meshes, the rules tables, the entry points compiled for a mesh
(`EntryPoint.on`), and a released checkpoint loaded straight into its shards (on 8 simulated CPU devices, in a
subprocess: the device count is fixed when JAX starts)."""

import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec

from csa2 import mesh as mesh_lib, model, sharding
from csa2.presets import PRESETS, preset

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", PRESETS)
def test_every_parameter_of_every_preset_has_a_rule(name):
    """Each parameter's spec maps every logical axis it declares through the preset's rules table, one entry per
    dimension; heads and experts are split (over `tensor`, `expert`) in every preset."""
    mesh = mesh_lib.make_mesh({})
    rules = mesh_lib.rules_for(name)
    cfg = preset(name)
    shardings = sharding.param_shardings(cfg, mesh, rules)
    abstract = model.abstract_params(cfg)
    declared = nnx.to_pure_dict(nnx.get_partition_spec(abstract))
    shapes = nnx.to_pure_dict(abstract)
    got = jax.tree.leaves(shardings)
    axes = jax.tree.leaves(declared, is_leaf=lambda x: isinstance(x, PartitionSpec))
    assert len(got) == len(axes) == len(jax.tree.leaves(shapes))
    for sharded, logical, shape in zip(got, axes, jax.tree.leaves(shapes)):
        assert len(logical) == shape.ndim, (logical, shape.shape)
        assert sharded.mesh == mesh
        assert sharded.spec == PartitionSpec(*(None if a is None else rules[a] for a in logical)), (logical, sharded)
    used = {t for s in got for t in s.spec if t is not None}
    assert {"tensor", "expert"} <= used, used


def test_the_released_model_splits_over_the_documented_axes(v41_flash):
    """Specs alone (an abstract 8-device mesh): heads, vocab, expert width over `tensor`, experts over `expert`."""
    mesh = jax.sharding.AbstractMesh((1, 8, 8), mesh_lib.MESH_AXES)
    rules = mesh_lib.rules_for("v41_flash")
    cfg = v41_flash
    assert mesh_lib.spec(("groups", "layers", "q_lora", "heads"), (1, 1, 1280, 32768), mesh, rules, "wq_b") == \
        PartitionSpec(None, None, None, "tensor")
    assert mesh_lib.spec(("experts", "embed", "mlp"), (384, 5120, 2304), mesh, rules, "w1") == \
        PartitionSpec("expert", None, "tensor")
    assert mesh_lib.spec(("vocab", "embed"), (cfg.vocab_size, 5120), mesh, rules, "embed") == \
        PartitionSpec("tensor", None)
    assert mesh_lib.spec(("groups", "layers", "engram_rows", "engram_dim"), (1, 1, 384_016_682, 256), mesh, rules,
                         "engram table") == PartitionSpec(None, None, None, "expert")


def test_a_rule_may_split_one_dimension_over_several_mesh_axes():
    mesh = jax.sharding.AbstractMesh((1, 2, 4), mesh_lib.MESH_AXES)
    rules = {"engram_dim": ("tensor", "expert"), "embed": None}
    assert mesh_lib.spec(("engram_dim", "embed"), (16, 3), mesh, rules, "t") == \
        PartitionSpec(("tensor", "expert"), None)
    with pytest.raises(ValueError, match=r"dimension 'engram_dim' of size 12 does not split over mesh axis "
                                         r"\('tensor', 'expert'\) of size 8"):
        mesh_lib.spec(("engram_dim",), (12,), mesh, rules, "t")
    with pytest.raises(ValueError, match=r"mesh axis 'expert' would shard two dimensions"):
        mesh_lib.spec(("engram_dim", "experts"), (8, 4), mesh, {**rules, "experts": "expert"}, "t")


@pytest.mark.parametrize("shape, message", [
    ({"data": 2}, r"holds 2 devices but 1 are given"),
    ({"model": 1}, r"mesh axes \['model'\] are unknown"),
    ({"data": 0}, r"must be ≥ 1"),
])
def test_bad_meshes_are_refused(shape, message):
    with pytest.raises(ValueError, match=message):
        mesh_lib.make_mesh(shape)


def test_bad_rules_are_refused_by_parameter_and_axis(mini):
    mesh = jax.sharding.AbstractMesh((1, 2, 8), mesh_lib.MESH_AXES)
    rules = mesh_lib.rules_for("mini")
    with pytest.raises(ValueError, match=r"wq_b: logical axis 'nope' has no rule"):
        mesh_lib.spec(("nope",), (4,), mesh, rules, "wq_b")
    with pytest.raises(ValueError, match=r"w1: dimension 'experts' of size 4 does not split over mesh axis "
                                         r"'expert' of size 8"):
        mesh_lib.spec(("experts", "embed"), (4, 64), mesh, rules, "w1")
    with pytest.raises(ValueError, match=r"mesh axis 'tensor' would shard two dimensions; map 'mlp' to None"):
        mesh_lib.spec(("heads", "mlp"), (4, 4), mesh, rules, "x")
    with pytest.raises(ValueError, match=r"rule 'heads' → 'tensor', but the mesh has axes \('data',\)"):
        mesh_lib.spec(("heads",), (4,), jax.sharding.AbstractMesh((2,), ("data",)), rules, "x")
    with pytest.raises(ValueError, match=r"no rules table for 'huge'"):
        mesh_lib.rules_for("huge")
    with pytest.raises(ValueError, match=r"'mlp' → 'expert', but the MoE's expert-parallel shard_map reads 'mlp' on "
                                         r"mesh axis 'tensor'; map it to 'tensor' or None"):
        sharding.param_shardings(mini, mesh_lib.make_mesh({}), {**rules, "mlp": "expert"})


EXPERT_PARALLEL = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    from csa2 import mesh as mesh_lib, moe
    from csa2.presets import preset
    cfg = preset("mini")
    params = nnx.to_pure_dict(nnx.state(moe.MoE(cfg, nnx.Rngs(0))))
    x = jax.random.normal(jax.random.PRNGKey(1), (8, 5, cfg.hidden_size))
    run = jax.jit(lambda p, x: moe.moe(cfg, p, x))
    grad = jax.jit(jax.grad(lambda p, x: jnp.sum(moe.moe(cfg, p, x)[0] ** 2), argnums=(0, 1)))
    want = run(params, x), grad(params, x)
    for shape in ({"data": 2, "tensor": 2, "expert": 2}, {"tensor": 2, "expert": 4}, {"expert": 8}):
        mesh = mesh_lib.make_mesh(shape)
        with jax.set_mesh(mesh):
            got = run(params, x), grad(params, x)
            parallel = "sdy.manual_computation" in run.lower(params, x).as_text()
        scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(want[1]))  # gradients: relative
        print(shape, parallel, float(jnp.max(jnp.abs(got[0][0] - want[0][0]))),
              float(jnp.max(jnp.abs(got[0][1] - want[0][1]))),
              max(float(jnp.max(jnp.abs(g - w))) for g, w in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1])))
              / scale)
""")


def test_expert_parallel_moe_equals_one_device_with_its_gradients():
    """Under a mesh with an `expert` axis the MoE runs in a shard_map (each device its experts, one psum):
    output, load and every gradient (router, biases, experts, shared expert, input) as on one device."""
    env = mesh_lib.simulated_cpu_env(8)
    out = subprocess.run([sys.executable, "-c", EXPERT_PARALLEL], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert len(lines) == 3, out.stdout
    for line in lines:
        parallel, y, load, grads = line.rsplit(" ", 4)[1:]
        assert parallel == "True", line
        assert float(y) <= 1e-5 and float(load) == 0.0 and float(grads) <= 1e-5, line


EIGHT_DEVICES = textwrap.dedent("""
    import sys, tempfile
    import jax, numpy as np
    from flax import nnx
    from csa2 import mesh as mesh_lib, model, sharding
    from csa2.checkpoints import hf, load_hf, save_hf
    from csa2.presets import preset
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
        mesh = mesh_lib.make_mesh(shape)
        rules = mesh_lib.rules_for("mini")
        _, params = load_hf(path, cfg, mesh=mesh, rules=rules)
        got = nnx.to_pure_dict(params)
        want = sharding.param_shardings(cfg, mesh, rules)
        for (p, a), s, w in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want),
                                jax.tree.leaves(whole)):
            assert a.sharding.is_equivalent_to(s, a.ndim), (jax.tree_util.keystr(p), a.sharding, s)
            assert np.asarray(a).tobytes() == w.tobytes(), jax.tree_util.keystr(p)
        w1 = got["groups"][0][0]["moe"]["w1"]
        print(shape, "w1 per-device shard", w1.addressable_shards[0].data.shape, "of", w1.shape)
""")


def test_a_released_checkpoint_loads_straight_into_its_shards_on_8_devices():
    """Three meshes (8×1×1, 2×2×2, 1×2×4; mini's drafter has 4 experts): every parameter comes back with the rules'
    sharding and the values of the single-device load, bit for bit; each device holds only its shard."""
    env = mesh_lib.simulated_cpu_env(8)
    out = subprocess.run([sys.executable, "-c", EIGHT_DEVICES], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert "{'data': 8} w1 per-device shard (1, 1, 8, 64, 64) of (1, 1, 8, 64, 64)" in lines
    assert "{'data': 2, 'tensor': 2, 'expert': 2} w1 per-device shard (1, 1, 4, 64, 32) of (1, 1, 8, 64, 64)" in lines
    assert "{'tensor': 2, 'expert': 4} w1 per-device shard (1, 1, 2, 64, 32) of (1, 1, 8, 64, 64)" in lines


ENTRY_POINTS = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np, optax
    from flax import nnx
    from csa2 import mesh as mesh_lib, model, sharding
    from csa2.presets import preset
    from csa2.state import init_state
    from train import step as train_lib

    # Prefill + decode on every mesh; the rest on the mesh with all three axes and on one other (compiles are most
    # of this test's time): forward on pure data parallelism, training, verify and commit on tensor × 4 experts.
    ALL = {"forward", "train", "verify"}
    MESHES = (({"data": 8}, {"forward"}), ({"data": 2, "tensor": 2, "expert": 2}, ALL),
              ({"tensor": 2, "expert": 4}, {"train", "verify"}))
    cfg, tc = preset("mini"), train_lib.TrainConfig(steps=4, batch_size=8, seq_len=16, warmup=1, lr=3e-3)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, 256, (8, 17)), jnp.int32)
    prompt, steps = tokens[:, :12], tokens[:, 12:]
    block = jnp.asarray(rng.integers(0, 256, (8, 4)), jnp.int32)
    accept = jnp.asarray(rng.integers(0, 5, (8,)), jnp.int32)

    def run(api, train_step, params, state, train, put, parts):
        out = {}
        if "forward" in parts:
            out["forward"] = api.forward(params, put(tokens))[0]
        if "train" in parts:
            for step in range(2):  # the warm-up's first step has lr 0
                train, metrics = train_step(train, put(tokens[:, :-1]), put(tokens[:, 1:]))
                if step == 0:
                    out["train_loss"], out["train_grad_norm"] = metrics["loss"], metrics["grad_norm"]
            out["train_step"] = train.params
        logits, state, _ = api.prefill(params, state, put(prompt), numerics="float")
        out["prefill"] = logits
        for i in range(2):
            logits, state = api.decode_step(params, state, put(steps[:, i]), numerics="float")
        out["decode_step"] = logits
        if "verify" in parts:
            logits, state = api.verify(params, state, put(block), numerics="float")
            state = model.commit(state, put(accept), put(block[:, 0]))
            out["verify"], out["commit"] = logits, state
        return out, train, state

    class OnMesh:  # the entry points compiled for a mesh, with OneDevice's calls
        def __init__(self, mesh, rules):
            self.forward = lambda params, tokens: model.forward.on(mesh, rules)(cfg, params, tokens)
            self.prefill = lambda *a, **k: model.prefill.on(mesh, rules)(cfg, *a, **k)
            self.decode_step = lambda *a, **k: model.decode_step.on(mesh, rules)(cfg, *a, **k)
            self.verify = lambda *a, **k: model.verify.on(mesh, rules)(cfg, *a, **k)

    class OneDevice:
        forward = staticmethod(lambda params, tokens: model.forward(cfg, params, tokens))
        prefill = staticmethod(lambda *a, **k: model.prefill(cfg, *a, **k))
        decode_step = staticmethod(lambda *a, **k: model.decode_step(cfg, *a, **k))
        verify = staticmethod(lambda *a, **k: model.verify(cfg, *a, **k))

    params = model.init_params(cfg, jax.random.PRNGKey(0))
    # The float numerics on a float cache: the SPEC §8 ones would turn 1e-7 differences into whole FP8/FP4 rounding
    # steps of a rare element (the fuzz harness's sharded property explains those, `infer.fuzz`).
    want, _, _ = run(OneDevice, lambda *a: train_lib.train_step(cfg, tc, *a), params, init_state(cfg, 8, 64, "float"),
                     train_lib.init_train_state(cfg, tc), lambda x: x, ALL)
    want = jax.tree.map(np.asarray,
                        {k: nnx.to_pure_dict(v) if isinstance(v, nnx.State) else v for k, v in want.items()})
    for shape, parts in MESHES:
        mesh = mesh_lib.make_mesh(shape)
        rules = mesh_lib.rules_for("mini")
        name = "x".join(str(mesh.shape[a]) for a in mesh_lib.MESH_AXES)
        put = lambda x: jax.device_put(x, mesh_lib.rows(mesh))
        api = OnMesh(mesh, rules)
        train_step = lambda *a: train_lib.train_step.on(mesh, rules)(cfg, tc, *a)
        sharded = sharding.shard_params(cfg, params, mesh, rules)
        state = sharding.init_state(cfg, 8, 64, mesh, "float")
        lowered = model.decode_step.on(mesh, rules).lower(cfg, sharded, state, put(steps[:, 0])).as_text()
        print("expert-parallel", name, "sdy.manual_computation" in lowered)
        train = train_lib.init_train_state(cfg, tc)
        train_shardings = train_lib.train_state_shardings(train, mesh, rules)
        train = jax.device_put(train, train_shardings)
        got, train, state = run(api, train_step, sharded, state, train, put, parts)
        for a, s in zip(jax.tree.leaves(train), jax.tree.leaves(train_shardings)):
            assert a.sharding.is_equivalent_to(s, a.ndim), (a.sharding, s)
        shardings = sharding.param_shardings(cfg, mesh, rules)
        for a, s in zip(jax.tree.leaves(nnx.to_pure_dict(train.params)), jax.tree.leaves(shardings)):
            assert a.sharding.is_equivalent_to(s, a.ndim), (a.sharding, s)
        if "train" in parts:
            mu = optax.tree.get(train.opt_state, "mu")  # AdamW's first moment
            w1, mu_w1 = train.params["groups"][0][0]["moe"]["w1"], mu["groups"][0][0]["moe"]["w1"]
            assert mu_w1.sharding.is_equivalent_to(w1.sharding, w1.ndim), (mu_w1.sharding, w1.sharding)
        for a in jax.tree.leaves(state):
            assert a.sharding.is_equivalent_to(mesh_lib.rows(mesh), a.ndim), a.sharding
        got = jax.tree.map(np.asarray,
                           {k: nnx.to_pure_dict(v) if isinstance(v, nnx.State) else v for k, v in got.items()})
        for key in got:
            pairs = zip(jax.tree.leaves(got[key]), jax.tree.leaves(want[key]))
            diffs = np.concatenate([np.abs(g.astype(np.float64) - w).ravel() for g, w in pairs])
            print(f"{key} {name} {diffs.max():.3g} {np.mean(diffs > 1e-5):.3g}")
""")


def test_sharded_entry_points_equal_the_single_device_ones_on_8_devices():
    """forward, a train step, prefill + decode, verify + commit (the float numerics on a float cache) through
    `EntryPoint.on(mesh, rules)` (explicit in/out shardings) on meshes 8×1×1, 2×2×2 and 1×2×4 (data, tensor,
    expert): within 1e-5 of one device. Prefill + decode run on every mesh, the rest on 2×2×2 and one other mesh
    (forward on 8×1×1; training, verify and commit on 1×2×4). The meshes with an expert axis run the MoE
    expert-parallel (a shard_map in the lowered program); parameters, optimizer moments and every state leaf
    keep their shardings.

    AdamW's second step amplifies last-ulp differences of the partitioned sums, so the trained weights are held to
    what that can cost: it moves each weight by ~lr·sign(g), so a gradient within rounding of 0 can move its weight
    by up to 2·lr."""
    env = mesh_lib.simulated_cpu_env(8)
    out = subprocess.run([sys.executable, "-c", ENTRY_POINTS], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=1200)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert {line for line in lines if line.startswith("expert-parallel")} == {
        "expert-parallel 8x1x1 False", "expert-parallel 2x2x2 True", "expert-parallel 1x2x4 True"}
    rows = [line.split() for line in lines if not line.startswith("expert-parallel")]
    worst = {(r[0], r[1]): float(r[2]) for r in rows}
    share = {(r[0], r[1]): float(r[3]) for r in rows}  # share of values off by more than 1e-5
    names = {"8x1x1": ("forward", "prefill", "decode_step"),
             "2x2x2": ("forward", "train_loss", "train_grad_norm", "train_step", "prefill", "decode_step", "verify",
                       "commit"),
             "1x2x4": ("train_loss", "train_grad_norm", "train_step", "prefill", "decode_step", "verify", "commit")}
    assert set(worst) == {(n, m) for m, ns in names.items() for n in ns}
    for (name, mesh), err in worst.items():
        if name == "train_step":
            assert err <= 2 * 3e-3 and share[name, mesh] <= 1e-3, (name, mesh, err, share[name, mesh])
        else:
            assert err <= 1e-5, (name, mesh, err)
