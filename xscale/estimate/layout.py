"""One candidate layout of the planner: the degrees, the ZeRO stage, the batch split, recomputation and the pipeline
schedule; the config overrides that run it (``xscale train``/``xscale submit``) and how complex it is (ties)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from xscale.config.schema import Config
from xscale.parallel.dims import ParallelDims

CHECKPOINTING_RANK = {"none": 0, "selective": 1, "full": 2}
SCHEDULE_RANK = {"gpipe": 0, "1f1b": 1, "interleaved_1f1b": 2, "zero_bubble": 3}


@dataclass(frozen=True)
class Layout:
    """``dp`` data-parallel ranks (dp_shard; ``ep`` of them hold different experts), each splitting its
    global_batch / dp sequences into ``microbatches`` of ``micro_batch`` (pipeline microbatches, or gradient
    accumulation without a pipeline)."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    cp: int = 1
    zero_stage: int = 0
    micro_batch: int = 1
    microbatches: int = 1
    checkpointing: str = "none"
    schedule: str = "1f1b"
    stages_per_rank: int = 1
    sequence_parallel: bool = False

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    def dims(self) -> ParallelDims:
        return ParallelDims(pp=self.pp, dp_shard=self.dp, tp=self.tp, ep=self.ep, zero_stage=self.zero_stage,
                            cp=self.cp, microbatches=self.microbatches)

    def overrides(self) -> dict[str, object]:
        """``section.key`` -> value: what turns a config into this layout (``dp_shard=-1``: the rest of the world)."""
        values: dict[str, object] = {
            "parallel.tp": self.tp, "parallel.pp": self.pp, "parallel.cp": self.cp, "parallel.ep": self.ep,
            "parallel.dp_replicate": 1, "parallel.dp_shard": -1, "parallel.zero_stage": self.zero_stage,
            "parallel.sequence_parallel": self.sequence_parallel,
            "parallel.activation_checkpointing": self.checkpointing,
        }
        if self.pp > 1:
            values.update({"parallel.pp_schedule": self.schedule, "parallel.pp_stages_per_rank": self.stages_per_rank,
                           "parallel.microbatches": self.microbatches, "train.micro_batch_size": None})
        else:
            values.update({"parallel.microbatches": None, "train.micro_batch_size": self.micro_batch})
        return values

    def apply(self, config: Config) -> Config:
        """A copy of ``config`` with :meth:`overrides` set."""
        sections: dict[str, dict[str, object]] = {}
        for key, value in self.overrides().items():
            section, field = key.split(".")
            sections.setdefault(section, {})[field] = value
        return dataclasses.replace(config, **{section: dataclasses.replace(getattr(config, section), **fields)
                                              for section, fields in sections.items()})

    def complexity(self) -> tuple[int, ...]:
        """Smaller is simpler (the tie-break): fewer split dimensions, then fewer microbatches, then lower ZeRO
        stage, schedule and recomputation."""
        split = sum(degree > 1 for degree in (self.tp, self.pp, self.ep, self.cp))
        return (split, self.microbatches, self.zero_stage, SCHEDULE_RANK[self.schedule] if self.pp > 1 else 0,
                CHECKPOINTING_RANK[self.checkpointing])

    def describe(self) -> str:
        parts = [f"{name}={getattr(self, name)}" for name in ("dp", "tp", "pp", "cp", "ep") if getattr(self, name) > 1]
        text = " ".join(parts) or "single device"
        text += f" zero{self.zero_stage}" if self.dp * self.cp > 1 else ""
        text += " sp" if self.sequence_parallel else ""
        if self.pp > 1:
            text += f" {self.schedule}" + (f"(v={self.stages_per_rank})" if self.stages_per_rank > 1 else "")
        text += f" mb={self.micro_batch}x{self.microbatches}"
        text += f" ckpt={self.checkpointing}" if self.checkpointing != "none" else ""
        return text
