"""Tensor parallelism (Megatron-LM's split, Shoeybi et al. 2019) and sequence parallelism: ``plan`` splits a model
over the ``tp`` ranks; ``replicated``, ``head_sharded``, ``talking_heads`` and ``vocab_parallel`` are the pieces it
uses for parameters every rank holds, per-head state, head-mixing cores and the vocabulary; ``shards`` says which
parameters the plan splits without applying it (the memory estimator's count)."""

from xscale.parallel.tensor.plan import apply_tensor_parallel, check_tensor_parallel, tensor_parallel_context

__all__ = ["apply_tensor_parallel", "check_tensor_parallel", "tensor_parallel_context"]
