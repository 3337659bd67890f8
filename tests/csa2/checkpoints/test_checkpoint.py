"""csa2.checkpoints.native: bit-identical round trips, retention, step selection, config, layout and input checks."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from csa2.checkpoints import native as checkpoint
from csa2.config import ModelConfig
from csa2.layout import layer_groups
from csa2.model import DRAFTER, abstract_params
from csa2.moe import RouterBias
from csa2.presets import preset

CFG = preset("mini")


def assert_bit_identical(got, want):
    """Same pytree structure (NamedTuple types included), dtypes, shapes and bytes."""
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        g, w = np.asarray(g), np.asarray(w)
        assert g.dtype == w.dtype and g.shape == w.shape
        assert g.tobytes() == w.tobytes()


def random_like(tree, seed):
    """Random values (every bit pattern matters) in the shapes and dtypes of an abstract pytree."""
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_map(lambda x: rng.standard_normal(x.shape).astype(x.dtype), tree)


@pytest.fixture(scope="module")
def mini(tmp_path_factory):
    """Random mini params (the `nnx.State` of init_params) and adamw state, saved at steps 1-3 with keep=2.

    Random values instead of running init_params and an update: same pytrees, no compile (tests stay fast).
    """
    abstract = abstract_params(CFG)
    params = random_like(abstract, 0)
    opt_state = random_like(jax.eval_shape(optax.adamw(1e-3).init, abstract), 1)
    directory = tmp_path_factory.mktemp("ckpt") / "run"
    for step in (1, 2, 3):
        checkpoint.save(directory, step, params=params, opt_state=opt_state, data_step=10 * step,
                        rng=jax.random.PRNGKey(step), cfg=CFG,
                        extra={"loss": np.float32(0.5 * step), "tag": ("a", step)}, keep=2)
    return directory, params, opt_state


def small_tree(step):
    """A tiny params-like pytree with float32, bfloat16 and int32 leaves whose values depend on `step`."""
    return {"w": jnp.arange(6, dtype=jnp.float32).reshape(2, 3) / 7 + step,
            "b": (jnp.linspace(-1, 1, 5, dtype=jnp.bfloat16) * step, jnp.array(step, jnp.int32))}


def save_small(directory, step, keep=3):
    params = small_tree(step)
    opt_state = optax.adam(1e-3).init(params)
    checkpoint.save(directory, step, params=params, opt_state=opt_state, data_step=step + 100,
                    rng=jax.random.PRNGKey(step), cfg=CFG, keep=keep)
    return params, opt_state


def variable_types(params):
    return {path: type(v) for path, v in nnx.to_flat_state(params)}


def test_round_trip_is_bit_identical(mini):
    directory, params, opt_state = mini
    assert isinstance(params, nnx.State)
    out = checkpoint.restore(directory, CFG, params_like=params, opt_state_like=opt_state)
    assert isinstance(out["params"], nnx.State)
    assert variable_types(out["params"]) == variable_types(params)
    assert RouterBias in set(variable_types(params).values()) and nnx.Param in set(variable_types(params).values())
    assert out["step"] == 3 and out["data_step"] == 30
    assert out["extra"] == {"loss": 1.5, "tag": ["a", 3]}
    assert_bit_identical(out["params"], params)
    assert_bit_identical(out["opt_state"], opt_state)
    assert isinstance(out["opt_state"][0], optax.ScaleByAdamState)
    assert_bit_identical(out["rng"], jax.random.PRNGKey(3))


def test_keep_deletes_older_steps_and_restore_picks_steps(mini):
    directory, params, opt_state = mini
    assert checkpoint.latest_step(directory) == 3
    assert sorted(p.name for p in directory.iterdir() if p.name.isdigit()) == ["2", "3"]
    out = checkpoint.restore(directory, CFG, params_like=params, opt_state_like=opt_state, step=2)
    assert (out["step"], out["data_step"], out["extra"]["tag"]) == (2, 20, ["a", 2])
    assert_bit_identical(out["rng"], jax.random.PRNGKey(2))
    with pytest.raises(ValueError, match=r"no step 1; available steps: \[2, 3\]"):
        checkpoint.restore(directory, CFG, params_like=params, opt_state_like=opt_state, step=1)


def test_load_config_and_restore_params(mini):
    directory, params, _ = mini
    cfg = checkpoint.load_config(directory)
    assert cfg == CFG and isinstance(cfg, ModelConfig) and isinstance(cfg.compress_ratios, tuple)
    assert cfg.rope_scaling == CFG.rope_scaling
    got_cfg, got = checkpoint.restore_params(directory)
    assert got_cfg == CFG
    assert isinstance(got, nnx.State) and variable_types(got) == variable_types(params)
    assert_bit_identical(got, params)
    got_cfg, _ = checkpoint.restore_params(directory, CFG.replace(kernel_impl="pallas"), step=2)
    assert got_cfg.kernel_impl == "pallas"  # a backend choice is not a different model


def test_runtime_fields_may_differ_on_restore(mini):
    """dtype, kernel_impl and max_draft are RUNTIME: the same parameters, restored bit-identical (float32)."""
    directory, params, opt_state = mini
    runtime = CFG.replace(dtype="bfloat16", kernel_impl="pallas", max_draft=6)
    assert CFG.dtype == "float32"
    got_cfg, got = checkpoint.restore_params(directory, runtime)
    assert got_cfg == runtime
    assert_bit_identical(got, params)
    out = checkpoint.restore(directory, CFG.replace(dtype="bfloat16"), params_like=params, opt_state_like=opt_state)
    assert_bit_identical(out["params"], params)
    assert_bit_identical(out["opt_state"], opt_state)


def test_config_mismatch_names_fields(mini):
    directory, params, opt_state = mini
    other = CFG.replace(hidden_size=128, n_routed_experts=16)
    for call in (lambda: checkpoint.restore(directory, other, params_like=params, opt_state_like=opt_state),
                 lambda: checkpoint.restore_params(directory, other)):
        with pytest.raises(ValueError) as e:
            call()
        msg = str(e.value)
        assert "hidden_size 64 (checkpoint) vs 128 (requested)" in msg
        assert "n_routed_experts 8 (checkpoint) vs 16 (requested)" in msg
        assert "num_hidden_layers" not in msg


def test_variant_mismatch_is_refused_by_name(mini):
    """mhc_single_pass (VARIANT) changes what the parameters compute: refused like a released field."""
    directory, params, opt_state = mini
    other = CFG.replace(mhc_single_pass=not CFG.mhc_single_pass, dtype="bfloat16")
    for call in (lambda: checkpoint.restore(directory, other, params_like=params, opt_state_like=opt_state),
                 lambda: checkpoint.restore_params(directory, other)):
        with pytest.raises(ValueError, match="mhc_single_pass True \\(checkpoint\\) vs False \\(requested\\)") as e:
            call()
        assert "dtype" not in str(e.value)


@pytest.mark.parametrize("layout", [1, None], ids=["layout_1", "no_layout_key"])
def test_checkpoint_of_another_layout_is_refused(tmp_path, layout):
    """A checkpoint written with parameter layout 1 (before the nnx modules; its meta has no "layout" key,
    which reads as 1) is refused by every entry point, with a message naming the layout, before any array is read."""
    directory = tmp_path / "run"
    params, opt_state = save_small(directory, 1)
    meta_file = directory / "1" / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    assert meta["layout"] == checkpoint.LAYOUT == 3
    if layout is None:
        del meta["layout"]
    else:
        meta["layout"] = layout
    meta_file.write_text(json.dumps(meta))
    calls = (lambda: checkpoint.restore(directory, CFG, params_like=params, opt_state_like=opt_state),
             lambda: checkpoint.restore_params(directory),
             lambda: checkpoint.load_config(directory),
             lambda: checkpoint.save(directory, 2, params=params, opt_state=opt_state, data_step=2,
                                     rng=jax.random.PRNGKey(2), cfg=CFG))
    for call in calls:
        with pytest.raises(ValueError, match="layout 1") as e:
            call()
        assert "layouts (2, 3)" in str(e.value) and str(directory) in str(e.value)
    assert checkpoint.latest_step(directory) == 1  # the refused save wrote nothing


def test_a_layout_2_backbone_is_read_for_inference_and_refused_for_resuming(tmp_path, monkeypatch):
    """A backbone saved in layout 2 (each Engram memory inside its layer) comes back from `restore_params` in layout
    3 with every layer's values where layout 3 puts them, found here by walking both layouts' groups; resuming its
    training is refused, since its optimizer state follows the old layout."""
    cfg = preset("tiny")  # the released schedule: layout 2 has ten groups, layout 3 four
    old = random_like(abstract_params(cfg, layout=2), 4)
    directory = tmp_path / "run"
    monkeypatch.setattr(checkpoint, "LAYOUT", 2)
    checkpoint.save(directory, 1, params=old, opt_state=optax.EmptyState(), cfg=cfg)
    monkeypatch.undo()
    _, params = checkpoint.restore_params(directory, cfg)
    assert jax.tree.structure(params) == jax.tree.structure(abstract_params(cfg))

    def by_layer(params, layout):
        out = {}
        for gi, group in enumerate(layer_groups(cfg, layout)):
            for ri, run in enumerate(group.runs):
                for it in range(group.count):
                    for j in range(run.count):
                        run_params = nnx.to_pure_dict(params["groups"][gi][ri])
                        out[group.layer(it, run.offset + j)] = jax.tree.map(lambda a: np.asarray(a[it, j]), run_params)
        return out

    old_layers, new_layers = by_layer(old, 2), by_layer(params, 3)
    for layer in range(cfg.num_hidden_layers):
        engram = old_layers[layer].pop("engram", None)
        assert_bit_identical(new_layers[layer], old_layers[layer])
        if engram is not None:
            k = cfg.engram_layer_ids.index(layer)
            assert_bit_identical(nnx.to_pure_dict(params["engram"][k]), engram)
    for key in ("embed", "norm", "head"):
        assert_bit_identical(params[key], old[key])
    with pytest.raises(ValueError, match="a backbone in parameter layout 2, whose optimizer state follows that "
                                         "layout; this csa2 trains in layout 3"):
        checkpoint.restore(directory, cfg, params_like=abstract_params(cfg), opt_state_like=optax.EmptyState())


def test_saving_another_config_into_a_run_is_refused(tiny, tmp_path):
    save_small(tmp_path / "run", 1)
    with pytest.raises(ValueError, match="num_hidden_layers 8 \\(checkpoint\\) vs 40 \\(requested\\)"):
        checkpoint.save(tmp_path / "run", 2, params=small_tree(2), opt_state=(), data_step=0,
                        rng=jax.random.PRNGKey(0), cfg=tiny)


def test_missing_or_empty_directory(tmp_path):
    like = small_tree(0)
    for directory in (tmp_path / "missing", tmp_path):
        assert checkpoint.latest_step(directory) is None
        for call in (lambda: checkpoint.restore(directory, CFG, params_like=like, opt_state_like=()),
                     lambda: checkpoint.load_config(directory), lambda: checkpoint.restore_params(directory)):
            with pytest.raises(ValueError, match="python -m train --out") as e:
                call()
            assert str(directory) in str(e.value)
    assert not (tmp_path / "missing").exists()


def test_dtypes_preserved_and_mismatches_refused(tmp_path):
    params, opt_state = save_small(tmp_path, 4)
    save_small(tmp_path, 4)  # saving an existing step replaces it
    out = checkpoint.restore(tmp_path, CFG, params_like=params, opt_state_like=opt_state)
    assert out["params"]["b"][0].dtype == jnp.bfloat16 and out["opt_state"][0].mu["b"][0].dtype == jnp.bfloat16
    assert_bit_identical(out["params"], params)
    assert_bit_identical(out["opt_state"], opt_state)
    as_f32 = {**params, "b": (params["b"][0].astype(jnp.float32), params["b"][1])}
    with pytest.raises(ValueError, match=r"params.b.0 bfloat16\[5\] \(checkpoint\) vs float32\[5\] \(requested\)"):
        checkpoint.restore(tmp_path, CFG, params_like=as_f32, opt_state_like=opt_state)
    with pytest.raises(ValueError, match=r"params.w float32\[2, 3\] \(checkpoint\) vs float32\[2, 2\] \(requested\)"):
        checkpoint.restore(tmp_path, CFG, params_like={**params, "w": jnp.zeros((2, 2))}, opt_state_like=opt_state)
    with pytest.raises(ValueError, match=r"train.opt_state.0.count int32\[\] \(checkpoint\) vs absent \(requested\)"):
        checkpoint.restore(tmp_path, CFG, params_like=params, opt_state_like=optax.sgd(1e-3).init(params))


def test_stateless_optimizer_and_bad_arguments(tmp_path):
    params = small_tree(1)
    opt_state = optax.sgd(1e-3).init(params)  # no arrays at all
    checkpoint.save(tmp_path, jnp.int32(1), params=params, opt_state=opt_state, data_step=jnp.int32(1),
                    rng=jax.random.PRNGKey(1), cfg=CFG)  # a train state's jax scalars are accepted
    out = checkpoint.restore(tmp_path, CFG, params_like=params, opt_state_like=opt_state)
    assert out["opt_state"] == opt_state and out["extra"] == {}
    assert (out["step"], out["data_step"]) == (1, 1) and type(out["step"]) is int
    with pytest.raises(ValueError, match="extra must be JSON-serializable"):
        checkpoint.save(tmp_path, 2, params=params, opt_state=opt_state, data_step=2, rng=jax.random.PRNGKey(2),
                        cfg=CFG, extra={"f": object()})
    with pytest.raises(ValueError, match="keep=0"):
        checkpoint.save(tmp_path, 2, params=params, opt_state=opt_state, data_step=2, rng=jax.random.PRNGKey(2),
                        cfg=CFG, keep=0)
    assert checkpoint.latest_step(tmp_path) == 1


def test_a_directory_holds_one_kind(tmp_path):
    """A drafter checkpoint names its kind (a backbone's names none, the format from before drafters); each kind
    is refused where the other is asked for or already saved, and an unknown kind is refused by name."""
    drafter = random_like(abstract_params(CFG)[DRAFTER], 2)
    checkpoint.save(tmp_path / "drafter", 1, params=drafter, cfg=CFG, kind=checkpoint.DRAFTER_KIND)
    meta = json.loads((tmp_path / "drafter" / "1" / "meta" / "metadata").read_text())
    assert (meta["kind"], meta["has_opt_state"], meta["data_step"]) == ("drafter", False, 1)
    _, got = checkpoint.restore_params(tmp_path / "drafter", kind=checkpoint.DRAFTER_KIND)
    assert_bit_identical(got, drafter)
    with pytest.raises(ValueError, match="holds a DSpark drafter, not full-model parameters"):
        checkpoint.restore_params(tmp_path / "drafter")
    with pytest.raises(ValueError, match="holds a DSpark drafter"):
        checkpoint.save(tmp_path / "drafter", 2, params=small_tree(2), opt_state=(), cfg=CFG)
    with pytest.raises(ValueError, match="saved without optimizer state"):
        checkpoint.restore(tmp_path / "drafter", CFG, kind=checkpoint.DRAFTER_KIND, params_like=drafter,
                           opt_state_like=())
    save_small(tmp_path / "backbone", 1)
    assert "kind" not in json.loads((tmp_path / "backbone" / "1" / "meta" / "metadata").read_text())
    with pytest.raises(ValueError, match="holds full-model parameters, not a DSpark drafter"):
        checkpoint.check_dir(tmp_path / "backbone", CFG, checkpoint.DRAFTER_KIND)
    with pytest.raises(ValueError, match="opt_state=None"):
        checkpoint.save(tmp_path / "backbone", 2, params=small_tree(2), cfg=CFG)
    with pytest.raises(ValueError, match="kind='model'"):
        checkpoint.save(tmp_path / "other", 1, params=small_tree(1), opt_state=(), cfg=CFG, kind="model")
    assert checkpoint.latest_step(tmp_path / "backbone") == 1 and checkpoint.latest_step(tmp_path / "other") is None
