"""A training run that records the sample indices each rank reads, run on spawned ranks by the resharding and
elastic-resume tests (importable by module name from ``tests/parallel``, as the spawned ranks need)."""

from __future__ import annotations

from xscale.config.schema import Config
from xscale.data import build_datasets
from xscale.train.trainer import Trainer


class RecordingDataset:
    """Remembers every sample index this rank reads, in order."""

    def __init__(self, dataset) -> None:
        self.dataset, self.seen = dataset, []

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        self.seen.append(int(index))
        return self.dataset[index]


def train_recording(config: Config) -> dict:
    """Train ``config`` on this rank: its losses, the samples it read, its data-parallel rank and micro-batch size."""
    data = RecordingDataset(build_datasets(config)[0])
    trainer = Trainer(config, data, None)
    losses = trainer.fit()["losses"]
    return {"losses": losses, "seen": data.seen, "dp_rank": trainer.dp_rank, "micro": trainer.model.micro_batch_size}
