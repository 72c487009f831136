"""Pipeline stages cut from the single-process Transformer, under its parameter names.

A stage keeps the modules it runs and drops the rest: the first stage the embedding, every stage
its blocks (``stack.layers.<k>`` for its layer indices k), the last stage the final norm, the head
transform and the output projection. Names are untouched, so the union of the stages' state dicts
is the single-process state dict and checkpoints move between layouts.

Tied embeddings (Press & Wolf 2017) whose two ends sit on different stages become two parameters,
``embedding.weight`` on the first stage and ``output.weight`` on the last, both initialised from
``embedding.weight``. After backward their gradients are summed (Megatron's embedding group,
Shoeybi et al. 2019), so the optimizer keeps the copies bitwise equal. Under tensor parallelism both
are sharded by vocabulary alike, and each tp rank sums its shard with its pipeline peer's. A position
encoding that biases the logits of every layer (T5's table, Raffel et al. 2020) is shared the same way:
every stage holds a copy under the single-process name, and the copies' gradients are summed.

RealFormer blocks (He et al. 2020) pass their pre-softmax scores to the next block: a stage sends
``(x, scores)`` when a block before its end made scores that a block after it reads, else ``x``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from xscale.config import ConfigError
from xscale.models.init import canonical_name, init_weights
from xscale.models.position import PositionEncoding
from xscale.models.transformer import Transformer, run_blocks
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
        carrying = [block.layer_index for block in model.stack.blocks() if block.carries_scores]
        # RealFormer scores (He et al. 2020) cross a stage boundary when made before it and read after it.
        self.sends_scores = not is_last and any(i <= layer_indices[-1] for i in carrying) and any(
            i > layer_indices[-1] for i in carrying)
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

    def forward(self, x: torch.Tensor,
                scores: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Hidden states (or token ids, first stage), with the previous stage's RealFormer scores when it
        sends them; returns the hidden states, with the scores when this stage sends them."""
        if self.is_first:
            x = self.stack.position.embed(self.embedding(x))
            if self.embedding_norm is not None:
                x = self.embedding_norm(x)
            x = self.embedding_dropout(x)
        received = scores
        with _tapped_bias(self.stack.position, None if self.is_first else x):
            x, scores = run_blocks(list(self.stack.layers.values()), x, self.stack.position, scores=scores)
        if self.is_last:
            if self.stack.final_norm is not None:
                x = self.stack.final_norm(x)
            if self.head_transform is not None:
                x = self.head_transform(x)
        if not self.sends_scores:
            return x
        # Scores passed through untouched leave as a new tensor, so the schedule's backward reaches them.
        return x, scores.clone() if scores is received else scores


class _GradientTap(torch.autograd.Function):
    """Identity on ``value``, with an (unused) edge to ``anchor``, a stage input: see :func:`_tapped_bias`."""

    @staticmethod
    def forward(ctx, value: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        return value.view_as(value)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


@contextmanager
def _tapped_bias(position: PositionEncoding, anchor: torch.Tensor | None) -> Iterator[None]:
    """While a stage runs its blocks, each block's logit bias from a learned table (T5) passes through a
    :class:`_GradientTap` with an edge to the stage input ``anchor``.

    Zero-bubble schedules (Qi et al. 2024) split a stage's backward in two: the input half keeps, for each
    parameter, the gradients at the nodes where the parameter's path joins the input's, and the weight half
    later runs backward from those nodes to the parameter. For a table every block reads, the joining nodes
    would be the blocks' scores, and from block k's scores the way back to the table also runs through the
    blocks before it (which read it too): the weight half would redo the stage's backward on a freed graph.
    The tap is a joining node whose only way back is to the table.
    """
    tapping = (anchor is not None and anchor.requires_grad and torch.is_grad_enabled()
               and any(param.requires_grad for param in position.parameters()))
    if not tapping:
        yield
        return
    bias = position.bias  # the class's method (under tp, the one reading local parameters)
    position.bias = lambda *args, **kwargs: _tap(bias(*args, **kwargs), anchor)
    try:
        yield
    finally:
        del position.bias


def _tap(value: torch.Tensor | None, anchor: torch.Tensor) -> torch.Tensor | None:
    return None if value is None else _GradientTap.apply(value, anchor)


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


@dataclass(frozen=True)
class SharedParameter:
    """A single-process parameter of which several stages hold a copy: the tied embedding's two ends, or a
    position table every layer reads. ``find`` returns a holding stage's copy; it is called at each use,
    since ZeRO-3 (``fully_shard``) replaces a module's parameters after the engine is built."""

    name: str  # the single-process name (checkpoints, the initial value)
    stages: tuple[int, ...]  # the stages holding a copy
    find: Callable[[PipelineStageModule], nn.Parameter]


def _tied_end(stage: PipelineStageModule) -> nn.Parameter:
    return stage.embedding.weight if stage.is_first else stage.output.weight


def _position_parameter(stage: PipelineStageModule, name: str) -> nn.Parameter:
    return stage.stack.position.get_parameter(name)


def shared_parameters(model: Transformer, num_stages: int) -> list[SharedParameter]:
    """The parameters held by more than one of ``num_stages`` stages cut from ``model``."""
    shared = []
    if model.config.tie_embeddings:
        shared.append(SharedParameter(TIED_SOURCE, (0, num_stages - 1), _tied_end))
    if not model.stack.position.adds_to_input:  # every stage keeps the position module (see PipelineStageModule)
        for name, _ in model.stack.position.named_parameters():
            shared.append(SharedParameter(f"stack.position.{name}", tuple(range(num_stages)),
                                          partial(_position_parameter, name=name)))
    return shared


class SharedParameterGrads:
    """Sums the gradients of every copy of each shared parameter, so the optimizer keeps the copies bitwise equal.

    This rank first adds up its own copies (two stages of an interleaved or V schedule may both hold one); the
    pp ranks holding copies then swap these sums point-to-point (no extra process group) and each adds them in
    ascending pp rank order, so every copy gets bitwise the same gradient. Gradients from earlier steps
    (accumulation) are set aside by :meth:`begin` and added back by :meth:`finish`, so only this step's are
    exchanged.

    Copies are sharded alike on every stage: vocabulary rows of the tied embedding or a Replicate table under
    tp, FSDP2 rows under ZeRO-3, whose gradients are then already summed over data parallel. The peers across
    the pipeline sit at the same tp and data-parallel coordinates, so they hold the same rows and swap their
    local shards.
    """

    def __init__(self, stages: list[PipelineStageModule], stage_indices: list[int], stage_ranks: list[int],
                 shared: list[SharedParameter], group: dist.ProcessGroup) -> None:
        self.stages, self.stage_indices, self.group = stages, stage_indices, group
        self.shared = [entry for entry in shared if len(set(entry.stages)) > 1]
        self.ranks = {entry.name: sorted({stage_ranks[index] for index in entry.stages}) for entry in self.shared}
        self._earlier: dict[int, torch.Tensor | None] = {}

    def copies(self, entry: SharedParameter) -> list[nn.Parameter]:
        """This rank's copies of ``entry``, in stage order."""
        found = [entry.find(stage) for stage, index in zip(self.stages, self.stage_indices) if index in entry.stages]
        return list({id(param): param for param in found}.values())

    @property
    def uncounted(self) -> list[nn.Parameter]:
        """The copies the gradient norm leaves out: all but the lowest stage's, which stands for the parameter."""
        return [entry.find(stage) for entry in self.shared for stage, index in zip(self.stages, self.stage_indices)
                if index in entry.stages and index != min(entry.stages)]

    @property
    def tied_copy(self) -> nn.Parameter | None:
        """The last stage's copy of the tied embedding when this rank holds it."""
        return next((tied_copy(stage) for stage in self.stages if tied_copy(stage) is not None), None)

    def begin(self) -> None:
        params = [param for entry in self.shared for param in self.copies(entry)]
        self._earlier = {id(param): param.grad for param in params}
        for param in params:
            param.grad = None

    @torch.no_grad()
    def finish(self) -> None:
        for entry in self.shared:
            copies = self.copies(entry)
            if not copies:
                continue
            local = _local_grad(copies[0])
            for param in copies[1:]:
                local = local + _local_grad(param)
            total = self._sum_over_ranks(local.contiguous(), self.ranks[entry.name])
            for param in copies:
                earlier = self._earlier.get(id(param))
                summed = total.clone() if earlier is None else local_tensor(earlier) + total
                param.grad = _like_param(param, summed)
        self._earlier = {}

    def _sum_over_ranks(self, local: torch.Tensor, ranks: list[int]) -> torch.Tensor:
        """The sum of ``local`` over the pp ``ranks``, added in rank order (bitwise the same on each)."""
        me = dist.get_rank(self.group)
        if len(ranks) == 1:
            return local
        received = {peer: torch.empty_like(local) for peer in ranks if peer != me}
        ops = []
        for peer, buffer in received.items():
            ops.append(dist.P2POp(dist.isend, local, group=self.group, group_peer=peer))
            ops.append(dist.P2POp(dist.irecv, buffer, group=self.group, group_peer=peer))
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        parts = [local if peer == me else received[peer] for peer in ranks]
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
        return total


def _local_grad(param: nn.Parameter) -> torch.Tensor:
    """This rank's part of ``param``'s gradient (zeros when it has none)."""
    return local_tensor(param.grad) if param.grad is not None else torch.zeros_like(local_tensor(param))


def _like_param(param: nn.Parameter, local: torch.Tensor) -> torch.Tensor:
    """``local`` as a gradient for ``param``: a DTensor with the parameter's placements when it is one."""
    if isinstance(param, DTensor):
        return DTensor.from_local(local, param.device_mesh, param.placements, shape=param.shape,
                                  stride=param.stride(), run_check=False)
    return local


# Where merged_view puts a second copy of a shared module held by this rank (two stages of one rank).
SHARED_ALIAS = "_pipeline_copy"


def merged_view(stages: Iterable[nn.Module], shared: Iterable[str] = ()) -> nn.Module:
    """A module whose parameter and buffer names are the single-process ones, over this rank's stages.

    Leaves (modules owning parameters or buffers) are shared with the stages; the containers above
    them are fresh, so building the view changes no stage. DCP's ``get_state_dict`` / ``set_state_dict``
    then see one model holding every parameter the optimizer steps. Wrapper names (activation
    checkpointing's) are left out of the view's paths: DCP strips them before it walks the names.
    A module under a ``shared`` path (e.g. ``stack.position``) that two stages of this rank both hold
    appears once under its name and again under ``SHARED_ALIAS<k>.<name>``: the copies are equal, and
    :func:`drop_aliases` / :func:`add_aliases` keep the second out of checkpoints.
    """
    view = nn.Module()
    shared = set(shared)
    for stage in stages:
        for name, module in stage.named_modules():
            if not name or (not module._parameters and not module._buffers):
                continue
            name = canonical_name(f"{name}.").rstrip(".")
            path = name
            for count in range(1, 64):
                existing = _lookup(view, path)
                if existing is None or existing is module or name not in shared:
                    break
                path = f"{SHARED_ALIAS}{count}.{name}"
            parent, leaf = view, path.rsplit(".", 1)[-1]
            for part in path.split(".")[:-1]:
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


def _lookup(view: nn.Module, path: str) -> nn.Module | None:
    module = view
    for part in path.split("."):
        module = module._modules.get(part)
        if module is None:
            return None
    return module


def _is_alias(key: str) -> bool:
    return key.startswith(SHARED_ALIAS) or key.split(".", 1)[-1].startswith(SHARED_ALIAS)


def drop_aliases(state: dict) -> dict:
    """A model or (flattened) optimizer state dict without :func:`merged_view`'s second copies."""
    return {key: value for key, value in state.items() if not _is_alias(key)}


def add_aliases(state: dict, view: nn.Module, flat_optimizer: bool = False) -> dict:
    """The inverse of :func:`drop_aliases` for ``view``: each second copy gets a clone of its original's entries
    (``flat_optimizer``: keys are DCP's flattened optimizer ones, ``state.<name>.<key>``)."""
    aliases = [name for name, _ in [*view.named_parameters(), *view.named_buffers()] if name.startswith(SHARED_ALIAS)]
    result = dict(state)
    for alias in aliases:
        original = alias.split(".", 1)[1]
        for key, value in state.items():
            section, rest = key.split(".", 1) if flat_optimizer else ("", key)
            if rest == original or rest.startswith(f"{original}."):
                renamed = f"{alias}{rest[len(original):]}"
                result[f"{section}.{renamed}" if flat_optimizer else renamed] = (
                    value.clone() if isinstance(value, torch.Tensor) else value)
    return result


def _owns_state(module: nn.Module) -> bool:
    return any(True for _ in module.parameters()) or any(True for _ in module.buffers())
