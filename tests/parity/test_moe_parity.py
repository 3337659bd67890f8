"""Parity of csa2's MoE (SPEC §9) against transformers' DeepSeek-V4 `DeepseekV4SparseMoeBlock` (torch CPU, float32).

V4 = SPEC §9 with gate_temp = 1 (research notes /work/notes/hf_v4.md §4): sqrtsoftplus router, correction
bias for selection only, top-k, normalization (+1e-20), × routed_scaling_factor; routed experts with a fused
`gate_up_proj [E, 2I, d]` (gate = rows [:I], up = rows [I:]) and `down_proj [E, d, I]`, gate clamped above,
up clamped on both sides; one always-on shared expert of width I. V4 scales by the routing weight after
`down_proj`, we (like V4.1) before `W2`: the same linear map.

Our random JAX weights are copied into the torch module. The inputs are large enough that the SwiGLU clamps
and the correction bias matter, and the test checks that plausible mistakes (softmax scoring, bias in the
weights, gate clamped on both sides, up not clamped) land far outside the tolerance on the same inputs.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import DeepseekV4Config
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as v4

from csa2.moe import MoE, moe, route
from csa2.presets import preset

ATOL = 1e-5
MUTANT_MIN = 1e-3  # a wrong implementation must miss the reference by at least 100× the tolerance

# `mini` dims (d = 64, 8 experts top-2, I = 64), float32; a small SwiGLU limit so the clamps are active.
CFG = preset("mini").replace(dtype="float32", swiglu_limit=3.0, gate_temp=1.0)


def _params():
    d, e, i = CFG.hidden_size, CFG.n_routed_experts, CFG.moe_intermediate_size
    p = nnx.to_pure_dict(nnx.state(MoE(CFG, rngs=nnx.Rngs(jax.random.key(0)))))
    k = jax.random.split(jax.random.key(1), 8)
    return {
        **p,
        "router": 0.3 * jax.random.normal(k[0], (d, e)),
        "bias": 0.3 * jax.random.normal(k[1], (e,)),
        "w1": 0.5 * jax.random.normal(k[2], (e, d, i)), "w3": 0.5 * jax.random.normal(k[3], (e, d, i)),
        "w2": 0.05 * jax.random.normal(k[4], (e, i, d)),
        "shared": {"w1": 0.5 * jax.random.normal(k[5], (d, i)), "w3": 0.5 * jax.random.normal(k[6], (d, i)),
                   "w2": 0.05 * jax.random.normal(k[7], (i, d))},
    }


def _t(a):
    return torch.from_numpy(np.array(a, np.float32))


def _block(p):
    """A one-layer V4 MoE block with our weights copied in."""
    hf = DeepseekV4Config(
        vocab_size=128, hidden_size=CFG.hidden_size, moe_intermediate_size=CFG.moe_intermediate_size,
        num_hidden_layers=1, n_routed_experts=CFG.n_routed_experts, num_experts_per_tok=CFG.num_experts_per_tok,
        mlp_layer_types=["moe"], routed_scaling_factor=CFG.routed_scaling_factor,
        swiglu_limit=CFG.swiglu_limit)
    hf._experts_implementation = "eager"
    block = v4.DeepseekV4SparseMoeBlock(hf, 0)
    with torch.no_grad():
        block.gate.weight.copy_(_t(p["router"]).T)
        block.gate.e_score_correction_bias.copy_(_t(p["bias"]))
        block.experts.gate_up_proj.copy_(_t(jnp.concatenate([p["w1"], p["w3"]], axis=2).transpose(0, 2, 1)))
        block.experts.down_proj.copy_(_t(p["w2"].transpose(0, 2, 1)))
        block.shared_experts.gate_proj.weight.copy_(_t(p["shared"]["w1"]).T)
        block.shared_experts.up_proj.weight.copy_(_t(p["shared"]["w3"]).T)
        block.shared_experts.down_proj.weight.copy_(_t(p["shared"]["w2"]).T)
    return block


def _run(block, x, router=None):
    """The block's output for `x [B, S, d]`; `router(flat) -> (weights, indices)` replaces its router."""
    with torch.no_grad():
        h = _t(x)
        if router is None:
            return block(h).numpy()
        flat = h.reshape(-1, h.shape[-1])
        weights, indices = router(flat)
        return (block.experts(flat, indices, weights).view(h.shape) + block.shared_experts(h)).numpy()


@pytest.fixture(scope="module")
def case():
    p = _params()
    x = jax.random.normal(jax.random.key(2), (2, 9, CFG.hidden_size))
    return p, x, _block(p)


def test_router_matches(case):
    p, x, block = case
    weights, experts, scores = route(CFG, p, x)
    biased = np.sort(np.asarray(scores + p["bias"]), -1)[:, ::-1]
    k = CFG.num_experts_per_tok
    assert (biased[:, k - 1] - biased[:, k]).min() > 1e-4, "no near-ties at the top-k boundary"
    with torch.no_grad():
        _, hf_w, hf_idx = block.gate(_t(x))
    order = np.argsort(experts, -1)
    hf_order = np.argsort(hf_idx.numpy(), -1)
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(experts), order, -1),
                                  np.take_along_axis(hf_idx.numpy(), hf_order, -1))
    np.testing.assert_allclose(np.take_along_axis(np.asarray(weights), order, -1),
                               np.take_along_axis(hf_w.numpy(), hf_order, -1), atol=1e-6, rtol=0)
    _, unbiased, _ = route(CFG, {**p, "bias": jnp.zeros_like(p["bias"])}, x)
    assert (np.sort(unbiased, -1) != np.sort(experts, -1)).any(), "the correction bias changes some selections"


@pytest.mark.parametrize("dispatch", ["dense", "ragged"])
def test_moe_matches(case, dispatch):
    p, x, block = case
    y, _ = moe(CFG, p, x, dispatch=dispatch)
    ref = _run(block, x)
    assert np.abs(ref).max() > 0.5
    np.testing.assert_allclose(np.asarray(y), ref, atol=ATOL, rtol=0)


def test_mistakes_are_caught(case):
    """Each plausible mistake, run through the oracle, misses our output by far more than the tolerance."""
    p, x, block = case
    y = np.asarray(moe(CFG, p, x)[0])
    limit, rsf, k = CFG.swiglu_limit, CFG.routed_scaling_factor, CFG.num_experts_per_tok
    bias = _t(p["bias"])

    def router(score_fn, bias_in_weights=False):
        def fn(flat):
            s = score_fn(flat @ block.gate.weight.T)
            idx = torch.topk(s + bias, k, dim=-1).indices
            w = (s + bias if bias_in_weights else s).gather(1, idx)
            return w / w.sum(-1, keepdim=True) * rsf, idx
        return fn

    def sqrtsoftplus(z):
        return torch.nn.functional.softplus(z).sqrt()

    def gate_both_sides(gu):
        g, u = gu.chunk(2, dim=-1)
        return torch.nn.functional.silu(g.clamp(-limit, limit)) * u.clamp(-limit, limit)

    def up_unclamped(gu):
        g, u = gu.chunk(2, dim=-1)
        return torch.nn.functional.silu(g.clamp(max=limit)) * u

    assert np.abs(_run(block, x, router(sqrtsoftplus)) - y).max() < ATOL  # the mutants' unmutated router is right
    mutants = {"softmax scoring": _run(block, x, router(lambda z: z.softmax(-1))),
               "sigmoid scoring": _run(block, x, router(torch.sigmoid)),
               "bias in the weights": _run(block, x, router(sqrtsoftplus, bias_in_weights=True))}
    for name, fn in (("gate clamped both sides", gate_both_sides), ("up not clamped", up_unclamped)):
        block.experts._apply_gate = fn
        try:
            mutants[name] = _run(block, x)
        finally:
            del block.experts._apply_gate
    for name, out in mutants.items():
        assert np.abs(out - y).max() > MUTANT_MIN, name
    np.testing.assert_allclose(y, _run(block, x), atol=ATOL, rtol=0)
