"""no_ACT_continue=False (crashes upstream at the reference commit): halting on q_halt > q_continue and a
q_continue target bootstrapped from the next step, as the paper describes."""

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import yaml
from trm_fixtures import FIXTURES, arrays

from jaxport import trm

pytestmark = pytest.mark.slow


def test_act_continue_targets_next_step(tmp_path):
    case = FIXTURES / "att_rope_f32"
    shutil.copy(case / "step_0", tmp_path / "step_0")
    config = yaml.safe_load((case / "all_config.yaml").read_text())
    config["arch"]["no_ACT_continue"] = False
    (tmp_path / "all_config.yaml").write_text(yaml.safe_dump(config))
    model = trm.load_upstream_checkpoint(tmp_path / "step_0", tmp_path / "all_config.yaml")
    model.train()
    inputs, _ = arrays("att_rope_f32")
    carry = None
    for c in range(3):
        batch = {k: inputs[f"train/b{c}/{k}"] for k in ("inputs", "labels", "puzzle_identifiers")}
        carry = model.initial_carry(batch) if carry is None else carry
        # The next step, computed independently from the state this call leaves behind.
        inner_carry, steps, data = model.load_rows(carry, batch)
        rows = model.puzzle_rows(data)
        new_inner, _, q_halt, q_continue = model.inner(inner_carry, data, rows)
        _, _, next_q_halt, next_q_continue = model.inner(new_inner, data, rows)

        carry, loss, metrics, outputs, _ = model(carry, batch)

        np.testing.assert_allclose(outputs["q_halt_logits"], q_halt, atol=1e-5)
        is_last = np.asarray(steps + 1 >= model.config.halt_max_steps)
        expected_halted = is_last | (np.asarray(q_halt) > np.asarray(q_continue))
        np.testing.assert_array_equal(carry.halted, expected_halted)
        target = jax.nn.sigmoid(jnp.where(is_last, next_q_halt, jnp.maximum(next_q_halt, next_q_continue)))
        np.testing.assert_allclose(outputs["target_q_continue"], target, atol=1e-5)
        q_continue_loss = optax.sigmoid_binary_cross_entropy(outputs["q_continue_logits"], target).sum()
        np.testing.assert_allclose(metrics["q_continue_loss"], q_continue_loss, rtol=1e-5)
        np.testing.assert_allclose(
            loss, metrics["lm_loss"] + 0.5 * (metrics["q_halt_loss"] + q_continue_loss), rtol=1e-5
        )
