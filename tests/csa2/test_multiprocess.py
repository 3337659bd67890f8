"""Two processes on one machine (`jax.distributed` over loopback, CPU collectives by gloo), two CPU devices
each, on one mesh `data=2 × expert=2`: `data` splits the batch across the processes and `expert` the routed
experts within each. A sharded train step and prefill + decode equal one device's results."""

import socket
import subprocess
import sys
import textwrap
from pathlib import Path

from csa2 import mesh as mesh_lib

ROOT = Path(__file__).resolve().parents[2]

PROCESS = textwrap.dedent("""
    import sys
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{sys.argv[2]}", num_processes=2, process_id=int(sys.argv[1]))
    import jax.numpy as jnp, numpy as np
    from flax import nnx
    from jax.experimental import multihost_utils
    from csa2 import mesh as mesh_lib, model, sharding
    from csa2.presets import preset
    from csa2.state import init_state
    from train import step as train_lib

    assert jax.process_count() == 2 and jax.device_count() == 4 and jax.local_device_count() == 2
    cfg, tc = preset("mini"), train_lib.TrainConfig(steps=4, batch_size=4, seq_len=16, warmup=1, lr=3e-3)
    rng = np.random.default_rng(0)  # the same batch in both processes
    tokens = rng.integers(0, 256, (4, 17)).astype(np.int32)
    inputs, targets, prompt, step = tokens[:, :-1], tokens[:, 1:], tokens[:, :12], tokens[:, 12]

    mesh = mesh_lib.make_mesh({"data": 2, "expert": 2})
    rules = mesh_lib.rules_for("mini")
    put = lambda x: jax.device_put(x, mesh_lib.rows(mesh))
    train = train_lib.init_train_state(cfg, tc)
    train = jax.device_put(train, train_lib.train_state_shardings(train, mesh, rules))
    for _ in range(2):  # the warm-up's first step has lr 0
        train, metrics = train_lib.train_step.on(mesh, rules)(cfg, tc, train, put(inputs), put(targets))
    params = sharding.shard_params(cfg, model.init_params(cfg, jax.random.PRNGKey(0)), mesh, rules)
    state = sharding.init_state(cfg, 4, 64, mesh, "float")
    _, state, _ = model.prefill.on(mesh, rules)(cfg, params, state, put(prompt))
    logits, state = model.decode_step.on(mesh, rules)(cfg, params, state, put(step))
    got = {"loss": metrics["loss"], "params": nnx.to_pure_dict(train.params), "decode": logits}
    got = jax.tree.map(lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True)), got)
    if jax.process_index() == 0:  # one device of this process runs the single-device reference
        train = train_lib.init_train_state(cfg, tc)
        for _ in range(2):
            train, metrics = train_lib.train_step(cfg, tc, train, inputs, targets)
        params = model.init_params(cfg, jax.random.PRNGKey(0))
        _, state, _ = model.prefill(cfg, params, init_state(cfg, 4, 64, "float"), prompt)
        logits, _ = model.decode_step(cfg, params, state, step)
        want = {"loss": metrics["loss"], "params": nnx.to_pure_dict(train.params), "decode": logits}
        for name in want:
            pairs = zip(jax.tree.leaves(got[name]), jax.tree.leaves(jax.tree.map(np.asarray, want[name])))
            diffs = np.concatenate([np.abs(g.astype(np.float64) - w).ravel() for g, w in pairs])
            print(name, f"{diffs.max():.3g}", f"{np.mean(diffs > 1e-5):.3g}")
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_train_and_decode_as_one_device():
    """Loss and prefill + decode logits within 1e-5 of one device; the parameters after two AdamW steps within
    2·lr, at most 0.1% of them past 1e-5 (AdamW turns a gradient within rounding of 0 into a ±lr step, as in
    `test_sharding`)."""
    env = mesh_lib.simulated_cpu_env(2)
    port = str(_free_port())
    procs = [subprocess.Popen([sys.executable, "-c", PROCESS, str(i), port], cwd=ROOT, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i in range(2)]
    outs = [p.communicate(timeout=900) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    names = {"loss", "params", "decode"}
    fields = [line.split() for line in outs[0][0].splitlines()]  # also gloo's connection lines
    rows = {f[0]: f[1:] for f in fields if f and f[0] in names}
    assert set(rows) == names, outs[0][0]
    assert float(rows["loss"][0]) <= 1e-5 and float(rows["decode"][0]) <= 1e-5, rows
    assert float(rows["params"][0]) <= 2 * 3e-3 and float(rows["params"][1]) <= 1e-3, rows
