"""Parameter counts of a model config, from a model built on the meta device (no memory)."""

from __future__ import annotations

from dataclasses import dataclass

from xscale.config import Config
from xscale.models import build_model


@dataclass
class ModelCount:
    total: int
    embedding: int
    per_component: dict[str, int]
    expert: int = 0  # MoE expert weights (sharded by expert parallelism)

    @property
    def non_embedding(self) -> int:
        return self.total - self.embedding


def count_parameters(config: Config) -> ModelCount:
    model = build_model(config.model, materialize=False)
    per_component: dict[str, int] = {}
    total = expert = 0
    for name, param in model.named_parameters():  # tied weights are counted once
        total += param.numel()
        expert += param.numel() if ".experts." in name else 0
        parts = name.split(".")
        key = parts[0] if parts[0] not in ("stack", "decoder") else ".".join(p for p in parts[:5] if not p.isdigit())
        per_component[key] = per_component.get(key, 0) + param.numel()
    embedding = config.model.vocab_size * config.model.d_model
    return ModelCount(total, embedding, per_component, expert)
