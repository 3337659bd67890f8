"""Training memory: FSDP over `data` (`csa2.mesh.with_fsdp`), rematerialization (`csa2.remat`) and the bfloat16
policy (`train.step.policy_forward`). The equivalence tests run on 8 simulated CPU devices in a subprocess (the
device count is fixed when JAX starts), each compiled program once."""

import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AbstractMesh, PartitionSpec

from csa2 import mesh as mesh_lib, model
from csa2.layout import layer_groups
from csa2.params import compute_weights
from train import step as train_lib

ROOT = Path(__file__).resolve().parents[2]
MESH = AbstractMesh((2, 2, 2), mesh_lib.MESH_AXES)
FSDP = mesh_lib.with_fsdp(mesh_lib.rules_for("mini"))


@pytest.mark.parametrize("axes, shape, want", [
    (("groups", "layers", "embed", "q_lora"), (4, 2, 64, 96), (None, None, None, "data")),  # the widest free one
    (("groups", "layers", "experts", "embed", "mlp"), (4, 2, 8, 64, 64), (None, None, "expert", "data", "tensor")),
    (("embed", "latent"), (64, 64), ("data", None)),  # equals: the first
    (("groups", "layers", "heads"), (4, 2, 8), (None, None, "tensor")),  # nothing free but the stacking axes
    (("vocab", "embed"), (259, 3), (None, None)),  # nothing data divides: whole over data
    (("engram_rows", "engram_dim"), (1024, 16), (None, "data")),  # a table's rows never split
])
def test_fsdp_splits_each_parameter_on_its_widest_free_dimension(axes, shape, want):
    assert mesh_lib.parameter_spec(axes, shape, MESH, FSDP, "p") == PartitionSpec(*want)
    plain = mesh_lib.parameter_spec(axes, shape, MESH, mesh_lib.rules_for("mini"), "p")
    assert plain == PartitionSpec(*(None if t == "data" else t for t in want))  # FSDP adds only the data split


def test_bad_fsdp_rules_are_refused():
    with pytest.raises(ValueError, match=r"'fsdp' → 'rows'; name one mesh axis"):
        mesh_lib.with_fsdp(mesh_lib.rules_for("mini"), "rows")
    with pytest.raises(ValueError, match=r"rule 'fsdp' → 'data', but the mesh has axes \('tensor',\)"):
        mesh_lib.parameter_spec(("embed",), (64,), AbstractMesh((2,), ("tensor",)), FSDP, "p")


def test_each_policy_wraps_every_layer_body_in_a_checkpoint(mini, mini_params):
    """The remat policy reaches the stack: each scanned layer body (and a body run once) is a `jax.checkpoint` with
    the policy's rule (`nothing_saveable` for "layer"); "none" adds none (the grouped matmul's own blocks are
    checkpoints in every policy)."""
    tokens = jnp.zeros((2, 16), jnp.int32)
    text = {r: str(jax.make_jaxpr(lambda p: model.forward(mini, p, tokens, remat=r)[0])(mini_params))
            for r in ("none", "layer", "attention_moe")}
    bodies = sum(len(group.runs) for group in layer_groups(mini))  # one scanned body per run
    assert text["layer"].count("policy=") == text["none"].count("policy=") + bodies
    assert text["attention_moe"].count("policy=") == text["layer"].count("policy=")
    assert text["layer"].count("nothing_saveable") == bodies and "nothing_saveable" not in text["attention_moe"]


@pytest.mark.parametrize("field, value, message", [
    ("remat", "full", r"TrainConfig.remat='full': use one of \('none', 'layer', 'attention_moe'\)"),
    ("dtype_policy", "float16", r"TrainConfig.dtype_policy='float16': use one of \('float32', 'bfloat16'\)"),
])
def test_bad_memory_settings_are_refused(field, value, message):
    with pytest.raises(ValueError, match=message):
        train_lib.TrainConfig(**{field: value})


def test_the_train_command_takes_the_memory_flags():
    from train import __main__ as cli
    tc = cli.train_config(cli.parse(["--out", "x", "--remat", "attention_moe", "--dtype-policy", "bfloat16"]))
    assert (tc.remat, tc.dtype_policy) == ("attention_moe", "bfloat16")
    assert cli.train_config(cli.parse(["--out", "x"])) == train_lib.TrainConfig()


def test_the_bfloat16_policy_casts_only_the_compute_weights(mini, mini_params):
    """The weights the model reads only through its compute dtype become bfloat16; SPEC's float32 ones (router,
    mHC, norms, sinks, compressor, embeddings, Engram tables) stay float32; the float32 policy changes nothing."""
    cfg, params = train_lib.policy_forward(mini, train_lib.TrainConfig(dtype_policy="bfloat16"), mini_params)
    assert cfg.dtype == "bfloat16" and mini.dtype == "float32"
    cast = {"/".join(map(str, path)) for path, v in nnx.to_flat_state(params) if v.get_value().dtype == jnp.bfloat16}
    names = {p.rsplit("/", 1)[-1] for p in cast}
    assert names == {"wq_a", "wq_b", "wkv", "wo_a", "wo_b", "wq", "ww", "w1", "w2", "w3", "head", "main_proj",
                     "markov_head"}, names
    assert not any(part in p for p in cast for part in ("compressor/", "router", "_hc/", "norm")), cast
    assert "groups/0/0/attn/wkv" in cast and not any(p.endswith("compressor/wkv") for p in cast)
    same = train_lib.policy_forward(mini, train_lib.TrainConfig(), mini_params)
    assert same[0] is mini and same[1] is mini_params
    assert compute_weights(mini_params, "float32") is not mini_params  # a new tree, values as they were
    for (_, a), (_, b) in zip(nnx.to_flat_state(compute_weights(mini_params, "float32")),
                              nnx.to_flat_state(mini_params)):
        assert a.get_value().dtype == b.get_value().dtype


def test_a_bfloat16_train_step_trains_float32_master_weights(mini):
    """Smoke: two steps of the bfloat16 policy keep every parameter and moment float32, give a finite loss near
    ln 259 (the untrained model's), and move the weights. (Its bpb against the float32 policy after training is in
    docs/results.md.)"""
    tc = train_lib.TrainConfig(steps=4, batch_size=2, seq_len=16, warmup=1, dtype_policy="bfloat16")
    state = train_lib.init_train_state(mini, tc)
    before = jax.tree.map(np.asarray, nnx.to_pure_dict(state.params))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 17)), jnp.int32)
    for _ in range(2):
        state, metrics = train_lib.train_step(mini, tc, state, tokens[:, :-1], tokens[:, 1:])
    assert all(a.dtype == jnp.float32 for a in jax.tree.leaves(state.params) + jax.tree.leaves(state.opt_state)
               if jnp.issubdtype(a.dtype, jnp.floating))
    assert np.isfinite(float(metrics["loss"])) and 4.0 < float(metrics["loss"]) < 7.0  # ≈ ln 259 at init
    after = nnx.to_pure_dict(state.params)
    assert float(jnp.max(jnp.abs(after["head"] - before["head"]))) > 1e-4


EQUIVALENCE = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np, optax
    from flax import nnx
    from csa2 import mesh as mesh_lib, model, sharding
    from csa2.presets import preset
    from train import dspark, step as train_lib
    assert jax.device_count() == 8
    cfg = preset("mini")
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (8, 17)), jnp.int32)
    mesh = mesh_lib.make_mesh({"data": 2, "tensor": 2, "expert": 2})
    rules = mesh_lib.with_fsdp(mesh_lib.rules_for("mini"))
    put = lambda x: jax.device_put(x, mesh_lib.rows(mesh))

    def flat(tree):
        return [np.asarray(a, np.float64) for a in jax.tree.leaves(nnx.to_pure_dict(tree) if isinstance(tree, nnx.State)
                                                                  else tree)]

    def train(remat, on_mesh):
        tc = train_lib.TrainConfig(steps=4, batch_size=8, seq_len=16, warmup=1, lr=3e-3, remat=remat)
        state = train_lib.init_train_state(cfg, tc)
        step = lambda *a: train_lib.train_step(cfg, tc, *a)
        feed = lambda x: x
        if on_mesh:
            state = jax.device_put(state, train_lib.train_state_shardings(state, mesh, rules))
            step, feed = (lambda *a: train_lib.train_step.on(mesh, rules)(cfg, tc, *a)), put
        out = {}
        for i in range(2):  # step 0 has lr 0: its first moment is 0.1 × the clipped gradient
            state, metrics = step(state, feed(tokens[:, :-1]), feed(tokens[:, 1:]))
            if i == 0:
                out["loss"], out["grad_norm"] = [float(metrics["loss"])], [float(metrics["grad_norm"])]
                out["gradient"] = flat(optax.tree.get(state.opt_state, "mu"))
        out["params"] = flat(state.params)
        if on_mesh:
            w1, mu = state.params["groups"][0][0]["moe"]["w1"], optax.tree.get(state.opt_state, "mu")
            print("fsdp w1", w1.sharding.spec, mu["groups"][0][0]["moe"]["w1"].sharding.spec)
        return out

    def adapt(on_mesh):
        # Float numerics: the drafter's FP8 context windows would turn a last-ulp difference of the partitioned sums
        # into a whole FP8 step (SPEC §8), as in the fuzz harness (`infer.fuzz`).
        dc = dspark.DSparkTrainConfig(steps=4, batch_size=8, seq_len=16, anchors=2, warmup=1, lr=3e-3, qat=False)
        backbone = model.init_params(cfg, jax.random.PRNGKey(1))
        state = dspark.init_state(cfg, dc, backbone[model.DRAFTER])
        step, feed = (lambda *a: dspark.dspark_step(cfg, dc, *a)), (lambda x: x)
        if on_mesh:
            state = jax.device_put(state, train_lib.train_state_shardings(state, mesh, rules))
            backbone = sharding.shard_params(cfg, backbone, mesh, rules)
            step, feed = (lambda *a: dspark.dspark_step.on(mesh, rules)(cfg, dc, *a)), put
        for i in range(2):
            state, metrics = step(state, backbone, feed(tokens))
            if i == 0:
                out = {"loss": [float(metrics["loss"])], "gradient": flat(optax.tree.get(state.opt_state, "mu"))}
        out["params"] = flat(state.params)
        return out

    def compare(name, got, want):
        for key in want:
            g, w = (np.concatenate([np.ravel(a) for a in run[key]]) for run in (got, want))
            diff = np.abs(g - w)
            rel = float(np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-30))
            print(name, key, f"{diff.max():.3g}", f"{rel:.3g}", f"{np.mean(diff > 1e-5):.3g}")

    reference = train("none", False)
    compare("remat-layer", train("layer", False), reference)
    compare("fsdp+remat-attention_moe", train("attention_moe", True), reference)
    compare("dspark-fsdp", adapt(True), adapt(False))
""")


def test_fsdp_and_remat_train_steps_equal_one_device_on_8_devices():
    """Two train steps with FSDP over `data` on 2×2×2 (data, tensor, expert) with the `attention_moe` remat policy,
    and on one device with the `layer` policy, against one device without remat: the loss, the gradient (step 0's
    AdamW first moment, 0.1 × the clipped gradient) and the parameters after two steps; and two DSpark adaptation
    steps with FSDP against one device (float numerics). Parameters and moments split over `data` as the FSDP
    rules say.

    Tolerances: remat recomputes the same operations, but XLA fuses the recomputing program differently, so float
    sums round differently (the loss by ~1e-7); a top-k selection or FP8/FP4 rounding step near a tie can then
    flip, moving a few gradient entries. So the loss within 1e-5, the gradient within 1e-4 in relative L2 norm,
    and the parameters as the sharding tests hold them: AdamW's second step moves a weight by about lr·sign(g), so
    a gradient within rounding of 0 can move its weight by up to 2·lr, in at most 0.1 % of the weights."""
    env = mesh_lib.simulated_cpu_env(8)
    out = subprocess.run([sys.executable, "-c", EQUIVALENCE], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=1800)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    fsdp = [line for line in lines if line.startswith("fsdp ")]
    assert fsdp == ["fsdp w1 P(None, None, 'expert', 'data', 'tensor') P(None, None, 'expert', 'data', 'tensor')"], fsdp
    print(out.stdout)
    rows = {(r[0], r[1]): tuple(map(float, r[2:])) for r in (line.split() for line in lines if line not in fsdp)}
    runs = {"remat-layer": ("loss", "grad_norm", "gradient", "params"),
            "fsdp+remat-attention_moe": ("loss", "grad_norm", "gradient", "params"),
            "dspark-fsdp": ("loss", "gradient", "params")}
    assert set(rows) == {(run, key) for run, keys in runs.items() for key in keys}, sorted(rows)
    for (run, key), (worst, rel, share) in rows.items():
        if key in ("loss", "grad_norm"):
            assert worst <= 1e-5, (run, key, worst)
        elif key == "gradient":
            assert rel <= 1e-4, (run, key, rel)
        else:
            assert worst <= 2 * 3e-3 and share <= 1e-3, (run, key, worst, share)
