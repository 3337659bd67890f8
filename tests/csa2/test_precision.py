"""Where SPEC says fp32, the XLA path asks for it: default-precision float32 matmuls are bfloat16 passes on TPU
and TF32 on some GPUs, so each such product is written with `precision=HIGHEST` under a named scope
`fp32_<op>`, and the lowered HLO must show full operand precision on every dot in those scopes. Lowered under
`jax.default_matmul_precision("default")`, as a user runs it (the suite's conftest raises the default)."""

import jax
import jax.numpy as jnp

from csa2 import model

SCOPES = {  # scope → what SPEC asks in fp32
    "fp32_router": "§9 router scores",
    "fp32_mhc": "§10 mHC mixes and stream mixing",
    "fp32_compressor": "§4 compressor kv and gate (pooling inputs)",
    "fp32_attention": "§3 attention logits and the weighted sum",
    "fp32_indexer": "§5 indexer scores (full scan and gathered) and their accumulation",
}


def _dots_by_scope(hlo: str) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for line in hlo.splitlines():
        if " dot(" in line:
            for scope in SCOPES:
                if f"{scope}/" in line:  # in op_name, "…/fp32_router/dot_general" or, in a nested jit, "fp32_…/"
                    found.setdefault(scope, []).append(line.strip())
    return found


def test_the_spec_fp32_products_lower_at_highest_precision(mini):
    """Forward of mini (Full and Reindex layers, MoE, mHC, compressor) lowered from shapes alone."""
    tokens = jax.ShapeDtypeStruct((1, 16), jnp.int32)
    with jax.default_matmul_precision("default"):
        lowered = model.forward.lower(mini, model.abstract_params(mini), tokens)
    found = _dots_by_scope(lowered.as_text(dialect="hlo", debug_info=True))
    assert set(found) == set(SCOPES), f"no dot found for {sorted(set(SCOPES) - set(found))}"
    for scope, lines in found.items():
        low = [line for line in lines if "operand_precision={highest,highest}" not in line]
        assert not low, f"{SCOPES[scope]}: {len(low)} of {len(lines)} dots below HIGHEST, e.g. {low[0][:300]}"


def test_a_default_precision_product_is_caught():
    """The check itself: a float32 dot at default precision inside an `fp32_` scope is reported."""
    def f(x, w):
        with jax.named_scope("fp32_router"):
            return x @ w

    with jax.default_matmul_precision("default"):
        hlo = jax.jit(f).lower(jnp.ones((2, 2)), jnp.ones((2, 2))).as_text(dialect="hlo", debug_info=True)
    (line,) = _dots_by_scope(hlo)["fp32_router"]
    assert "operand_precision={highest,highest}" not in line
