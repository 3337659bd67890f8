"""`python -m infer.bench_handoff`: prompt-to-first-decode of a prefill → decode handoff, with and without the chunked
pipeline's overlap, between two processes on this machine.

    python -m infer.bench_handoff [--preset tiny] [--prompt-lens 8192 16384 32768] [--chunk 2048] [--repeats 4]
                                  [--cache-format fp4] [--replay-window 128 | --exact]

This process is the decode worker; it starts a prefill worker (`--role prefill`) that connects to its loopback
port. Per trial the decode worker sends a go message with the prompt length and the mode, and times, on its own
clock, from the go to the end of its first decode step: the prefill (chunks of `--chunk` tokens), the Global
blocks and row state over the socket, the ready barrier and install (`infer.handoff.receive`) and one
`decode_step` from the package's first token. The prefill worker reports when its last chunk's logits were ready
(`prefill_computed_s`, from the start of `prefill_and_ship`, which it calls on the go); the rest is
`after_compute_s`, the part of the handoff the prefill does not hide (with overlap, the earlier blocks are shipped
before the last chunk is ready, so they count as prefill). With overlap (`infer.pd.prefill_and_ship`) each chunk's
completed Global entries are shipped while the next chunk computes; without, the package is cut after the last
chunk. The modes alternate, each prompt length's first trial of each mode compiles and is dropped, and every
figure is a mean over `--repeats` trials with a 95 % bootstrap interval, the overlap's gains as paired
differences (serial − overlap, trial by trial). Also printed: the bytes shipped per prompt token, and a v41_flash
package at 10⁶ tokens next to SPEC §8's 890 B/token. One JSON line per trial and per summary.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from csa2 import compile_cache, model
from csa2.presets import preset
from csa2.state import init_state, kv_bytes_per_token
from infer import handoff, pd, stats, wire
from infer.bench_model import machine_info


def run_prefill_worker(args) -> None:
    """Serve go messages until the decode worker closes: prefill and ship, then report this side's times."""
    cfg = preset(args.preset)
    params = model.init_params(cfg, jax.random.PRNGKey(0))
    with socket.create_connection((wire.LOOPBACK, args.port)) as sock:
        while (go := wire.recv_message(sock)) is not None:
            trial = json.loads(go)
            t0 = time.perf_counter()
            length = trial["length"]
            info = pd.prefill_and_ship(cfg, params, [pd.random_prompt(cfg, length, length)],
                                       capacity=pd.capacity_for(length + 1), chunk=args.chunk,
                                       replay=pd.replay_policy(args), cache_format=args.cache_format,
                                       overlap=trial["overlap"],
                                       ship=lambda part: wire.send_message(sock, wire.encode_part(part)))
            wire.send_message(sock, json.dumps({"prefill_and_ship_s": time.perf_counter() - t0,
                                                "computed_s": info["computed_s"],
                                                "bytes": info["bytes"], "parts": info["parts"]}).encode())


def _trial(cfg, params, conn, length: int, overlap: bool, args) -> dict:
    t0 = time.perf_counter()
    wire.send_message(conn, json.dumps({"length": length, "overlap": overlap}).encode())
    package = pd.collect(pd.receive_parts(conn), max_bytes=pd.bound(cfg, 1, pd.capacity_for(length + 1),
                                                                     args.cache_format))
    t_arrived = time.perf_counter()
    state = handoff.receive(cfg, package, init_state(cfg, 1, pd.capacity_for(length + 1), args.cache_format), [0])
    jax.block_until_ready(state)
    t_ready = time.perf_counter()
    logits, _ = model.decode_step(cfg, params, state, jnp.asarray(package.first_tokens, jnp.int32))
    jax.block_until_ready(logits)
    t_decoded = time.perf_counter()
    sender = json.loads(wire.recv_message(conn))
    return {"length": length, "overlap": overlap, "prompt_to_first_decode_s": t_decoded - t0,
            "package_arrived_s": t_arrived - t0, "barrier_and_install_s": t_ready - t_arrived,
            "decode_step_s": t_decoded - t_ready, "sender_s": sender["prefill_and_ship_s"],
            "prefill_computed_s": sender["computed_s"],
            "after_compute_s": t_decoded - t0 - sender["computed_s"],
            "package_bytes": sender["bytes"], "parts": sender["parts"]}


def run(args) -> None:
    cfg = preset(args.preset)
    params = model.init_params(cfg, jax.random.PRNGKey(0))
    print(json.dumps({"machine": machine_info(), "preset": args.preset, "chunk": args.chunk,
                      "cache_format": args.cache_format, "replay": "exact" if args.exact else args.replay_window}))
    server = wire.listen()
    argv = [sys.executable, "-m", "infer.bench_handoff", "--role", "prefill", "--port",
            str(server.getsockname()[1]), "--preset", args.preset, "--chunk", str(args.chunk), "--cache-format",
            args.cache_format, "--compile-cache", args.cache_dir or "off",
            *(["--exact"] if args.exact else ["--replay-window", str(args.replay_window)])]
    worker = subprocess.Popen(argv)
    with server:
        conn, _ = server.accept()
    with conn:
        for length in args.prompt_lens:
            rows = {True: [], False: []}
            for rep in range(args.repeats + 1):
                for overlap in ((True, False) if rep % 2 else (False, True)):
                    result = _trial(cfg, params, conn, length, overlap, args)
                    print(json.dumps({**result, "warmup": rep == 0}), flush=True)
                    if rep:
                        rows[overlap].append(result)
            _summary(cfg, length, rows, args)
    worker.wait(timeout=60)
    flash = preset("v41_flash")
    size = handoff.package_bytes(flash, 10**6, "fp4")
    print(json.dumps({"v41_flash_package_at_1M_tokens": size, "global_bytes_per_token": size["global"] / 10**6,
                      "spec_global_bytes_per_token": kv_bytes_per_token(flash, "fp4")}))


def _summary(cfg, length: int, rows: dict, args) -> None:
    def interval(values):
        return stats.mean_interval(np.asarray(values, np.float64)).as_dict(3)

    key = "prompt_to_first_decode_s"
    out = {"length": length, "repeats": args.repeats, "package_bytes": rows[True][0]["package_bytes"],
           "bytes_per_prompt_token": round(rows[True][0]["package_bytes"] / length, 1),
           "predicted_bytes": handoff.package_bytes(cfg, length, args.cache_format)["total"]}
    for overlap, name in ((True, "overlap"), (False, "serial")):
        out[name] = {k: interval([r[k] for r in rows[overlap]])
                     for k in (key, "prefill_computed_s", "after_compute_s", "barrier_and_install_s", "decode_step_s")}
    for k in (key, "after_compute_s"):
        out[f"serial_minus_overlap.{k}"] = interval([s[k] - o[k] for s, o in zip(rows[False], rows[True])])
    print(json.dumps({"summary": out}), flush=True)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m infer.bench_handoff", description=__doc__.split("\n")[0])
    ap.add_argument("--role", choices=("decode", "prefill"), default="decode")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[8192, 16384, 32768])
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--cache-format", choices=("fp4", "float"), default="fp4")
    replay = ap.add_mutually_exclusive_group()
    replay.add_argument("--replay-window", type=int, default=128)
    replay.add_argument("--exact", action="store_true")
    compile_cache.add_argument(ap, fallback=False)
    return ap


def main(argv=None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.repeats < 2:
        raise SystemExit(f"--repeats={args.repeats}: an interval needs at least 2 trials per mode")
    args.cache_dir = compile_cache.enable_cli(parser, args.compile_cache, fallback=False)
    (run_prefill_worker if args.role == "prefill" else run)(args)


if __name__ == "__main__":
    main()
