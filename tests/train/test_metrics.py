"""The metrics log: each step's record is on disk as soon as it is logged (a crash loses none of the curve)."""

from __future__ import annotations

import json

from xscale.train.metrics import MetricsLogger


def test_each_logged_step_is_on_disk_before_the_logger_closes(tmp_path):
    logger = MetricsLogger(tmp_path, enabled=True, total_steps=3, log_every=100, tensorboard=False, progress=False)
    for step in (1, 2):
        logger.log(step, {"train/loss": 4.0 - step})
        lines = (tmp_path / "metrics.jsonl").read_text().splitlines()  # read while the logger still holds the file
        assert [json.loads(line)["step"] for line in lines] == list(range(1, step + 1))
