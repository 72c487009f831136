"""What a component allows the parallel plans to do with it, declared on its class as ``parallel_traits``.

The plans in :mod:`xscale.parallel` read these declarations and never name a component class, so a new
component runs under every layout its traits allow without an edit there (docs/extending.md).

Tensor parallelism (``tp``; Megatron-LM, Shoeybi et al. 2019) gives rank r the heads [r H/tp, (r + 1) H/tp):
  * ``split_heads``: the heads are independent; the core runs its single-device code on its H/tp heads (any
    parameters it has are shared by the heads: replicated, gradients summed over tp);
  * ``head_state``: as ``split_heads``, and the state its ``per_head_state`` names (dim 0 = heads) is split by
    head (:mod:`xscale.parallel.tensor.head_sharded`);
  * ``gather_heads``: output heads read every head's logits (talking heads); each rank gathers all heads' q and k
    and the core computes the output heads its context names (``StepContext.heads_held``: a slice of the global heads);
  * ``split_hidden``: a feed-forward network whose ``column_parallel`` linears are split by output features and
    whose ``row_parallel`` linears by input features (one all-reduce per sub-layer); the parameters named in
    ``split_rows`` (dim 0 follows the split hidden channels: Lite's convolution kernels) are split by rows with them;
  * ``replicated``: every rank runs the whole module on the whole sequence (MoE layers, position encodings); the
    children named in ``replicated_parts`` compute on their own (they swap in their local parameters separately);
  * ``per_token``: a module that computes each token from that token alone, on the residual stream (GTrXL's gates,
    the Evolved Transformer's GLU): replicated like a norm, run on the tokens the stream holds (under sequence
    parallelism a slice, its gradients summed over tp);
  * ``none``: no tensor-parallel plan; ``parallel.tp > 1`` is refused.
``head_dependent_options``: options that, when true, give heads different patterns, so heads cannot be split.
``cp``: context parallelism (:mod:`xscale.parallel.context`) serves it: an attention core that is exact with K/V
all-gathered over the cp ranks and the causal mask passed as an additive bias over global positions (it takes a bias
and reads no position of its own); a position encoding whose hooks that plan evaluates at global positions.
``cp_positions``: context parallelism serves an attention core that places its queries itself: it takes this rank's
queries with K/V all-gathered and ``causal`` unchanged, and reads the queries' global positions from its context
(``StepContext.sequence``), computing only the rows it holds (the position-sparse cores).
``cp_whole_sequence``: context parallelism serves an attention core by giving every rank the whole sequence: it
all-gathers the queries too, runs the core's single-device code on every position (its own causal mask, dropout
by global position) and keeps the rank's rows of the output. Exact for a core whose output depends only on the
sequence and its parameters; no saving in the core's own work (the rest of the layer is sharded). A position
encoding's logit bias (ALiBi, T5) is gathered with the queries.
``dp_statistics``: the core keeps running statistics of the tokens it sees, which it sums over the data-parallel
ranks with its context's ``sum_over_replicas`` (the data-parallel plan provides it), so every replica moves them
alike.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

TensorParallel = Literal["split_heads", "head_state", "gather_heads", "split_hidden", "replicated", "per_token",
                         "none"]


@dataclasses.dataclass(frozen=True)
class ParallelTraits:
    tp: TensorParallel = "none"
    head_dependent_options: tuple[str, ...] = ()
    column_parallel: tuple[str, ...] = ()
    row_parallel: tuple[str, ...] = ()
    split_rows: tuple[str, ...] = ()
    replicated_parts: tuple[str, ...] = ()
    cp: bool = False
    cp_positions: bool = False
    cp_whole_sequence: bool = False
    dp_statistics: bool = False

    def __post_init__(self) -> None:
        if (self.tp == "split_hidden") != bool(self.column_parallel and self.row_parallel):
            raise ValueError("tp='split_hidden' needs its column_parallel and row_parallel linears (and only it "
                             f"names them); got {self}")
        if self.split_rows and self.tp != "split_hidden":
            raise ValueError(f"split_rows follow a split hidden width: only tp='split_hidden' names them; got {self}")


@dataclasses.dataclass(frozen=True)
class Refusal:
    """Why a stack variant cannot take a layout: the reason, said to the user with what to change."""

    reason: str


@dataclasses.dataclass(frozen=True)
class Serves:
    """A model a stack variant serves: its ``model.family`` and ``train.task`` (None: any)."""

    family: str | None = None
    task: str | None = None

    def admits(self, family: str, task: str) -> bool:
        return self.family in (None, family) and self.task in (None, task)

    def setting(self) -> str:
        """The settings that give such a model, as the user writes them."""
        return " and ".join(f"{key}={value}" for key, value in (("model.family", self.family),
                                                                 ("train.task", self.task)) if value is not None)


@dataclasses.dataclass(frozen=True)
class StackTraits:
    """What a stack variant (``model.stack``) allows the layouts to do with it, declared on its class as
    ``stack_traits``: each layout field names a layout setting and holds the :class:`Refusal` where the variant
    cannot take it (None: it can). ``pp``: a pipeline cut through its blocks; ``tp``: tensor parallelism;
    ``sequence_parallel``; ``cp``: context parallelism; ``zero3``: FSDP2's parameter gathering around each block;
    ``activation_checkpointing``. ``serves``: the models it serves (empty: every one), ``serves_reason`` why only
    those (the model checks refuse the rest in one place, :func:`xscale.models.checks.check_stack_serves`)."""

    pp: Refusal | None = None
    tp: Refusal | None = None
    sequence_parallel: Refusal | None = None
    cp: Refusal | None = None
    zero3: Refusal | None = None
    activation_checkpointing: Refusal | None = None
    serves: tuple[Serves, ...] = ()
    serves_reason: str = ""

    def __post_init__(self) -> None:
        if bool(self.serves) != bool(self.serves_reason):
            raise ValueError(f"a stack variant that serves some models only says why (serves_reason); got {self}")

    def refusals(self) -> dict[str, Refusal]:
        """The layout settings it refuses, by field name."""
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)
                if isinstance(getattr(self, field.name), Refusal)}


@dataclasses.dataclass(frozen=True)
class BlockParts:
    """A block's modules as the tensor-parallel plan splits them, by path inside the block (a block kind's
    ``tensor_parallel_parts()``): ``attentions``, Attention sub-layers split by heads (q/k/v column-, output
    row-parallel); ``residuals``, whose norms and gains are replicated on the stream; ``modules``, each split as its
    own ``parallel_traits`` say (FFNs and MoE layers, Lite's convolution branch, GTrXL's gates, ...). The plan refuses
    a block with a parameter none of them holds."""

    attentions: tuple[str, ...]
    residuals: tuple[str, ...]
    modules: tuple[str, ...]


def traits_of(component: object) -> ParallelTraits:
    """The traits a component (class or instance) declares; none declared: no parallel plan may split it."""
    return getattr(component, "parallel_traits", NO_TRAITS)


NO_TRAITS = ParallelTraits()
