"""Decode-step benchmark of one attention group: sparse CSA2 vs dense shared-KV attention.

    python -m pallas_kernels.bench [--contexts 4096,8192,...] [--reps 3] [--kernels]

One JSON line per measurement (DESIGN §8), ratios measured side by side in the same run, at the
real V4.1 attention dims: latent 512, 64 heads, indexer 32 × 128, top-k 512, window 128, batch 1.
A decoder group (ratio 1: N Global entries at context N) = one Full layer (indexer over all N
entries, top-k, sparse attention) + 3 Reuse layers (sparse attention with the same top-k), each
with its own query and FP8 window. The dense baseline attends all N entries of the same packed
Main KV (dequantized once per step, shared by the 4 layers) plus each layer's window.

- every backend: `decode_group` (sparse XLA vs dense XLA) and `topk` (lax.top_k vs approx_max_k).
- on GPU, or anywhere with `--kernels`: `decode_group_pallas` (Pallas vs XLA step) and `kernel` lines
  with achieved bytes/s against the HBM roofline for the bytes each kernel must read. On CPU the kernels
  run in the Pallas interpreter, so those lines are a sanity check that the path runs, not a speed.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import formats, ops, reference
from pallas_kernels.stored import Stored

HEADS, LATENT, INDEX_HEADS, INDEX_DIM, TOPK, WINDOW, LAYERS = 64, 512, 32, 128, 512, 128, 4
DEFAULT_CONTEXTS = (4096, 8192, 16384, 32768, 65536, 131072)
# Peak HBM bandwidth (bytes/s) by device kind substring, for the roofline fraction.
HBM_PEAK = {"H200": 4.8e12, "H100": 3.35e12, "H800": 3.35e12, "A100": 2.0e12, "L40S": 0.864e12, "L4": 0.3e12}
RECALL_TARGET = 0.95


def _bytes(key, shape, lo, hi):
    """Random bytes in [lo, hi)."""
    return jax.random.randint(key, shape, lo, hi, jnp.int32).astype(jnp.uint8)


def make_group(context: int, seed: int = 0) -> dict:
    """Random but well-formed packed caches (SPEC §8 bits, `Stored`) and queries of one decode step at
    `context` entries; `window` holds the 4 layers' windows on a leading axis."""
    k = jax.random.split(jax.random.key(seed), 10)
    n, d, di = context, LATENT, INDEX_DIM
    return dict(
        q=jax.random.normal(k[1], (LAYERS, 1, 1, HEADS, d), jnp.float32),
        sink=jax.random.normal(k[2], (HEADS,), jnp.float32),
        main=Stored(_bytes(k[3], (1, n, d // 2), 0, 256),
                    _bytes(k[4], (1, n, d // 16), 0x28, 0x38), formats.MAIN),  # e4m3 scales in [2^-2, 2^0)
        window=Stored(_bytes(k[0], (LAYERS, 1, WINDOW, d), 0, 256) & 0xBF,  # e4m3 |x| < 2, never NaN
                      _bytes(k[5], (LAYERS, 1, WINDOW, d // 32), 120, 128), formats.WINDOW),
        window_idx=jnp.broadcast_to(jnp.arange(WINDOW, dtype=jnp.int32), (1, 1, WINDOW)),
        qi=jax.random.normal(k[6], (1, 1, INDEX_HEADS, di), jnp.float32),
        w=jax.random.normal(k[7], (1, 1, INDEX_HEADS), jnp.float32) * (di * INDEX_HEADS) ** -0.5,
        ikey=Stored(_bytes(k[8], (1, n, di // 2), 0, 256), _bytes(k[9], (1, n, di // 32), 120, 128), formats.INDEX),
        visible=jnp.full((1, 1), n, jnp.int32),
    )


def _layer_window(g: dict, i: int) -> Stored:
    return jax.tree.map(lambda a: a[i], g["window"])


def select(scores):
    """Top-k entry ids [B, S, TOPK] of the indexer scores, −1 where fewer are visible."""
    vals, ids = lax.top_k(scores, TOPK)
    return jnp.where(jnp.isneginf(vals), -1, ids).astype(jnp.int32)


def sparse_step(g: dict, impl: str):
    """Full (indexer + top-k + attention) and 3 Reuse layers (attention with the same top-k)."""
    top = select(ops.indexer_scores(g["qi"], g["w"], g["ikey"], g["visible"], impl=impl))
    return jnp.stack([ops.sparse_attention(g["q"][i], g["sink"], g["main"], top, _layer_window(g, i), g["window_idx"],
                                           impl=impl) for i in range(LAYERS)])


def dense_step(g: dict):
    """The 4 layers attend every entry of the shared Main KV (dequantized once) plus their window."""
    kv = g["main"].decode()[0]  # [N, D]
    scale = LATENT**-0.5
    sink = g["sink"]
    outs = []
    for i in range(LAYERS):
        q = g["q"][i][0, 0]  # [H, D]
        win = _layer_window(g, i).decode()[0]  # [W, D]
        lm = jnp.einsum("hd,nd->hn", q, kv, precision=lax.Precision.HIGHEST) * scale
        lw = jnp.einsum("hd,wd->hw", q, win, precision=lax.Precision.HIGHEST) * scale
        m = jnp.maximum(jnp.maximum(lm.max(-1), lw.max(-1)), sink)
        pm, pw = jnp.exp(lm - m[:, None]), jnp.exp(lw - m[:, None])
        o = (jnp.einsum("hn,nd->hd", pm, kv, precision=lax.Precision.HIGHEST)
             + jnp.einsum("hw,wd->hd", pw, win, precision=lax.Precision.HIGHEST))
        outs.append(o / (pm.sum(-1) + pw.sum(-1) + jnp.exp(sink - m))[:, None])
    return jnp.stack(outs)


def timed(fn, *args, reps: int) -> tuple[float, float]:
    """(compile seconds, median milliseconds per call) of `jax.jit(fn)(*args)`."""
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    compile_s = time.perf_counter() - t0
    jax.block_until_ready(compiled(*args))  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append((time.perf_counter() - t0) * 1e3)
    return compile_s, statistics.median(times)


def machine() -> dict:
    dev = jax.devices()[0]
    return {"backend": jax.default_backend(), "device": dev.device_kind, "host": platform.machine(),
            "jax": jax.__version__}


def group_line(context: int, g: dict, reps: int) -> dict:
    sc, sparse_ms = timed(lambda g: sparse_step(g, "xla"), g, reps=reps)
    dc, dense_ms = timed(dense_step, g, reps=reps)
    return {"bench": "decode_group", **machine(), "context": context, "entries": context, "layers": "full+3reuse",
            "heads": HEADS, "latent": LATENT, "indexer": [INDEX_HEADS, INDEX_DIM], "topk": TOPK, "window": WINDOW,
            "sparse_xla_ms": round(sparse_ms, 3), "dense_xla_ms": round(dense_ms, 3),
            "sparse_over_dense": round(sparse_ms / dense_ms, 4),
            "compile_s": {"sparse": round(sc, 2), "dense": round(dc, 2)}}


def topk_line(context: int, g: dict, reps: int) -> dict:
    """Exact lax.top_k vs lax.approx_max_k on the Full layer's scores; recall of the approximate set."""
    scores = reference.indexer_scores(g["qi"], g["w"], g["ikey"], g["visible"])
    _, exact_ms = timed(lambda s: lax.top_k(s, TOPK)[1], scores, reps=reps)
    _, approx_ms = timed(lambda s: lax.approx_max_k(s, TOPK, recall_target=RECALL_TARGET)[1], scores, reps=reps)
    exact = set(jax.device_get(lax.top_k(scores, TOPK)[1]).ravel().tolist())
    approx = set(jax.device_get(lax.approx_max_k(scores, TOPK, recall_target=RECALL_TARGET)[1]).ravel().tolist())
    return {"bench": "topk", **machine(), "context": context, "k": TOPK, "top_k_ms": round(exact_ms, 3),
            "approx_max_k_ms": round(approx_ms, 3), "approx_over_exact": round(approx_ms / exact_ms, 4),
            "recall_target": RECALL_TARGET, "recall": len(exact & approx) / TOPK}


def kernel_lines(context: int, g: dict, reps: int) -> list[dict]:
    """Pallas vs XLA for the group step and per kernel, with bytes/s vs the HBM roofline (GPU; on CPU the
    interpreter, a sanity line)."""
    kind = jax.devices()[0].device_kind
    peak = next((v for key, v in HBM_PEAK.items() if key in kind), None)
    _, xla_ms = timed(lambda g: sparse_step(g, "xla"), g, reps=reps)
    pc, pallas_ms = timed(lambda g: sparse_step(g, "pallas"), g, reps=reps)
    lines = [{"bench": "decode_group_pallas", **machine(), "context": context, "sparse_xla_ms": round(xla_ms, 3),
              "sparse_pallas_ms": round(pallas_ms, 3), "pallas_over_xla": round(pallas_ms / xla_ms, 4),
              "compile_s": round(pc, 2)}]
    top = jax.jit(select)(reference.indexer_scores(g["qi"], g["w"], g["ikey"], g["visible"]))
    attn_args = (g["q"][0], g["sink"], g["main"], top, _layer_window(g, 0), g["window_idx"])
    idx_args = (g["qi"], g["w"], g["ikey"], g["visible"])
    # Bytes each kernel must move: gathered/streamed payload + scales, ids, queries, output.
    attn_bytes = (TOPK * (LATENT // 2 + LATENT // 16 + 4) + WINDOW * (LATENT + LATENT // 32 + 4)
                  + 2 * HEADS * LATENT * 4 + HEADS * 4)
    idx_bytes = context * (INDEX_DIM // 2 + INDEX_DIM // 32 + 4) + INDEX_HEADS * (INDEX_DIM + 1) * 4
    for name, fn, args, nbytes in (("sparse_attention", ops.sparse_attention, attn_args, attn_bytes),
                                   ("indexer_scores", ops.indexer_scores, idx_args, idx_bytes)):
        times = {impl: timed(lambda *a, impl=impl: fn(*a, impl=impl), *args, reps=reps)[1]
                 for impl in ("xla", "pallas")}
        gbps = {impl: nbytes / (ms * 1e-3) / 1e9 for impl, ms in times.items()}
        lines.append({"bench": "kernel", **machine(), "kernel": name, "context": context, "bytes": nbytes,
                      "xla_ms": round(times["xla"], 4), "pallas_ms": round(times["pallas"], 4),
                      "pallas_over_xla": round(times["pallas"] / times["xla"], 4),
                      "xla_GBps": round(gbps["xla"], 1), "pallas_GBps": round(gbps["pallas"], 1),
                      "hbm_peak_GBps": None if peak is None else peak / 1e9,
                      "pallas_roofline_frac": None if peak is None else round(gbps["pallas"] * 1e9 / peak, 4)})
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default=",".join(map(str, DEFAULT_CONTEXTS)),
                        help="comma-separated context lengths (Global entries of the decoder group)")
    parser.add_argument("--reps", type=int, default=3, help="timed calls per measurement (median reported)")
    parser.add_argument("--kernels", action="store_true",
                        help="also time the Pallas kernels off GPU (on CPU: the interpreter, a sanity line)")
    args = parser.parse_args(argv)
    contexts = [int(c) for c in args.contexts.split(",") if c]
    if any(c < TOPK for c in contexts):
        raise ValueError(f"--contexts={args.contexts}: every context must be ≥ top-k {TOPK}")
    for context in contexts:
        g = make_group(context)
        print(json.dumps(group_line(context, g, args.reps)), flush=True)
        print(json.dumps(topk_line(context, g, args.reps)), flush=True)
        if args.kernels or jax.default_backend() == "gpu":
            for line in kernel_lines(context, g, args.reps):
                print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
