"""Expert parallelism (GShard, Lepikhin et al. 2020): ``plan`` keeps each rank's experts and routes tokens to them by
all-to-all; ``state`` shows checkpoints every expert; ``routing_groups`` counts a step's routing groups for the
auxiliary losses and the routing statistics."""

from xscale.parallel.expert.plan import (
    apply_expert_parallel,
    expert_parallel_context,
    shard_expert_state_dict,
    shard_range,
)

__all__ = ["apply_expert_parallel", "expert_parallel_context", "shard_expert_state_dict", "shard_range"]
