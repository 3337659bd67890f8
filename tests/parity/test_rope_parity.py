"""Parity of csa2.rope against transformers' DeepSeek-V4 rotary (torch CPU, float32).

V4 and SPEC §7 coincide here: interleaved adjacent pairs on the trailing rope slice,
``main`` = plain θ=10000, ``compress`` = θ=160000 + YaRN with ``attention_factor`` forced
to 1.0 (no mscale), same correction-range/ramp formula (transformers' ``_compute_yarn_parameters``).
"""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers.models.deepseek_v4.modeling_deepseek_v4 as v4
from transformers import DeepseekV4Config

from csa2.config import YarnScaling
from csa2.rope import apply_rope, rope_frequencies

YARN = {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536, "beta_fast": 32, "beta_slow": 1}
OURS_YARN = YarnScaling(16.0, 65536, 32.0, 1.0)


def _rotary(head_dim, rope_dim):
    cfg = DeepseekV4Config(
        hidden_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        head_dim=head_dim,
        qk_rope_head_dim=rope_dim,
        layer_types=["compressed_sparse_attention"],
        mlp_layer_types=["moe"],
        rope_parameters=dict(YARN),
    )
    return v4.DeepseekV4RotaryEmbedding(cfg)


def _ulp_distance(a, b):
    return np.abs(a.astype(np.float32).view(np.int32).astype(np.int64) - b.astype(np.float32).view(np.int32))


@pytest.mark.parametrize("head_dim,rope_dim", [(512, 64), (32, 8), (64, 16)])
def test_frequencies_match(head_dim, rope_dim):
    # transformers evaluates in float32 torch, we round a float64 result: a couple of ulp apart.
    rotary = _rotary(head_dim, rope_dim)
    assert rotary.main_attention_scaling == 1.0 and rotary.compress_attention_scaling == 1.0
    assert _ulp_distance(rope_frequencies(rope_dim, 10000.0), rotary.main_inv_freq.numpy()).max() <= 1
    compress = rope_frequencies(rope_dim, 160000.0, OURS_YARN)
    assert _ulp_distance(compress, rotary.compress_inv_freq.numpy()).max() <= 2


def _reference(rotary, x, pos, layer_type, inverse):
    cos, sin = rotary(x, position_ids=pos, layer_type=layer_type)
    return v4.apply_rotary_pos_emb(x, cos, -sin if inverse else sin, unsqueeze_dim=2).numpy()


@pytest.mark.parametrize("layer_type", ["main", "compress"])
@pytest.mark.parametrize("inverse", [False, True])
def test_apply_matches(layer_type, inverse):
    rotary = _rotary(512, 64)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 6, 3, 96, generator=gen)  # [B, S, H, D]: 32 pass-through + 64 rope channels
    x_j = jnp.asarray(x.numpy())

    # Same frequencies on both sides: the rotation itself must agree at any position (up to 2^20).
    pos = torch.tensor([[0, 1, 2, 127, 4096, 65535], [7, 300, 1 << 16, 1 << 18, 1 << 19, (1 << 20) - 1]])
    hf_freqs = getattr(rotary, f"{layer_type}_inv_freq").numpy()
    ours = apply_rope(x_j, jnp.asarray(pos.numpy(), jnp.int32)[:, :, None], hf_freqs, inverse=inverse)
    ref = _reference(rotary, x, pos, layer_type, inverse)
    np.testing.assert_array_equal(np.asarray(ours)[..., :32], x.numpy()[..., :32])
    np.testing.assert_allclose(np.asarray(ours), ref, atol=1e-5, rtol=0)

    # End to end with our own frequencies: the ulp-level frequency difference turns into an angle
    # error growing with the position (~pos * 1e-8 rad), so compare at moderate positions.
    pos = torch.tensor([[0, 1, 2, 127, 1000, 4095], [7, 300, 511, 2048, 3000, 4000]])
    freqs = rope_frequencies(64, 10000.0) if layer_type == "main" else rope_frequencies(64, 160000.0, OURS_YARN)
    ours = apply_rope(x_j, jnp.asarray(pos.numpy(), jnp.int32)[:, :, None], freqs, inverse=inverse)
    np.testing.assert_allclose(np.asarray(ours), _reference(rotary, x, pos, layer_type, inverse), atol=3e-4, rtol=0)
