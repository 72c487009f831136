"""TrainingHealth: which steps are unhealthy, and which checkpoint is the last confirmed healthy one."""

from pathlib import Path

from xscale.train.health import TrainingHealth


def _health(**overrides):
    options = {"enabled": True, "window": 5, "loss_factor": 4.0, "grad_collapse": 1e-3} | overrides
    return TrainingHealth(**options)


def test_a_loss_far_above_the_median_is_unhealthy_and_keeps_the_confirmed_checkpoint():
    health = _health()
    health.observe(1, 3.0, 1.0)
    health.saved(1, Path("step_1"))
    assert health.last_healthy is None  # step 1's weights have not been judged yet
    health.observe(2, 2.9, 1.0)
    assert health.last_healthy == (1, Path("step_1"))
    health.saved(2, Path("step_2"))
    assert "loss 500 is over 4 x the median" in health.observe(3, 500.0, 1.0)  # step 2's weights are broken
    assert health.keep() == Path("step_1") and health.since == 3
    health.saved(3, Path("step_3"))
    assert health.last_healthy == (1, Path("step_1"))


def test_a_collapsed_gradient_is_unhealthy_and_recovery_lifts_the_protection():
    health = _health()
    for step in range(1, 4):
        health.observe(step, 3.0, 2.0)
    health.saved(3, Path("step_3"))
    assert "gradient norm 1e-06 collapsed" in health.observe(4, 3.0, 1e-6)
    assert health.last_healthy is None and health.keep() is None  # step_3 unconfirmed, nothing earlier
    health.observe(5, 3.0, 2.0)
    assert health.problem is None and health.keep() is None and health.last_healthy == (3, Path("step_3"))


def test_disabled_every_finite_step_is_healthy_and_nonfinite_ones_are_ignored():
    health = _health(enabled=False)
    health.observe(1, 3.0, 1.0)
    health.saved(1, Path("step_1"))
    assert health.observe(2, 1e9, 0.0) is None
    assert health.observe(3, float("nan"), 1.0) is None
    assert health.last_healthy == (1, Path("step_1")) and health.keep() is None
