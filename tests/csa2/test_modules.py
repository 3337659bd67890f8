"""Parameters are declared by flax.nnx modules (DESIGN §2): types, logical axes, the stacked layout, display."""

import contextlib
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from csa2 import model
from csa2.engram import PackedRows, engram_table_rows
from csa2.engram_vocab import DefaultTable
from csa2.layout import layer_groups, layer_plan
from csa2.moe import RouterBias, bias_update
from csa2.params import Fill, Normal, arrays, initialize
from csa2.stack import layer_params
from pallas_kernels.formats import WINDOW
from pallas_kernels.stored import Stored


def _variables(params):
    return nnx.to_flat_state(params)


def test_init_params_returns_the_model_state(mini, mini_params):
    assert isinstance(mini_params, nnx.State)
    assert set(mini_params.keys()) == {"embed", "groups", "engram", "norm", "head", model.DRAFTER}
    kinds = {}
    for path, v in _variables(mini_params):
        kinds[path] = type(v)
        router_bias = path[-2:] in (("moe", "bias"), ("moe", "bias_vl"))
        assert isinstance(v, RouterBias) == router_bias, path
        assert isinstance(v, nnx.Param) != router_bias, path
    runs = len([r for g in layer_groups(mini) for r in g.runs])
    assert sum(t is RouterBias for t in kinds.values()) == 2 * (runs + mini.num_nextn_predict_layers)


def test_every_parameter_names_its_logical_axes(tiny_params):
    for path, v in _variables(tiny_params):
        axes = v.get_metadata()["out_sharding"]
        assert len(axes) == v.get_value().ndim and all(isinstance(a, str) for a in axes), (path, axes)
        if path[0] == "groups":
            assert axes[:2] == ("groups", "layers"), (path, axes)
    spec = nnx.get_partition_spec(tiny_params)
    assert tuple(spec["embed"].get_value()) == ("vocab", "embed")


def test_layout_follows_the_layer_groups(tiny, tiny_params):
    for g, group in enumerate(layer_groups(tiny)):
        for r, run in enumerate(group.runs):
            lead = {v.get_value().shape[:2] for _, v in nnx.to_flat_state(tiny_params["groups"][g][r])}
            assert lead == {(group.count, run.count)}, (g, r, lead)
    plan, p = layer_plan(tiny), arrays(tiny_params)
    for spec in plan:  # every layer's parameters are where the groups say, with its role's pieces
        lp = layer_params(tiny, p, spec.index)
        assert ("compressor" in lp["attn"]) == (spec.role == "full")
        assert ("indexer" in lp["attn"]) == (spec.role in ("full", "reindex"))
        assert "engram" not in lp
    assert [tiny_params["engram"][k]["table"].shape[0] for k in range(2)] == [  # tables differ in rows: unstacked
        engram_table_rows(tiny, layer) for layer in tiny.engram_layer_ids]


def test_a_key_draws_the_values_it_drew_in_layout_2(tiny, tiny_params):
    """`init_params` draws in parameter layout 2 (each Engram memory inside its layer, an Engram layer a group of its
    own) and moves the values: every layer holds what `initialize` draws at its place in layout 2."""
    old = arrays(initialize(model.abstract_params(tiny, layout=2), jax.random.PRNGKey(1)))  # tiny_params's key
    new = arrays(tiny_params)
    for gi, group in enumerate(layer_groups(tiny, 2)):
        for ri, run in enumerate(group.runs):
            for it in range(group.count):
                for j in range(run.count):
                    layer = group.layer(it, run.offset + j)
                    drawn = jax.tree.map(lambda a: a[it, j], old["groups"][gi][ri])
                    if "engram" in drawn:
                        k = tiny.engram_layer_ids.index(layer)
                        jax.tree.map(np.testing.assert_array_equal, new["engram"][k], drawn.pop("engram"))
                    jax.tree.map(np.testing.assert_array_equal, layer_params(tiny, new, layer), drawn)


def test_layers_are_initialized_independently(tiny, tiny_params):
    """Every stacked layer gets its own part of its leaf's draw."""
    p = arrays(tiny_params)
    w = [np.asarray(layer_params(tiny, p, i)["attn"]["wq_a"]) for i in (3, 4, 9)]
    assert not np.allclose(w[0], w[1]) and not np.allclose(w[0], w[2])


def test_every_leaf_holds_a_draw_of_its_declared_initializer(tiny, tiny_params):
    """Normal(std) leaves have mean 0 and standard deviation std (to 5 standard errors of the estimate), Fill
    leaves are that value, the vocabulary table is its default; the abstract state has the same structure."""
    assert jax.tree.structure(model.abstract_params(tiny)) == jax.tree.structure(tiny_params)
    kinds = set()
    for path, v in _variables(tiny_params):
        init, x = v.get_metadata()["init"], np.asarray(v.get_value(), np.float64)
        kinds.add(type(init))
        if isinstance(init, Normal):
            n = x.size
            assert abs(x.mean()) < 5 * init.std / np.sqrt(n), path
            assert abs(x.std() / init.std - 1) < 5 / np.sqrt(2 * n) + 1e-6, path
        elif isinstance(init, Fill):
            assert np.all(x == init.value), path
        else:
            np.testing.assert_array_equal(x, init(None, x.shape), err_msg=str(path))
    assert kinds == {Normal, Fill}  # tiny has no vocabulary table and float Engram rows


def test_init_is_a_function_of_the_key_and_each_leafs_own_path(mini, mini_params):
    """Same key, same values; another key, other values; a leaf's values do not depend on the other leaves (a model
    with wider experts keeps every leaf but the experts')."""
    again, other = model.init_params(mini, jax.random.PRNGKey(0)), model.init_params(mini, jax.random.PRNGKey(1))
    for (path, a), (_, b), (_, c) in zip(_variables(mini_params), _variables(again), _variables(other)):
        np.testing.assert_array_equal(a.get_value(), b.get_value(), err_msg=str(path))
        if isinstance(a.get_metadata()["init"], Normal):
            assert not np.array_equal(a.get_value(), c.get_value()), path
    wider = dict(_variables(model.init_params(mini.replace(moe_intermediate_size=2 * mini.moe_intermediate_size),
                                              jax.random.PRNGKey(0))))
    for path, v in _variables(mini_params):
        if path[-1] not in ("w1", "w2", "w3"):
            np.testing.assert_array_equal(wider[path].get_value(), v.get_value(), err_msg=str(path))
    typed = model.init_params(mini, jax.random.key(0))
    np.testing.assert_array_equal(typed["embed"].get_value(), mini_params["embed"].get_value())


def test_packed_engram_rows_are_the_float_twins_rows_packed(mini):
    """`engram_table_format="fp8"`: payload and scales pack the one draw the float model holds as its table; the
    compressed vocabulary table is its default."""
    cfg = mini.replace(engram_head_dim=32)
    packed_cfg = cfg.replace(engram_table_format="fp8", engram_compressed_vocab_size=cfg.vocab_size - 6,
                             engram_pad_id=0)
    floats = nnx.to_flat_state(model.init_params(cfg, jax.random.PRNGKey(5)))
    packed = dict(nnx.to_flat_state(model.init_params(packed_cfg, jax.random.PRNGKey(5))))
    tables = [(path, v) for path, v in floats if path[0] == "engram" and path[-1] == "table"]
    assert tables
    for path, v in tables:
        want = Stored.quantized(v.get_value(), WINDOW)
        assert isinstance(packed[path].get_metadata()["init"], PackedRows)
        np.testing.assert_array_equal(packed[path].get_value(), want.payload)
        np.testing.assert_array_equal(packed[path[:-1] + ("table_scale",)].get_value(), want.scale)
    vocab = packed[("engram_vocab",)]
    assert vocab.get_metadata()["init"] == DefaultTable.of(packed_cfg)
    np.testing.assert_array_equal(vocab.get_value()[-7:], [packed_cfg.vocab_size - 7] + [0] * 6)


def test_init_params_under_jit_and_vmap_draws_the_same_values(mini, mini_params):
    """A traced key draws through a host callback when the program runs: jit and vmap give the eager values."""
    jitted = jax.jit(lambda k: model.init_params(mini, k))(jax.random.PRNGKey(0))
    stacked = jax.vmap(lambda k: model.init_params(mini, k))(jnp.stack([jax.random.PRNGKey(7), jax.random.PRNGKey(0)]))
    for (path, a), (_, b), (_, c) in zip(_variables(mini_params), _variables(jitted), _variables(stacked)):
        np.testing.assert_array_equal(b.get_value(), a.get_value(), err_msg=str(path))
        np.testing.assert_array_equal(c.get_value()[1], a.get_value(), err_msg=str(path))
    with pytest.raises(ValueError, match="key: dtype int32"):
        model.init_params(mini, jnp.zeros(2, jnp.int32))


def test_display_and_tabulate_tiny(tiny, tiny_params):
    module = model.as_module(tiny, tiny_params)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        nnx.display(module)
    assert "RouterBias" in out.getvalue() and "wq_a" in out.getvalue()
    table = nnx.tabulate(module, jnp.zeros((1, 8), jnp.int32))
    total = sum(v.get_value().size for _, v in _variables(tiny_params))
    assert "Model" in table and "RouterBias" in table and f"{total:,}" in table


def test_module_call_is_forward(mini, mini_params):
    tokens = jax.random.randint(jax.random.PRNGKey(0), (2, 6), 0, 256, jnp.int32)
    np.testing.assert_array_equal(model.as_module(mini, mini_params)(tokens),
                                  model.forward(mini, mini_params, tokens)[0])


def test_update_router_bias_moves_each_layers_bias_by_its_load(mini, mini_params):
    load = jax.random.uniform(jax.random.PRNGKey(3), (mini.num_hidden_layers, mini.n_routed_experts))
    new = model.update_router_bias(mini, mini_params, load, 0.25)
    before, after = arrays(mini_params), arrays(new)
    for layer in range(mini.num_hidden_layers):
        old_bias = layer_params(mini, before, layer)["moe"]["bias"]
        # One layer's [E] load against the stacked [count, run, E] update: the means reduce arrays of other
        # shapes, equal to float rounding (the sign rule only flips for a load within rounding of the mean).
        np.testing.assert_allclose(layer_params(mini, after, layer)["moe"]["bias"],
                                   bias_update(old_bias, load[layer], 0.25), rtol=0, atol=1e-6)
    moved = {path for (path, a), (_, b) in zip(_variables(mini_params), _variables(new))
             if not np.array_equal(a.get_value(), b.get_value())}
    assert moved and all(path[-2:] == ("moe", "bias") for path in moved)
    assert all(type(a) is type(b) for (_, a), (_, b) in zip(_variables(mini_params), _variables(new)))
