"""`csa2.checkpoints.layouts`: a directory of either layout opens by what it holds."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from csa2 import model
from csa2.checkpoints import layouts, native, save_hf
from csa2.config import model_differences
from csa2.presets import preset

CFG = preset("mini")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    params = model.init_params(CFG, jax.random.PRNGKey(0))
    root = tmp_path_factory.mktemp("layouts")
    save_hf(params, CFG, root / "released")  # float32: bit for bit
    native.save(root / "native", 3, params=params, opt_state=optax.sgd(1e-3).init(params), data_step=0,
                rng=jax.random.PRNGKey(0), cfg=CFG)
    return root, params


@pytest.mark.parametrize("kind", ["released", "native"])
def test_either_layout_loads_the_same_parameters(saved, kind):
    root, params = saved
    path = root / kind
    assert layouts.is_released(path) == (kind == "released")
    assert model_differences(layouts.load_config(path), CFG) == ()
    cfg, loaded = layouts.load(path, CFG)
    assert cfg == CFG
    for a, b in zip(jax.tree.leaves(nnx.to_pure_dict(loaded)), jax.tree.leaves(nnx.to_pure_dict(params))):
        np.testing.assert_array_equal(a, b)


def test_a_step_is_refused_for_a_released_directory(saved):
    root, _ = saved
    with pytest.raises(ValueError, match="step=3: .* is a released checkpoint"):
        layouts.load(root / "released", CFG, step=3)
    assert layouts.load_config(root / "native", step=3) == CFG
