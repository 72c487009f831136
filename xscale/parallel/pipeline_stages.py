"""Pipeline stages cut from the single-process Transformer, under its parameter names.

A stage keeps the modules it runs and drops the rest: the first stage the embedding, every stage
its blocks (``stack.layers.<k>`` for its layer indices k), the last stage the final norm, the head
transform and the output projection. Names are untouched, so the union of the stages' state dicts
is the single-process state dict and checkpoints move between layouts.

An encoder-decoder model (Raffel et al. 2020) is cut along the concatenation of its stacks: layer indices
0..n_layers-1 are the encoder's blocks (``stack.layers.<k>``), n_layers.. the decoder's (``decoder.layers.<k>``,
k = index - n_layers). Encoder stages send hidden states; the stage holding the last encoder block applies the
encoder's final norm and sends the memory; from the first decoder block on, stages send (decoder hidden, memory),
so the memory's gradient, which every decoder block's cross-attention adds to, comes back stage by stage. The
stage holding the first decoder block embeds the microbatch's ``decoder_input_ids`` itself (set by the engine
with :class:`decoder_input_ids`).

A parameter that several stages use is held by each of them (tied parameters): tied embeddings (Press & Wolf
2017) put ``output.weight`` on the last stage, and an encoder-decoder's first decoder stage holds
``decoder_embedding`` (and ``decoder_embedding_norm``), all copies of the first stage's ``embedding`` (and
``embedding_norm``), initialised from the single-process names. After backward the holders' gradients are summed
(Megatron's embedding group, Shoeybi et al. 2019), so the optimizer keeps the copies bitwise equal. Under tensor
parallelism the copies are sharded by vocabulary like the embedding, and each tp rank sums its shard with its
pipeline peers'.
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
from xscale.models.moe.token_ids import routing_token_ids
from xscale.models.position import PositionEncoding
from xscale.models.transformer import Transformer
from xscale.parallel.data import local_tensor

TIED_COPY = "output.weight"
TIED_SOURCE = "embedding.weight"
# The stage-local name of every tied copy -> the single-process parameter it copies.
DECODER_COPIES = {"decoder_embedding": "embedding", "decoder_embedding_norm": "embedding_norm"}


def tied_source_name(name: str) -> str:
    """The single-process name of a stage parameter (``name`` canonical): a tied copy's source, else itself."""
    if name == TIED_COPY:
        return TIED_SOURCE
    head, _, rest = name.partition(".")
    return f"{DECODER_COPIES[head]}.{rest}" if head in DECODER_COPIES else name


def is_tied_copy(name: str) -> bool:
    return tied_source_name(name) != name


def pipeline_layers(config) -> int:
    """The blocks a pipeline cuts: the encoder's then the decoder's for an encoder-decoder model."""
    return config.n_layers + (config.decoder_layers if config.family == "encoder_decoder" else 0)


_decoder_ids: torch.Tensor | None = None


class decoder_input_ids:  # noqa: N801  (used like contextlib's context managers)
    """The microbatch's ``decoder_input_ids`` that a pipeline stage holding the first decoder block embeds."""

    def __init__(self, token_ids: torch.Tensor | None) -> None:
        self.token_ids = token_ids
        self._previous: list[torch.Tensor | None] = []

    def __enter__(self) -> None:
        global _decoder_ids
        self._previous.append(_decoder_ids)
        _decoder_ids = self.token_ids

    def __exit__(self, *exc_info: object) -> None:
        global _decoder_ids
        _decoder_ids = self._previous.pop()


def split_layers(n_layers: int, num_stages: int, pp_split: list[int] | None = None,
                 what: str = "model.n_layers") -> list[list[int]]:
    """Layer indices per stage: ``pp_split`` blocks per stage when given, else as even as possible
    (the earlier stages take one more layer when ``num_stages`` does not divide ``n_layers``). ``what``
    names the layer count in messages."""
    if num_stages < 1:
        raise ConfigError(f"a pipeline needs at least one stage, got {num_stages}")
    if pp_split is None:
        if n_layers < num_stages:
            raise ConfigError(
                f"{what}={n_layers} cannot fill {num_stages} pipeline stages (parallel.pp x "
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
                f"parallel.pp_split={sizes} sums to {sum(sizes)} blocks but {what}={n_layers}; "
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
    """One pipeline stage: token ids (first stage) or what the previous stage sent in, hidden states out.

    The last stage returns the hidden states the LM head projects (after the final norm and the
    head transform); the engine's loss function applies ``output``. The forward mirrors
    :meth:`Transformer.hidden_states` for the layers this stage holds (indices into :func:`pipeline_layers`).
    Encoder-decoder stages take and return, by position: the first stage token ids; an encoder stage the hidden
    states; the stage after the encoder's end the memory; later decoder stages (decoder hidden, memory). The
    stage takes over (and prunes) ``model``'s modules: pass a copy.
    """

    def __init__(self, model: Transformer, layer_indices: list[int], *, is_first: bool, is_last: bool) -> None:
        super().__init__()
        config = self.config = model.config
        self.layer_indices = list(layer_indices)
        self.is_first, self.is_last = is_first, is_last
        self.seq2seq = config.family == "encoder_decoder"
        encoder = [index for index in layer_indices if index < config.n_layers]
        decoder = [index - config.n_layers for index in layer_indices if index >= config.n_layers]
        self.ends_encoder = self.seq2seq and config.n_layers - 1 in encoder
        self.starts_decoder = self.seq2seq and 0 in decoder
        self.embeds_midway = self.starts_decoder and not is_first  # token ids from the engine, not an input
        if is_first:
            self.embedding = model.embedding
            self.embedding_norm = model.embedding_norm
            self.embedding_dropout = model.embedding_dropout
        elif self.starts_decoder:  # copies of the first stage's (tied), under their own names
            self.decoder_embedding = model.embedding
            self.decoder_embedding_norm = model.embedding_norm
            self.decoder_embedding_dropout = model.embedding_dropout
        if encoder or not self.seq2seq:
            self.stack = self._prune(model.stack, encoder, is_first, keep_norm=is_last or self.ends_encoder)
        if decoder:
            self.decoder = self._prune(model.decoder, decoder, self.starts_decoder, keep_norm=is_last)
        if is_last:
            self.head_transform = model.head_transform
            self.output = model.output

    @staticmethod
    def _prune(stack: nn.Module, held_layers: list[int], embeds: bool, keep_norm: bool) -> nn.Module:
        held = {str(index) for index in held_layers}
        for name in [name for name in stack.layers if name not in held]:
            del stack.layers[name]
        stack.n_layers = len(held_layers)
        if not embeds and stack.position.adds_to_input:
            # Absolute positions are added once, before the stack's first block; later stages need no table.
            position = stack.position
            stack.position = PositionEncoding(position.d_model, position.n_heads, position.head_dim,
                                              position.max_seq_len, position.causal)
        if not keep_norm:
            stack.final_norm = None
        return stack

    def _embed(self, tokens: torch.Tensor, stack: nn.Module, embedding: nn.Module, norm: nn.Module | None,
               dropout: nn.Module) -> torch.Tensor:
        """:meth:`Transformer._embed_for_stack` with this stage's (copy of the) embedding."""
        x = embedding(tokens)
        if self.seq2seq and self.config.tie_embeddings:
            x = x * self.config.d_model**0.5
        x = stack.position.embed(x)
        if norm is not None:
            x = norm(x)
        return dropout(x)

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        stack = getattr(self, "stack", None)
        if stack is not None:
            x = inputs[0]
            if self.is_first:
                x = self._embed(x, stack, self.embedding, self.embedding_norm, self.embedding_dropout)
            for block in stack.layers.values():
                x = block(x, stack.position)
            if not self.seq2seq or self.ends_encoder:
                if stack.final_norm is not None:
                    x = stack.final_norm(x)
            if not self.seq2seq:
                return self._head(x)
            if not self.ends_encoder or not hasattr(self, "decoder"):
                return x  # encoder hidden states, or the memory
            memory = x
        else:
            memory = inputs[-1]
        decoder = self.decoder
        tokens = _decoder_ids
        if self.starts_decoder:
            if tokens is None:
                raise ValueError("the first decoder stage needs the microbatch's decoder_input_ids")
            if self.is_first:
                y = self._embed(tokens, decoder, self.embedding, self.embedding_norm, self.embedding_dropout)
            else:
                y = self._embed(tokens, decoder, self.decoder_embedding, self.decoder_embedding_norm,
                                self.decoder_embedding_dropout)
        else:
            y = inputs[0]
        with routing_token_ids(tokens):
            for block in decoder.layers.values():
                y = block(y, decoder.position, memory)
        if self.is_last:
            if decoder.final_norm is not None:
                y = decoder.final_norm(y)
            return self._head(y)
        # A new tensor (not a view: schedules detach their outputs in place), so the memory's gradient goes back.
        return y, memory.clone()

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_last and self.head_transform is not None:
            x = self.head_transform(x)
        return x


def build_stage_module(meta_model: Transformer, layer_indices: list[int], *, is_first: bool, is_last: bool,
                       device: torch.device | str, seed: int,
                       parallelize: Callable[[PipelineStageModule], None] | None = None) -> PipelineStageModule:
    """Cut a stage from a meta-device Transformer, apply ``parallelize`` to it (still on the meta device:
    tensor parallelism, activation checkpointing), allocate it on ``device`` and fill it with the
    single-process initial weights (tied copies take their source's values)."""
    model = copy.deepcopy(meta_model)
    stage = PipelineStageModule(model, layer_indices, is_first=is_first, is_last=is_last)
    untie = model.config.tie_embeddings and is_last and not is_first
    if untie:
        stage.output.weight = nn.Parameter(torch.empty_like(stage.output.weight))
    if parallelize is not None:
        parallelize(stage)
    stage.to_empty(device=device)
    names = {id(param): tied_source_name(canonical_name(name)) for name, param in stage.named_parameters()}
    init_weights(stage, model.config, seed, names=names)
    return stage


def tied_copy(stage: PipelineStageModule) -> nn.Parameter | None:
    """The last stage's copy of the tied embedding, or None (untied model, or first and last stage in one)."""
    if stage.is_last and not stage.is_first and stage.config.tie_embeddings:
        return stage.output.weight
    return None


def tied_holders(config, layers: list[list[int]]) -> dict[str, list[int]]:
    """Each tied parameter (single-process name) -> the stages holding it, when more than one does."""
    num_stages = len(layers)
    embedding_stages = {0}
    if config.tie_embeddings:
        embedding_stages.add(num_stages - 1)
    norm_stages = {0}
    if config.family == "encoder_decoder":
        start = next(stage for stage, held in enumerate(layers) if config.n_layers in held)
        embedding_stages.add(start)
        norm_stages.add(start)
    holders = {TIED_SOURCE: sorted(embedding_stages)}
    if config.embedding_norm:
        holders.update({"embedding_norm.weight": sorted(norm_stages), "embedding_norm.bias": sorted(norm_stages)})
    return {name: stages for name, stages in holders.items() if len(stages) > 1}


class TiedEmbeddingGrads:
    """Sums the gradients of the copies of each tied parameter held by different stages.

    Each rank holding copies adds its own (in stage order); ranks on other stages swap these partial sums
    point-to-point (no extra process group) and every holder adds the partials in rank order, so all copies
    get bitwise the same gradient. Gradients from earlier steps (accumulation) are set aside by :meth:`begin`
    and added back by :meth:`finish`, so only this step's are exchanged.

    The copies are looked up in the stages at each use: ZeRO-3 (``fully_shard``) replaces a module's
    parameters after the engine is built. Their gradients are then shards over ``dp_shard``, already
    summed over data parallel; the peers sit at the same data-parallel coordinate, so they hold
    the same rows and swap their local shards.
    """

    def __init__(self, stages: list[PipelineStageModule], stage_indices: list[int], stage_ranks: list[int],
                 holders: dict[str, list[int]], group: dist.ProcessGroup) -> None:
        self.group = group
        self.stages, self.stage_indices = stages, stage_indices
        self.rank = stage_ranks[stage_indices[0]]
        # name -> the pp ranks holding a copy, for the names this rank holds
        self.ranks = {name: sorted({stage_ranks[stage] for stage in stages_})
                      for name, stages_ in holders.items() if set(stages_) & set(stage_indices)}
        self._earlier: dict[int, torch.Tensor | None] = {}

    def _copies(self) -> dict[str, list[nn.Parameter]]:
        """This rank's copies of each tied parameter, in stage order."""
        found: dict[str, list[nn.Parameter]] = {name: [] for name in self.ranks}
        for stage in self.stages:
            seen: set[int] = set()
            for name, param in stage.named_parameters():
                source = tied_source_name(canonical_name(name))
                if source in found and id(param) not in seen:
                    seen.add(id(param))
                    found[source].append(param)
        return {name: params for name, params in found.items() if params}  # (a norm without a bias)

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
        """Every copy this rank holds of a parameter that other stages hold too."""
        return [param for params in self._copies().values() for param in params]

    def begin(self) -> None:
        ends = self.ends
        self._earlier = {id(param): param.grad for param in ends}
        for param in ends:
            param.grad = None

    @torch.no_grad()
    def finish(self) -> None:
        for name, params in self._copies().items():
            ranks = self.ranks[name]
            partial = _local_grad(params[0]).contiguous()
            for param in params[1:]:
                partial = partial + _local_grad(param)
            if len(ranks) > 1:
                received = {peer: torch.empty_like(partial) for peer in ranks if peer != self.rank}
                ops = [op for peer, buffer in received.items()
                       for op in (dist.P2POp(dist.isend, partial, group=self.group, group_peer=peer),
                                  dist.P2POp(dist.irecv, buffer, group=self.group, group_peer=peer))]
                for work in dist.batch_isend_irecv(ops):
                    work.wait()
                received[self.rank] = partial
                total = received[ranks[0]]
                for peer in ranks[1:]:
                    total = total + received[peer]
            else:
                total = partial
            for param in params:
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
