"""StepContext: where the batch in flight sits in the run, passed to the model's forward as an argument.

Everything a component draws or reads per batch comes from it, never from process-global state:
- dropout masks and router noise are functions of (seed, step, global sample row, element coordinates)
  (:mod:`xscale.models.dropout`), so every layout draws the same numbers for the same token;
- hash-routed MoE layers read ``token_ids``, the ids of the sequence their stack sees (Roller et al. 2021);
- ``padding_mask`` marks the real tokens of padded variable-length examples: attention takes no padded key;
- a block shared across depths (ALBERT, Lan et al. 2020) runs at ``depth``, where it draws its own masks;
- under context parallelism ``sequence`` says which global token positions this rank holds; under tensor
  parallelism ``tensor_rank`` / ``tensor_size`` which slice of the heads (and, with sequence parallelism, of the
  residual stream's tokens) it holds;
- MoE layers weight their auxiliary losses by ``moe_loss_scale`` (1/G over a step's G routing groups), and cores
  keeping running statistics sum them over the data-parallel replicas with ``sum_over_replicas``;
- ``memo`` lets a forward leave what its recomputation must reuse (routing attention's centroids): activation
  checkpointing re-runs a forward with the same arguments, so the recomputation finds the same memo;
- ``experts``: under expert parallelism, the MoE layers' routing group and token exchange (None: one device
  routes its own tokens through every expert);
- ``kv_cache``: while decoding, the keys and values of the tokens already seen (:mod:`xscale.models.kv_cache`);
  the forward's tokens then sit after them (``sequence`` is the cache too);
- ``segment_memory``: Transformer-XL's memory (Dai et al. 2019, sec. 3.2), the hidden states each layer saw in
  the previous segments of the same streams (:mod:`xscale.models.segment_memory`); the caller keeps it between
  forwards, the layers only read the previous states and record the new ones.

Without a context (``None``, plain PyTorch use) masks come from torch's generator, as ``nn.Dropout``'s do.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch


class SequenceLayout(Protocol):
    """Which global positions of each sequence a rank holds (context parallelism's slicing)."""

    def global_size(self, local_size: int) -> int: ...

    def coordinates(self, local_size: int, device: torch.device) -> torch.Tensor: ...


class KeyValueCache(SequenceLayout, Protocol):
    """Keys and values of the tokens decoded so far, per attention layer; the forward's tokens come after them."""

    @property
    def length(self) -> int: ...

    def extend(self, layer: Any, keys: torch.Tensor,
               values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


class RecurrentMemory(Protocol):
    """Per layer, the previous segments' inputs to that layer (stop-gradient), and the new ones this forward leaves."""

    def exchange(self, key: Any, inputs: torch.Tensor) -> torch.Tensor | None:
        """The remembered states (B, M, D) for ``key`` (None at a stream's start); records ``inputs`` (B, T, D)."""
        ...


class TokenGroup(Protocol):
    """The tokens an MoE layer routes together (a routing group): this forward's, every expert-parallel rank's, or
    every context-parallel rank's slice of the same sequences."""

    def gather(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This member's rows, batch first ([B, T, c], or [n, c]) -> the group's rows [N, c] in the order one device
        would hold them, and where this member's rows lie in it ([n] row indices; None: they are the whole group,
        in order)."""
        ...

    def all_reduce(self, value: torch.Tensor) -> torch.Tensor:
        """Sum over the members (detached)."""
        ...


class ExpertExchange(TokenGroup, Protocol):
    """Expert parallelism's routing group and token exchange (:mod:`xscale.parallel.expert`): the routing group is
    every ep rank's tokens; each rank holds some experts and the tokens go to the rank holding theirs.
    ``experts_local``: every expert is on this rank (no token moves), so a top-1 layer may dispatch and combine
    inside the experts' pass."""

    experts_local: bool

    def dispatch(self, tokens_by_expert: torch.Tensor, tokens_per_expert: torch.Tensor, experts: Any) -> torch.Tensor: ...


@dataclass(frozen=True)
class StepContext:
    """One forward's place in the run (immutable; derive with :meth:`microbatch`, :meth:`at_depth`, ...)."""

    seed: int | None = None  # None: draws from torch's generator (like nn.Dropout)
    step: int = 0
    first_sample: int = 0  # row of the step's global batch that this batch's row 0 is
    microbatch_stride: int = 0  # rows of the global batch from one microbatch of this batch to the next (0: its rows)
    token_ids: torch.Tensor | None = None  # (B, T) ids of the tokens the current stack sees
    padding_mask: torch.Tensor | None = None  # (B, T) bool, True at real tokens, False at padding (None: no padding)
    depth: int | None = None  # the depth a shared block runs at (None: blocks are not shared)
    sequence: SequenceLayout | None = None  # the global positions held under context parallelism (None: all)
    tensor_rank: int = 0  # this rank's slice of the heads: [rank * H / size, (rank + 1) * H / size)
    tensor_size: int = 1
    sequence_parallel: bool = False  # the residual stream holds slice tensor_rank of the tokens (dim 1)
    moe_loss_scale: float = 1.0  # weight of this forward's MoE auxiliary losses: 1 / routing groups per step
    # In-place sum of running statistics over the data-parallel replicas (None: one replica).
    sum_over_replicas: Callable[[torch.Tensor], torch.Tensor] | None = field(default=None, compare=False, repr=False)
    memo: dict[Any, Any] = field(default_factory=dict, compare=False, repr=False)
    kv_cache: KeyValueCache | None = field(default=None, compare=False, repr=False)  # None: no cache (training)
    experts: ExpertExchange | None = field(default=None, compare=False, repr=False)  # None: every expert is here
    segment_memory: RecurrentMemory | None = field(default=None, compare=False, repr=False)  # None: no recurrence

    @property
    def positioned(self) -> bool:
        """Whether draws are functions of the position in the run (else of torch's generator)."""
        return self.seed is not None

    def microbatch(self, index: int, rows: int) -> StepContext:
        """Microbatch ``index`` (``rows`` rows, contiguous in the global batch) of this batch, with a memo of its own."""
        stride = self.microbatch_stride or rows
        return replace(self, first_sample=self.first_sample + index * stride, microbatch_stride=0, memo={})

    def at_depth(self, depth: int | None) -> StepContext:
        return self if depth == self.depth else replace(self, depth=depth)

    def with_token_ids(self, token_ids: torch.Tensor | None) -> StepContext:
        return replace(self, token_ids=token_ids)

    def with_padding_mask(self, padding_mask: torch.Tensor | None) -> StepContext:
        """Attention takes no keys where ``padding_mask`` (B, T) is False (the padding of variable-length examples)."""
        return replace(self, padding_mask=padding_mask)

    def with_sequence(self, sequence: SequenceLayout | None) -> StepContext:
        return replace(self, sequence=sequence)

    def with_kv_cache(self, cache: KeyValueCache | None) -> StepContext:
        """Attention reads and extends ``cache``; positions continue after the cached tokens."""
        return replace(self, kv_cache=cache, sequence=cache)

    def with_segment_memory(self, memory: RecurrentMemory | None) -> StepContext:
        """Every layer attends over ``memory``'s remembered states before this forward's (Transformer-XL)."""
        return replace(self, segment_memory=memory)

    def with_experts(self, exchange: ExpertExchange | None) -> StepContext:
        """MoE layers route over ``exchange``'s group and send tokens to the ranks holding their experts."""
        return replace(self, experts=exchange)

    def with_tensor_parallel(self, rank: int, size: int, sequence_parallel: bool = False) -> StepContext:
        return replace(self, tensor_rank=rank, tensor_size=size, sequence_parallel=sequence_parallel)

    def heads_held(self, n_heads: int) -> slice:
        """The global heads whose rows this rank computes, of ``n_heads``."""
        local = n_heads // self.tensor_size
        return slice(self.tensor_rank * local, (self.tensor_rank + 1) * local)

    def positions(self, local_size: int, device: torch.device) -> torch.Tensor:
        """The global positions (int64) of the ``local_size`` tokens of each sequence held here."""
        if self.sequence is None:
            return torch.arange(local_size, device=device)
        return self.sequence.coordinates(local_size, device).to(torch.int64)

    def sequence_length(self, local_size: int) -> int:
        """The whole sequence's length when ``local_size`` tokens of it are held here."""
        return local_size if self.sequence is None else self.sequence.global_size(local_size)


# What a parallel layout tells each forward (which heads, tokens, experts this rank holds): context -> context.
Placement = Callable[[StepContext], StepContext]


def positions_of(context: StepContext | None, local_size: int, device: torch.device) -> torch.Tensor:
    return torch.arange(local_size, device=device) if context is None else context.positions(local_size, device)


def sequence_length_of(context: StepContext | None, local_size: int) -> int:
    return local_size if context is None else context.sequence_length(local_size)
