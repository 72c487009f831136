"""Pipeline stages cut from the single-process Transformer, under its parameter names.

A stage keeps the modules it runs and drops the rest: the first stage the embedding, every stage
its blocks (``stack.layers.<k>`` for its layer indices k), the last stage the final norm, the head
transform and the output projection. Names are untouched, so the union of the stages' state dicts
is the single-process state dict and checkpoints move between layouts.

Tied embeddings (Press & Wolf 2017) whose two ends sit on different stages become two parameters,
``embedding.weight`` on the first stage and ``output.weight`` on the last, both initialised from
``embedding.weight``. After backward their gradients are summed (Megatron's embedding group,
Shoeybi et al. 2019), so the optimizer keeps the copies bitwise equal. Under tensor parallelism both
are sharded by vocabulary alike, and each tp rank sums its shard with its pipeline peer's.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from xscale.config import ConfigError
from xscale.models.init import canonical_name, init_weights
from xscale.models.position import PositionEncoding
from xscale.models.transformer import Transformer
from xscale.parallel.data import local_tensor

TIED_COPY = "output.weight"
TIED_SOURCE = "embedding.weight"


def split_layers(n_layers: int, num_stages: int, pp_split: list[int] | None = None) -> list[list[int]]:
    """Layer indices per stage: ``pp_split`` blocks per stage when given, else as even as possible
    (the earlier stages take one more layer when ``num_stages`` does not divide ``n_layers``)."""
    if num_stages < 1:
        raise ConfigError(f"a pipeline needs at least one stage, got {num_stages}")
    if pp_split is None:
        if n_layers < num_stages:
            raise ConfigError(
                f"model.n_layers={n_layers} cannot fill {num_stages} pipeline stages (parallel.pp x "
                f"parallel.pp_stages_per_rank); lower pp or pp_stages_per_rank to at most {n_layers} stages"
            )
        base, extra = divmod(n_layers, num_stages)
        sizes = [base + (1 if stage < extra else 0) for stage in range(num_stages)]
    else:
        sizes = list(pp_split)
        if len(sizes) != num_stages:
            raise ConfigError(
                f"parallel.pp_split={sizes} has {len(sizes)} entries but the pipeline has {num_stages} stages "
                f"(parallel.pp x parallel.pp_stages_per_rank); give one block count per stage"
            )
        if any(size < 1 for size in sizes):
            raise ConfigError(f"parallel.pp_split={sizes}: every stage needs at least one block")
        if sum(sizes) != n_layers:
            raise ConfigError(
                f"parallel.pp_split={sizes} sums to {sum(sizes)} blocks but model.n_layers={n_layers}; "
                f"make the counts sum to {n_layers}"
            )
    bounds = [sum(sizes[:stage]) for stage in range(num_stages + 1)]
    return [list(range(bounds[stage], bounds[stage + 1])) for stage in range(num_stages)]


def stage_to_rank(num_stages: int, pp_size: int, style: str) -> list[int]:
    """The pp rank of every stage: ``loop`` puts stage s on rank s % pp (Narayanan et al. 2021),
    ``v`` runs down the ranks and back up (ZB-V, Qi et al. 2024, sec. 6)."""
    if style == "loop":
        return [stage % pp_size for stage in range(num_stages)]
    if style == "v":
        return [stage if stage < pp_size else 2 * pp_size - 1 - stage for stage in range(num_stages)]
    raise ValueError(f"unknown stage placement '{style}'")


class PipelineStageModule(nn.Module):
    """One pipeline stage: token ids (first stage) or hidden states in, hidden states out.

    The last stage returns the hidden states the LM head projects (after the final norm and the
    head transform); the engine's loss function applies ``output``. The forward mirrors
    :meth:`Transformer.hidden_states` for the layers this stage holds. The stage takes over (and
    prunes) ``model``'s modules: pass a copy.
    """

    def __init__(self, model: Transformer, layer_indices: list[int], *, is_first: bool, is_last: bool) -> None:
        super().__init__()
        self.config = model.config
        self.layer_indices = list(layer_indices)
        self.is_first, self.is_last = is_first, is_last
        if is_first:
            self.embedding = model.embedding
            self.embedding_norm = model.embedding_norm
            self.embedding_dropout = model.embedding_dropout
        stack = model.stack
        held = {str(index) for index in layer_indices}
        for name in [name for name in stack.layers if name not in held]:
            del stack.layers[name]
        stack.n_layers = len(layer_indices)
        if not is_first and stack.position.adds_to_input:
            # Absolute positions are added once, before the first block; later stages need no table.
            config = model.config
            stack.position = PositionEncoding(config.d_model, config.n_heads, config.head_dim, config.max_seq_len,
                                              stack.position.causal)
        if not is_last:
            stack.final_norm = None
        self.stack = stack
        if is_last:
            self.head_transform = model.head_transform
            self.output = model.output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:
            x = self.stack.position.embed(self.embedding(x))
            if self.embedding_norm is not None:
                x = self.embedding_norm(x)
            x = self.embedding_dropout(x)
        for block in self.stack.layers.values():
            x = block(x, self.stack.position)
        if self.is_last:
            if self.stack.final_norm is not None:
                x = self.stack.final_norm(x)
            if self.head_transform is not None:
                x = self.head_transform(x)
        return x


def build_stage_module(meta_model: Transformer, layer_indices: list[int], *, is_first: bool, is_last: bool,
                       device: torch.device | str, seed: int,
                       parallelize: Callable[[PipelineStageModule], None] | None = None) -> PipelineStageModule:
    """Cut a stage from a meta-device Transformer, apply ``parallelize`` to it (still on the meta device:
    tensor parallelism, activation checkpointing), allocate it on ``device`` and fill it with the
    single-process initial weights (the tied output copy takes ``embedding.weight``'s values)."""
    model = copy.deepcopy(meta_model)
    stage = PipelineStageModule(model, layer_indices, is_first=is_first, is_last=is_last)
    untie = model.config.tie_embeddings and is_last and not is_first
    if untie:
        stage.output.weight = nn.Parameter(torch.empty_like(stage.output.weight))
    if parallelize is not None:
        parallelize(stage)
    stage.to_empty(device=device)
    names = {id(stage.output.weight): TIED_SOURCE} if untie else None
    init_weights(stage, model.config, seed, names=names)
    return stage


def tied_copy(stage: PipelineStageModule) -> nn.Parameter | None:
    """The last stage's copy of the tied embedding, or None (untied model, or first and last stage in one)."""
    if stage.is_last and not stage.is_first and stage.config.tie_embeddings:
        return stage.output.weight
    return None


class TiedEmbeddingGrads:
    """Sums the gradients of the two ends of a tied embedding held by different stages.

    When both ends are on this rank the sum is local; otherwise the first- and last-stage ranks swap
    their gradients point-to-point (no extra process group) and each adds them in the same order,
    so both ends get bitwise the same gradient. Gradients from earlier steps (accumulation) are set
    aside by :meth:`begin` and added back by :meth:`finish`, so only this step's are exchanged.

    The ends are looked up in the stages at each use: ZeRO-3 (``fully_shard``) replaces a module's
    parameters after the engine is built. Their gradients are then shards over ``dp_shard``, already
    summed over data parallel; the two peers sit at the same data-parallel coordinate, so they hold
    the same rows and swap their local shards.
    """

    def __init__(self, stages: list[PipelineStageModule], first_rank: int, last_rank: int,
                 group: dist.ProcessGroup) -> None:
        self.group = group
        self.first_rank, self.last_rank = first_rank, last_rank
        self.stages = stages
        self._earlier: dict[int, torch.Tensor | None] = {}

    @property
    def source(self) -> nn.Parameter | None:
        """The first stage's ``embedding.weight`` when this rank holds it and the model ties it."""
        tied = self.stages[0].config.tie_embeddings
        return next((stage.embedding.weight for stage in self.stages if stage.is_first and tied), None)

    @property
    def copy(self) -> nn.Parameter | None:
        """The last stage's copy of the tied embedding when this rank holds it."""
        return next((tied_copy(stage) for stage in self.stages if tied_copy(stage) is not None), None)

    @property
    def ends(self) -> list[nn.Parameter]:
        """The ends this rank holds, when the other end lives on another stage."""
        if self.source is not None and self.first_rank == self.last_rank and self.copy is None:
            return []  # one stage holds both ends as one parameter
        return [param for param in (self.source, self.copy) if param is not None]

    def begin(self) -> None:
        self._earlier = {id(param): param.grad for param in self.ends}
        for param in self.ends:
            param.grad = None

    @torch.no_grad()
    def finish(self) -> None:
        ends = self.ends
        if not ends:
            return
        source, copy_ = self.source, self.copy
        if source is not None and copy_ is not None:
            total = _local_grad(source) + _local_grad(copy_)
        else:
            # Both ends are sharded alike (vocabulary rows under tp, FSDP2 rows under ZeRO-3): the peer across
            # the pipeline (same tp and dp coordinates) holds the same rows, so the local shards are exchanged.
            peer = self.last_rank if source is not None else self.first_rank
            local = _local_grad(ends[0]).contiguous()
            theirs = torch.empty_like(local)
            ops = [dist.P2POp(dist.isend, local, group=self.group, group_peer=peer),
                   dist.P2POp(dist.irecv, theirs, group=self.group, group_peer=peer)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            total = local + theirs if source is not None else theirs + local
        for param in ends:
            earlier = self._earlier.get(id(param))
            summed = total.clone() if earlier is None else local_tensor(earlier) + total
            param.grad = _like_param(param, summed)
        self._earlier = {}


def _local_grad(param: nn.Parameter) -> torch.Tensor:
    """This rank's part of ``param``'s gradient (zeros when it has none)."""
    return local_tensor(param.grad) if param.grad is not None else torch.zeros_like(local_tensor(param))


def _like_param(param: nn.Parameter, local: torch.Tensor) -> torch.Tensor:
    """``local`` as a gradient for ``param``: a DTensor with the parameter's placements when it is one."""
    if isinstance(param, DTensor):
        return DTensor.from_local(local, param.device_mesh, param.placements, shape=param.shape,
                                  stride=param.stride(), run_check=False)
    return local


def merged_view(stages: Iterable[nn.Module]) -> nn.Module:
    """A module whose parameter and buffer names are the single-process ones, over this rank's stages.

    Leaves (modules owning parameters or buffers) are shared with the stages; the containers above
    them are fresh, so building the view changes no stage. DCP's ``get_state_dict`` / ``set_state_dict``
    then see one model holding every parameter the optimizer steps. Wrapper names (activation
    checkpointing's) are left out of the view's paths: DCP strips them before it walks the names.
    """
    view = nn.Module()
    for stage in stages:
        for name, module in stage.named_modules():
            if not name or (not module._parameters and not module._buffers):
                continue
            name = canonical_name(f"{name}.").rstrip(".")
            parent, leaf = view, name.rsplit(".", 1)[-1]
            for part in name.split(".")[:-1]:
                child = parent._modules.get(part)
                if child is None:
                    child = nn.Module()
                    parent.add_module(part, child)
                parent = child
            existing = parent._modules.get(leaf)
            if existing is None:
                parent.add_module(leaf, module)
            elif existing is not module and _owns_state(existing):
                raise ValueError(f"two pipeline stages on one rank both hold '{name}'")
    return view


def _owns_state(module: nn.Module) -> bool:
    return any(True for _ in module.parameters()) or any(True for _ in module.buffers())
