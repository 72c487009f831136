"""The parity harness's one rerun after a rank's SIGABRT: warned, checked again, never twice, nothing else caught."""

from __future__ import annotations

import parity_models
import pytest
from torch.multiprocessing.spawn import ProcessExitedException


def aborted() -> ProcessExitedException:
    return ProcessExitedException("process 1 terminated with signal SIGABRT", error_index=1, error_pid=7,
                                  exit_code=-6, signal_name="SIGABRT")


def test_a_rank_abort_is_compared_again_once_with_a_warning(monkeypatch, tmp_path):
    outcomes = [aborted(), ("reference", "results")]

    def compare(config, overrides, layouts, steps, output_dir):
        outcome = outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        assert output_dir == tmp_path / "after-abort"
        return outcome

    monkeypatch.setattr(parity_models, "compare_layouts", compare)
    with pytest.warns(RuntimeWarning, match=r"\['tp=2'\]: process 1 terminated with signal SIGABRT; compared again"):
        assert parity_models.compare_with_one_rerun_after_an_abort([], ["tp=2"], tmp_path) == ("reference", "results")


def test_a_second_abort_fails(monkeypatch, tmp_path):
    errors = [aborted(), aborted()]

    def compare(*args):
        raise errors.pop(0)

    monkeypatch.setattr(parity_models, "compare_layouts", compare)
    with pytest.warns(RuntimeWarning), pytest.raises(ProcessExitedException, match="SIGABRT"):
        parity_models.compare_with_one_rerun_after_an_abort([], ["tp=2"], tmp_path)
    assert errors == []


def test_any_other_failure_is_not_compared_again(monkeypatch, tmp_path):
    calls = []

    def compare(*args):
        calls.append(args)
        raise ProcessExitedException("process 0 terminated with exit code 1", error_index=0, error_pid=7, exit_code=1)

    monkeypatch.setattr(parity_models, "compare_layouts", compare)
    with pytest.raises(ProcessExitedException, match="exit code 1"):
        parity_models.compare_with_one_rerun_after_an_abort([], ["tp=2"], tmp_path)
    assert len(calls) == 1
