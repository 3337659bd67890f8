"""Prefill → decode across workers: the chunked pipeline that ships Global KV while the next chunk computes, the
decode side that waits for the ready barrier, and a two-process run over a socket.

    python -m infer.pd [--preset mini] [--prompt-len 200] [--chunk 64] [--new-tokens 16] [--cache-format fp4]
                       [--replay-window R | --exact] [--no-overlap]

runs a prefill worker and a decode worker as two OS processes on this machine (the prefill worker connects to the
decode worker's loopback port), prints the decode worker's tokens, whether they equal one process's `generate`,
and the bytes and times of the handoff.

The pipeline (`prefill_and_ship`): a prompt is prefilled in chunks (one `Extend` over the whole prompt, so bounded
replay sees the chunks as one call, SPEC §11). After each chunk is dispatched, the Global entries it completed are
sliced on the device (before the next chunk, which donates the state, is dispatched), and the previous chunk's
slices are copied to the host and shipped while the device computes: JAX's asynchronous dispatch is the overlap.
Only complete entries are shipped (`[prev // r, length // r)`); a ratio-r group a chunk leaves unfinished stays in
the compressor tail until a later chunk completes it. The row state (rings, tails, history, draft windows, lengths)
follows the last block, from the final state, so every ring is at one boundary; the receiver's `handoff.receive`
is the barrier. Without overlap (`overlap=False`) the whole package is cut after the last chunk.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from csa2 import compile_cache, model
from csa2.checks import is_int
from csa2.config import ModelConfig
from csa2.replay import EXACT, Extend, ReplayPolicy
from csa2.state import init_state
from infer import handoff, wire
from infer.handoff import Package, Part
from infer.values import pow2

Array = jax.Array


def prefill_and_ship(cfg: ModelConfig, params, prompts: Sequence, *, capacity: int, chunk: int,
                     ship: Callable[[Part], None], replay: ReplayPolicy = ReplayPolicy(), cache_format: str = "fp4",
                     overlap: bool = True, draw_first: bool = True) -> dict:
    """Prefill `prompts` (1-D token arrays, one row each) in chunks of `chunk` columns and hand every part of their
    package to `ship`, in order (Global blocks, then the row state). With `draw_first` the prefill draws each row's
    first new token greedily and the package carries it. Returns `{"first": [n], "parts": count, "bytes": n}`."""
    t0 = time.perf_counter()
    lengths = np.array([len(p) for p in prompts], np.int64)
    if chunk < 1 or lengths.min() < 1 or lengths.max() > capacity:
        raise ValueError(f"prefill_and_ship: chunk={chunk} must be ≥ 1 and every prompt hold 1 … capacity={capacity} "
                         f"tokens (lengths {lengths.tolist()})")
    n, calls = len(prompts), -(-int(lengths.max()) // chunk)
    tokens = np.zeros((n, calls * chunk), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = p
    rows = np.arange(n, dtype=np.int32)
    ratios = handoff.stack_ratios(cfg)
    extend = Extend.cold(jnp.asarray(lengths, jnp.int32))
    state = init_state(cfg, n, capacity, cache_format)
    last, previous = None, None
    shipped = {"parts": 0, "bytes": 0}

    def send(part: Part) -> None:
        ship(part)
        shipped["parts"] += 1
        shipped["bytes"] += part.nbytes

    for c in range(calls):
        before = np.minimum(lengths, c * chunk)
        after = np.minimum(lengths, (c + 1) * chunk)
        cols = jnp.asarray(tokens[:, c * chunk:(c + 1) * chunk])
        logits, state, _ = model.prefill(cfg, params, state, cols, jnp.asarray(after - before, jnp.int32), replay,
                                         extend)
        ends = jnp.asarray((lengths > c * chunk) & (lengths <= (c + 1) * chunk))
        last = logits if last is None else jnp.where(ends[:, None], logits, last)
        if overlap:
            lo, hi = before[:, None] // ratios[None], after[:, None] // ratios[None]
            current = (handoff.global_slices(state, rows, lo, hi), lo, hi, after)  # before the next chunk donates
            if previous is not None:  # the previous chunk's blocks, while this one computes
                send(handoff.global_part(cfg, *previous))
            previous = current
    jax.block_until_ready(last)
    computed = time.perf_counter() - t0
    first = np.asarray(jnp.argmax(last, -1), np.int64) if draw_first else None
    if overlap:
        send(handoff.global_part(cfg, *previous))
        send(handoff.state_part(cfg, state, rows, since=np.zeros(n, np.int64),
                                first=np.full(n, handoff.NO_TOKEN) if first is None else first))
    else:
        for part in handoff.package(cfg, state, rows, first=first).parts:
            send(part)
    return {"first": first, "computed_s": computed, **shipped}


def collect(recv: Callable[[], Part | None], *, max_bytes: int, max_parts: int = 1 << 16) -> Package:
    """The package of the parts `recv` returns (None: the sender closed), up to and including the row state (the
    last part); refused once it holds more than `max_bytes` of arrays or `max_parts` parts (a bound from
    `handoff.package_bytes` for the rows and capacity the receiver has)."""
    parts, total = [], 0
    while True:
        part = recv()
        if part is None:
            raise ValueError(f"collect: the sender stopped after {len(parts)} parts, before the row state; the "
                             "handoff is incomplete")
        parts.append(part)
        total += part.nbytes
        if total > max_bytes or len(parts) > max_parts:
            raise ValueError(f"collect: {len(parts)} parts of {total} bytes exceed max_bytes={max_bytes} or "
                             f"max_parts={max_parts}; the sender is not handing off a request this receiver can hold")
        if part.kind == "state":
            return Package(tuple(parts))


def receive_parts(conn: socket.socket) -> Callable[[], Part | None]:
    """`recv` for `collect`: the next part on `conn`, None once the sender has closed it."""
    def recv() -> Part | None:
        message = wire.recv_message(conn)
        return None if message is None else wire.decode_part(message)
    return recv


def bound(cfg: ModelConfig, rows: int, capacity: int, cache_format: str) -> int:
    """The most array bytes a package of `rows` rows can hold in a state of `capacity` tokens."""
    return rows * handoff.package_bytes(cfg, capacity, cache_format)["total"]


def decode(cfg: ModelConfig, params, package: Package, *, capacity: int, cache_format: str,
           new_tokens: int, max_rows: int = 64) -> np.ndarray:
    """Greedy continuation of a received package: its first tokens, then `new_tokens − 1` decode steps [n, new].
    The package passes the barrier (`handoff.receive`) before anything of it is used; a package of more than
    `max_rows` rows is refused before a state is allocated for it."""
    rows = package.final.meta.get("rows") if isinstance(package.final.meta, dict) else None
    if not is_int(rows) or not 1 <= rows <= max_rows:
        raise ValueError(f"decode: the package has rows={rows!r}; this worker takes 1 … max_rows={max_rows}")
    state = handoff.receive(cfg, package, init_state(cfg, rows, capacity, cache_format), list(range(rows)))
    first = package.first_tokens
    if (first == handoff.NO_TOKEN).any():
        raise ValueError("decode: the package carries no first token; the prefill worker must draw it (draw_first)")
    out = [jnp.asarray(first, jnp.int32)]
    for _ in range(new_tokens - 1):  # tokens stay on the device: no host round trip per step
        logits, state = model.decode_step(cfg, params, state, out[-1])
        out.append(jnp.argmax(logits, -1).astype(jnp.int32))
    return np.asarray(jnp.stack(out, axis=1))


# ---------------------------------------------------------------------------------------------
# Two processes

def random_prompt(cfg: ModelConfig, length: int, seed: int) -> np.ndarray:
    """`length` random byte tokens: the prompt of the two-process runs and the benchmark."""
    return np.random.default_rng(seed).integers(0, min(cfg.vocab_size, 256), length).astype(np.int32)


def replay_policy(args) -> ReplayPolicy:
    """The replay policy of `--exact` / `--replay-window R`."""
    return EXACT if args.exact else ReplayPolicy(window=args.replay_window)


def capacity_for(tokens: int) -> int:
    """The state capacity of a run that holds `tokens` tokens: the power of two at or above."""
    return pow2(tokens)


def _setup(args):
    from csa2.presets import preset
    cfg = preset(args.preset)
    return cfg, model.init_params(cfg, jax.random.PRNGKey(args.init_seed))


def _capacity(args) -> int:
    return capacity_for(args.prompt_len + args.new_tokens)


def run_prefill_worker(args) -> None:
    """Connect to the decode worker, prefill, ship every part."""
    cfg, params = _setup(args)
    with socket.create_connection((args.host, args.port)) as sock:
        info = prefill_and_ship(cfg, params, [random_prompt(cfg, args.prompt_len, args.seed)], capacity=_capacity(args),
                                chunk=args.chunk, replay=replay_policy(args), cache_format=args.cache_format,
                                overlap=not args.no_overlap,
                                ship=lambda part: wire.send_message(sock, wire.encode_part(part)))
    print(json.dumps({"parts": info["parts"], "bytes": info["bytes"]}))


def run_decode_worker(args) -> None:
    """Listen, start the prefill worker, receive its package, decode; print the tokens and the reference's."""
    from infer.generate import generate
    cfg, params = _setup(args)
    server = wire.listen(args.host, 0)
    port = server.getsockname()[1]
    argv = [sys.executable, "-m", "infer.pd", "--role", "prefill", "--port", str(port), *_shared(args)]
    worker = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    # The reference runs while the prefill worker starts and prefills (its blocks wait in the socket's buffer).
    reference = generate(cfg, params, [random_prompt(cfg, args.prompt_len, args.seed)], max_new_tokens=args.new_tokens,
                         eos_id=None, replay=replay_policy(args), cache_format=args.cache_format).tokens
    server.settimeout(600)  # the prefill worker connects once it has started; it never takes this long
    with server:
        conn, _ = server.accept()
    with conn:
        package = collect(receive_parts(conn), max_bytes=bound(cfg, 1, _capacity(args), args.cache_format))
    tokens = decode(cfg, params, package, capacity=_capacity(args), cache_format=args.cache_format,
                    new_tokens=args.new_tokens)
    sent = json.loads(worker.communicate(timeout=600)[0].strip().splitlines()[-1])
    if worker.returncode:
        raise SystemExit(f"the prefill worker failed (exit {worker.returncode})")
    print(json.dumps({"tokens": tokens[0].tolist(), "generate": reference[0].tolist(),
                      "equal": bool(np.array_equal(tokens, reference)), "parts": sent["parts"],
                      "package_bytes": sent["bytes"], "bytes_per_prompt_token": sent["bytes"] / args.prompt_len}))


def _shared(args) -> list[str]:
    out = ["--preset", args.preset, "--init-seed", str(args.init_seed), "--seed", str(args.seed),
           "--prompt-len", str(args.prompt_len), "--chunk", str(args.chunk), "--new-tokens", str(args.new_tokens),
           "--cache-format", args.cache_format, "--host", args.host, "--compile-cache", args.cache_dir or "off"]
    if args.exact:
        out.append("--exact")
    else:
        out += ["--replay-window", str(args.replay_window)]
    return out + (["--no-overlap"] if args.no_overlap else [])


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m infer.pd", description="A prefill → decode handoff between two "
                                 "processes over a loopback socket.")
    ap.add_argument("--role", choices=("decode", "prefill"), default="decode",
                    help="decode (default) starts the prefill worker itself")
    ap.add_argument("--preset", default="mini")
    ap.add_argument("--init-seed", type=int, default=0, help="parameters: init_params(preset, PRNGKey(seed))")
    ap.add_argument("--seed", type=int, default=0, help="the random prompt's seed")
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--cache-format", choices=("fp4", "float"), default="fp4")
    ap.add_argument("--host", default=wire.LOOPBACK, help="the decode worker's address (loopback by default)")
    ap.add_argument("--port", type=int, default=0, help="(prefill role) the decode worker's port")
    replay = ap.add_mutually_exclusive_group()
    replay.add_argument("--replay-window", type=int, default=128, help="decoder replay window R (SPEC §11)")
    replay.add_argument("--exact", action="store_true")
    ap.add_argument("--no-overlap", action="store_true", help="cut the package after the last chunk")
    compile_cache.add_argument(ap)
    return ap


def main(argv=None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    args.cache_dir = compile_cache.enable_cli(parser, args.compile_cache)
    (run_prefill_worker if args.role == "prefill" else run_decode_worker)(args)


if __name__ == "__main__":
    main()
