"""indexer_scores_gathered (Reindex): every backend of `ops.BACKENDS` against `reference` and an independent
numpy oracle (gather the ids' keys, Σ_h w_h·relu(q_h·k), −inf where id < 0, id ≥ N or id ≥ visible), the
kernel's block size, argument checks, gradient, lowering."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import indexer as pk_indexer, ops, reference
from pallas_kernels.formats import INDEX
from pallas_kernels.stored import Stored
from tests.pallas_kernels.cases import (
    TOL,
    check_score_grads,
    check_scores,
    indexer_case,
    np_entries,
    np_gather,
    np_index_scores,
    same_topk,
    traced,
)

OP = "indexer_scores_gathered"


def _oracle(q, w, ikey, ids, visible):
    keys, found = np_gather(np_entries(ikey), ids)  # [B, S, P, Di]
    valid = found & (np.asarray(ids) < np.asarray(visible)[..., None])
    return np.where(valid, np_index_scores(q, w, keys), -np.inf), valid


def test_backends_table_covers_every_impl():
    assert set(ops.BACKENDS[OP]) == set(ops.IMPLS)
    assert ops.BACKENDS[OP]["xla"] is reference.indexer_scores_gathered


@pytest.mark.parametrize("impl", ops.IMPLS)
@pytest.mark.parametrize("packed", [True, False])
def test_reindex_matches_reference_and_oracle(impl, packed):
    q, w, ikey, ids, visible = indexer_case(5, b=2, s=3, hi=4, di=64, n=30, pool=21, packed=packed)
    ids = ids.at[0, 1].set(-1).at[1, 0, 3].set(40)  # an all-invalid pool row; an id ≥ N
    want, valid = _oracle(q, w, ikey, ids, visible)
    assert (~valid).all(-1)[0, 1] and not valid[1, 0, 3]
    ref = reference.indexer_scores_gathered(q, w, ikey, ids, visible)
    got = ops.indexer_scores_gathered(q, w, ikey, ids, visible, impl=impl)
    for x in (ref, got):
        check_scores(x, want, valid)
    same_topk(got, ref, valid, 5)


@pytest.mark.parametrize("impl", ops.IMPLS)
def test_empty_pool_and_visible_zero(impl):
    q, w, ikey, ids, visible = indexer_case(12, b=2, s=2, hi=2, di=32, n=10, pool=6)
    assert ops.indexer_scores_gathered(q, w, ikey, ids[..., :0], visible, impl=impl).shape == (2, 2, 0)
    out = ops.indexer_scores_gathered(q, w, ikey, ids, jnp.zeros_like(visible), impl=impl)
    assert np.all(np.isneginf(np.asarray(out)))


# --- the Pallas kernel's own parameters -------------------------------------------------------------

@pytest.mark.parametrize("seed", [21, 22])
def test_indexer_scores_gathered_random_shapes(seed):
    rng = np.random.default_rng(seed)
    b, s, n, pool = int(rng.integers(1, 3)), int(rng.integers(1, 6)), int(rng.integers(1, 70)), int(rng.integers(1, 30))
    q, w, ikey, ids, visible = indexer_case(seed, b=b, s=s, hi=int(rng.integers(1, 5)), di=32, n=n, pool=pool)
    k = int(rng.integers(1, n + 1))
    rng.choice([1, 2, 4]), rng.choice([8, 16, 64])  # the draws of indexer_scores' block sizes (same stream)
    got = pk_indexer.indexer_scores_gathered(q, w, ikey, ids, visible, interpret=True,
                                             block_p=int(rng.choice([4, 8, 32])))
    ref = reference.indexer_scores_gathered(q, w, ikey, ids, visible)
    np.testing.assert_allclose(got, ref, **TOL)
    same_topk(got, ref, ~np.isneginf(np.asarray(ref)), min(k, pool))
    check_scores(got, *_oracle(q, w, ikey, ids, visible))


# --- the TPU form: SMEM ids, row DMAs, double-buffered VMEM (TPU interpreter on CPU; Mosaic lowering) -----

@pytest.mark.parametrize("packed,block_p", [(True, 8), (False, 8), (True, 256)])
def test_tpu_form_matches_oracle(packed, block_p):
    q, w, ikey, ids, visible = indexer_case(16, b=2, s=3, hi=4, di=64, n=30, pool=21, packed=packed)
    ids = ids.at[0, 1].set(-1).at[1, 0, 3].set(40).at[1, 2, 0].set(2 ** 30)  # all-invalid row; ids ≥ N
    got = pk_indexer.indexer_scores_gathered(q, w, ikey, ids, visible, target="tpu_interpret", block_p=block_p)
    check_scores(got, *_oracle(q, w, ikey, ids, visible))
    np.testing.assert_array_equal(got, reference.indexer_scores_gathered(q, w, ikey, ids, visible))


# --- gradient ---------------------------------------------------------------------------------------

def test_pallas_gradient_is_the_reference_gradient():
    """ops' custom_vjp: d/dq and d/dw through impl="pallas" equal those through impl="xla"."""
    q, w, ikey, ids, visible = indexer_case(13, b=2, s=3, hi=4, di=32, n=25, pool=9)
    r = jnp.asarray(np.random.default_rng(14).standard_normal(ids.shape), jnp.float32)
    scores = lambda q, w, impl: ops.indexer_scores_gathered(q, w, ikey, ids, visible, impl=impl)  # noqa: E731
    check_score_grads(scores, r, q, w)


# --- checks, lowering -------------------------------------------------------------------------------

def test_bad_arguments_raise():
    q, w, ikey, ids, visible = indexer_case(15, b=1, s=2, hi=2, di=32, n=8, pool=4)
    with pytest.raises(ValueError, match="impl"):
        ops.indexer_scores_gathered(q, w, ikey, ids, visible, impl="cuda")
    for impl in ops.IMPLS:
        with pytest.raises(ValueError, match="ids"):
            ops.indexer_scores_gathered(q, w, ikey, ids[0], visible, impl=impl)
        with pytest.raises(ValueError, match="ids"):
            ops.indexer_scores_gathered(q, w, ikey, ids.astype(jnp.float32), visible, impl=impl)
        with pytest.raises(ValueError, match=r"ikey\.scale"):
            ops.indexer_scores_gathered(q, w, Stored(ikey.payload, ikey.scale[..., :0], INDEX), ids, visible,
                                        impl=impl)
    with pytest.raises(ValueError, match="block_p"):
        pk_indexer.indexer_scores_gathered(q, w, ikey, ids, visible, block_p=3)


@pytest.mark.parametrize("target,platform,shape,block_p", [
    ("triton", "cuda", dict(b=1, s=1, hi=32, pool=2048), 128),
    ("mosaic", "tpu", dict(b=2, s=4, hi=64, pool=1024), 256),  # the TPU form: SMEM ids, row DMAs
])
def test_kernel_lowers(target, platform, shape, block_p):
    """Pallas → Triton IR (CUDA) / Mosaic (TPU) at real V4.1 dims (Di 128), lowered on this CPU host (no
    PTX or TPU compile)."""
    sd = jax.ShapeDtypeStruct
    b, s, hi, n = shape["b"], shape["s"], shape["hi"], 4096
    ikey = Stored(sd((b, n, 64), jnp.uint8), sd((b, n, 4), jnp.float8_e8m0fnu), INDEX)
    t = traced(pk_indexer.indexer_scores_gathered, sd((b, s, hi, 128), jnp.float32), sd((b, s, hi), jnp.float32),
                                                  ikey, sd((b, s, shape["pool"]), jnp.int32), sd((b, s), jnp.int32),
                                                  target=target, block_p=block_p, num_warps=4)
    text = t.lower(lowering_platforms=(platform,)).as_text()
    if target == "triton":
        assert "__gpu$xla.gpu.triton" in text
    else:
        assert text.count("tpu_custom_call") == 1 and "csa2_indexer_scores_gathered_tpu" in text
