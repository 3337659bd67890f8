"""train.loop.run around a toy trainee (no model step, nothing compiles): a non-finite loss stops the run before
anything is saved after it, so the last checkpoint on disk stays the last good one."""

import json

import jax
import jax.numpy as jnp
import optax
import pytest

from csa2.checkpoints import native as checkpoint
from csa2.model import abstract_params
from csa2.presets import preset
from tests.csa2.checkpoints.test_checkpoint import assert_bit_identical, random_like
from train.loop import NonFiniteLoss, Trainee, run
from train.step import TrainState

CFG = preset("mini")


def _trainee(nan_from: int, log_every: int) -> Trainee:
    """Six steps that leave params as they are and report loss 1.0, then NaN from step index `nan_from` on."""
    params = random_like(abstract_params(CFG), 0)

    def step(state, batch, index):
        loss = jnp.float32(float("nan") if index >= nan_from else 1.0)
        return state.replace(step=state.step + 1), {"loss": loss}

    return Trainee(kind=checkpoint.BACKBONE, steps=6,
                   init=lambda: TrainState(params=params, opt_state=optax.EmptyState(),
                                           step=jnp.asarray(0, jnp.int32), rng=jax.random.PRNGKey(0)),
                   batches=lambda first: iter(range(first, 10)), step=step, extra={}, summary=lambda r: "",
                   rate="steps_per_s", work=lambda batch: 1, plot=lambda records, path: True, png="loss.png",
                   log_every=log_every)


@pytest.mark.parametrize("log_every", [1, 10], ids=["caught-when-logged", "caught-before-saving"])
def test_a_non_finite_loss_stops_training_and_keeps_the_last_good_checkpoint(tmp_path, log_every):
    """NaN from the third step on, a checkpoint every two steps: the run stops at step 3 (logged every step) or at
    step 4 (logged every ten, caught before its save), step 2 stays the latest checkpoint and restores bit for bit,
    and metrics.jsonl keeps the logged steps before the failure."""
    trainee = _trainee(nan_from=2, log_every=log_every)
    with pytest.raises(NonFiniteLoss, match=f"stopped at step {3 if log_every == 1 else 4}: the loss is nan.*the "
                                            "checkpoint at step 2 .* is the last good one"):
        run(trainee, CFG, tmp_path, log=lambda _: None, bar=False, save_every=2)
    assert checkpoint.latest_step(tmp_path) == 2
    assert_bit_identical(checkpoint.restore_params(tmp_path, CFG)[1], trainee.init().params)
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == ([1, 2] if log_every == 1 else [])
