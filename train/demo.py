"""`make demo`: train a small CSA2 model on the embedded corpus, then generate with it.

The one driver that uses both sides: it lives in `train/` and calls `infer.generate` (inference
never imports the trainer).

1. trains the `demo` preset (every CSA2 role, 8 layers) on CPython's `pydoc_data.topics` with the SPEC §8
   numerics (fake-quant from step 0, the training default);
2. saves a checkpoint and reports validation bits per byte (FP4/FP8 numerics, as inference runs them, and float);
3. continues a few prompts in one batched, jitted generation loop (tokens/s after compile);
4. reports KV bytes per token and the prefill token×layer saving of bounded replay (SPEC §11);
5. adapts the DSpark drafter on the frozen backbone (`train.dspark`, SPEC §12) and decodes the prompts
   greedily both ways: plain `generate` and speculative decoding (token-identical, checked);
6. does the same with the research model the package ships (`csa2.checkpoints.bundled("tiny-v41")`: the
   release's 40-layer schedule), plus a pass key 512 tokens back.
The last six lines are machine-readable: `val_bpb` (SPEC §8 numerics), `tokens_per_s`, `kv_bytes_per_token`, then
`spec_tokens_per_s`, `plain_tokens_per_s`, `mean_accept`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import numpy as np

from csa2 import compile_cache, model
from csa2.checkpoints import bundled, load_hf, read_config
from csa2.presets import preset
from csa2.replay import EXACT, ReplayPolicy
from csa2.state import init_state, kv_bytes_per_token
from csa2.tokenizer import decode, encode
from infer import generate
from infer.speculative import speculative_generate
from train.data import load_corpus, passkey_example
from train.dspark import DSparkTrainConfig, adapt
from train.loop import evaluate, train
from train.step import TrainConfig

PROMPTS = ("The with statement", "Boolean operations", "Assignment statements\n", "class ")


def replay_saving(cfg, params, prompt: np.ndarray, window: int) -> dict:
    """Token×layer work of prefilling `prompt` exactly and with a replay window (SPEC §11)."""
    work = {}
    for name, policy in (("exact", EXACT), ("replay", ReplayPolicy(window=window))):
        state = init_state(cfg, 1, prompt.size, "fp4")
        work[name] = int(model.prefill(cfg, params, state, prompt[None], replay=policy)[2]["work"])
    return {"prompt_tokens": int(prompt.size), "window": window, **work, "saving": 1 - work["replay"] / work["exact"]}


def speculative_vs_plain(cfg, params, prompts, max_new_tokens: int, compiled) -> dict:
    """Greedy decoding of `prompts` in one batch, plain (`compiled`: the generate loop of these shapes) and
    speculative, each timed on its second (warm) call; the outputs must be token-identical (SPEC §12)."""
    plan = generate.plan(cfg, prompts, max_new_tokens=max_new_tokens)
    runs = {"plain": lambda: generate.run(cfg, params, plan, compiled),
            "spec": lambda: speculative_generate(cfg, params, prompts, max_new_tokens=max_new_tokens)}
    out = {}
    for name, run in runs.items():
        run()  # compile
        t0 = time.perf_counter()
        res = run()
        jax.block_until_ready(res.state.length)
        out[name] = (res, time.perf_counter() - t0)
    (plain, plain_s), (spec, spec_s) = out["plain"], out["spec"]
    if not (np.array_equal(plain.tokens, spec.tokens) and np.array_equal(plain.lengths, spec.lengths)):
        raise AssertionError("speculative greedy output differs from plain greedy generate")
    return {"plain_tokens_per_s": plain.lengths.sum() / plain_s, "spec_tokens_per_s": spec.lengths.sum() / spec_s,
            "mean_accept": spec.mean_accept, "steps": spec.steps, "tokens": int(spec.lengths.sum()),
            "position_acceptance": np.nan_to_num(spec.position_acceptance).tolist(),
            "texts": [decode(row[:n]) for row, n in zip(plain.tokens, plain.lengths)]}


def shipped_model(max_new_tokens: int) -> None:
    """Print greedy continuations of `PROMPTS` and of a pass-key prompt by the shipped research model
    (`csa2.checkpoints.bundled("tiny-v41")`, loaded as a released checkpoint), plain and speculative."""
    path = bundled("tiny-v41")
    cfg, params = load_hf(path, read_config(path).replace(dtype="float32"))  # float32: the compute of its card
    key_prompt, key = passkey_example(np.random.default_rng(0), 512, 0.5)
    prompts = [encode(text) for text in PROMPTS] + [key_prompt]
    plan = generate.plan(cfg, prompts, max_new_tokens=max_new_tokens)
    spec = speculative_vs_plain(cfg, params, prompts, max_new_tokens, generate.lower(cfg, params, plan).compile())
    print(f"# shipped research model {path.name} ({cfg.num_hidden_layers} layers on the release's schedule, "
          f"d = {cfg.hidden_size}; its card: {path / 'README.md'}), greedy:")
    for text, out in zip(PROMPTS, spec["texts"]):
        print(f"  {text!r} → {out!r}")
    answer = spec["texts"][-1][:key.size]
    print(f"  a pass key 512 tokens back, at half depth: asked {decode(key)!r}, answered {answer!r} "
          f"({'retrieved' if answer == decode(key) else 'missed'})")
    print(f"# speculative greedy decoding on it: {spec['tokens']} tokens in {spec['steps']} steps, identical to "
          f"plain; mean accepted drafts {spec['mean_accept']:.2f} per step; {spec['spec_tokens_per_s']:.1f} vs "
          f"{spec['plain_tokens_per_s']:.1f} tokens/s plain")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m train.demo", description=__doc__)
    p.add_argument("--preset", default="demo")
    p.add_argument("--steps", type=int, default=240)
    p.add_argument("--out", default="runs/demo")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--dspark-steps", type=int, default=100)
    compile_cache.add_argument(p)
    args = p.parse_args(argv)
    compile_cache.enable_cli(p, args.compile_cache)
    t0 = time.perf_counter()
    cfg = preset(args.preset)
    corpus = load_corpus()
    print(f"# training preset {args.preset!r} for {args.steps} steps with the SPEC §8 numerics (QAT) on "
          f"{corpus.train.size:,} bytes (pydoc_data.topics), checkpoints in {args.out}", flush=True)
    tc = TrainConfig(steps=args.steps)  # QAT from step 0: the SPEC §8 numerics generation runs
    state = train(cfg, tc, corpus.train, args.out, log=lambda _: None)
    with open(f"{args.out}/metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    marks = sorted({0, len(records) // 4, len(records) // 2, 3 * len(records) // 4, len(records) - 1})
    print("# loss curve (train bpb): " + ", ".join(f"step {records[i]['step']}: {records[i]['bpb']:.2f}" for i in marks)
          + f"; indexer KL {records[0]['index_kl']:.4f} → {records[-1]['index_kl']:.4f}; plot {args.out}/loss.png")

    val_bpb = evaluate(cfg, state.params, corpus.valid, qat=True)
    val_float = evaluate(cfg, state.params, corpus.valid, qat=False)
    print(f"# validation ({corpus.valid.size:,} bytes): {val_bpb:.3f} bpb FP4/FP8 cache (trained with QAT), "
          f"{val_float:.3f} bpb float")

    prompts = [encode(text) for text in PROMPTS]
    plan = generate.plan(cfg, prompts, max_new_tokens=args.max_new_tokens,
                         sampling=generate.Sampling(temperature=0.7, top_p=0.95), seed=0)
    tc0 = time.perf_counter()
    compiled = generate.lower(cfg, state.params, plan).compile()
    compile_s = time.perf_counter() - tc0
    tr0 = time.perf_counter()
    result = generate.run(cfg, state.params, plan, compiled)
    jax.block_until_ready(result.state.length)
    run_s = time.perf_counter() - tr0
    new_tokens = int(result.lengths.sum())
    tokens_per_s = new_tokens / run_s
    print(f"# generation: {len(prompts)} prompts in one batch, {new_tokens} new tokens, compile {compile_s:.1f}s, "
          f"{tokens_per_s:.1f} tokens/s (prefill + decode loop, temperature 0.7, top-p 0.95)")
    for text, row, n in zip(PROMPTS, result.tokens, result.lengths):
        print(f"  {text!r} → {decode(row[:n])!r}")

    long_prompt = np.concatenate([encode(""), corpus.valid[:1023]]).astype(np.int32)
    saving = replay_saving(cfg, state.params, long_prompt, window=128)
    print(f"# replay prefill of a {saving['prompt_tokens']}-token prompt with R={saving['window']}: "
          f"{saving['replay']:,} token×layer vs {saving['exact']:,} exact ({100 * saving['saving']:.1f}% saved)")
    kv = kv_bytes_per_token(cfg)
    print(f"# Global KV {kv:.1f} B/token for {args.preset} ({kv_bytes_per_token(preset('v41_flash')):.0f} B/token "
          f"for v41_flash)")

    td = time.perf_counter()
    params = adapt(cfg, state.params, corpus.train, DSparkTrainConfig(steps=args.dspark_steps), f"{args.out}/dspark",
                   log=lambda _: None)
    with open(f"{args.out}/dspark/metrics.jsonl") as f:
        last = [json.loads(line) for line in f][-1]
    print(f"# DSpark: drafter adapted on the frozen backbone for {args.dspark_steps} steps in "
          f"{time.perf_counter() - td:.0f}s (loss {last['loss']:.3f}, teacher-forced accepted length "
          f"{last['accept_len']:.2f} of {cfg.dspark_block_size}, ECE {last['ece']:.3f}; "
          f"plot {args.out}/dspark/dspark.png)")
    spec = speculative_vs_plain(cfg, params, prompts, args.max_new_tokens, compiled)
    print(f"# greedy, {len(prompts)} prompts in one batch: {spec['tokens']} tokens in {spec['steps']} speculative "
          f"steps, identical to plain generate; acceptance per draft position "
          + ", ".join(f"{a:.2f}" for a in spec["position_acceptance"])
          + f"; {time.perf_counter() - t0:.0f}s so far")
    shipped_model(args.max_new_tokens)
    print(f"# whole demo {time.perf_counter() - t0:.0f}s")
    print(f"val_bpb: {val_bpb:.4f}")
    print(f"tokens_per_s: {tokens_per_s:.2f}")
    print(f"kv_bytes_per_token: {kv:.1f}")
    print(f"spec_tokens_per_s: {spec['spec_tokens_per_s']:.2f}")
    print(f"plain_tokens_per_s: {spec['plain_tokens_per_s']:.2f}")
    print(f"mean_accept: {spec['mean_accept']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
