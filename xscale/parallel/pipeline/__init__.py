"""Pipeline parallelism: the model's layers cut into stages over a ``pp`` group, run by a schedule.

``stages``: a stage is the model with the modules it does not run deleted; ``shared``: parameters several stages
hold (tied embeddings, T5's table, a shared block) and the summing of their gradients; ``checkpoint``: the stages'
state under single-process names; ``schedules``: the schedules and every refusal; ``runtime``: one rank's stages
running a step.
"""

from xscale.parallel.pipeline.runtime import PipelineSchedule
from xscale.parallel.pipeline.schedules import (
    SCHEDULES,
    check_microbatches,
    check_pipeline,
    ideal_bubble,
    layer_count_name,
    resolve_microbatches,
)
from xscale.parallel.pipeline.stages import pipeline_layers, split_layers, stage_to_rank

__all__ = ["SCHEDULES", "PipelineSchedule", "check_microbatches", "check_pipeline", "ideal_bubble",
           "layer_count_name", "pipeline_layers", "resolve_microbatches", "split_layers", "stage_to_rank"]
