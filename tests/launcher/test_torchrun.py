"""xscale's torchrun: the job's exit code says what the workers meant (3 hung, 130 interrupted)."""

from xscale.launcher.torchrun import EXIT_HUNG, EXIT_INTERRUPTED, job_exit_code


def test_a_hang_outranks_the_stopped_rank_it_killed():
    assert job_exit_code({0: EXIT_HUNG, 1: -9}) == EXIT_HUNG
    assert job_exit_code({0: -9, 1: EXIT_HUNG}) == EXIT_HUNG


def test_an_interruption_then_the_first_failure_then_a_signal_as_128_plus_it():
    assert job_exit_code({0: EXIT_INTERRUPTED, 1: -15}) == EXIT_INTERRUPTED
    assert job_exit_code({1: 2, 0: 1}) == 1
    assert job_exit_code({0: -9}) == 137
    assert job_exit_code({}) == 1
