"""Per-rank bytes of model state: predicted by the ZeRO paper's formulas, and measured on a live model.

ZeRO (Rajbhandari et al. 2020, sec. 5) with Psi parameters over N data-parallel ranks, in fp32 with AdamW
(4 bytes per value, two moments: K = 8 bytes of optimizer state per parameter; fp32 weights are their own master):

    stage 0 (DDP):        params 4 Psi     grads 4 Psi     optimizer 8 Psi
    stage 1 (P_os):       params 4 Psi     grads 4 Psi     optimizer 8 Psi / N
    stage 2 (P_os+g):     params 4 Psi     grads 4 Psi / N optimizer 8 Psi / N
    stage 3 (P_os+g+p):   params 4 Psi / N grads 4 Psi / N optimizer 8 Psi / N

Tensor and pipeline parallelism divide Psi first: each tp rank holds 1/tp of the parameters the tensor-parallel plan
splits and the whole of those it replicates (norms, position tables, GTrXL's gates, the Evolved Transformer's cell,
MoE layers: :func:`~xscale.parallel.tensor.shards.parameter_shards` reads the split from the declarations the plan
applies), Psi_S / tp + Psi_R, and pp the layers (Psi / pp on average). Per pipeline rank,
:func:`predicted_pipeline_state_bytes` applies the formulas to what that rank's stages hold: the first stage the
embedding, the last the head, and with tied embeddings the last its own copy, as an encoder-decoder's first decoder stage holds
one of the embedding (so the stages hold more than Psi). Under expert parallelism the Psi_E expert
parameters are divided by ep x pp (experts are replicated over tp; ep = 1 without it) and ZeRO shards them over the edp
ranks that hold the same experts, N_E = dp / ep, instead of N. Context parallelism (cp) does not divide Psi: its
ranks hold the same parameters, and ZeRO shards over them too, N = dp x cp (N_E = dp / ep x cp).

A rank's peak (:class:`PeakTerms`, ``xscale inspect --measure``, ``xscale bench memory``) adds to the model state
the largest of two phases: forward/backward (activations, each rank's share by
:func:`activation_share`, plus ZeRO-3's temporarily gathered weights, :func:`all_gather_bytes`) and the optimizer
step (:func:`step_temporary_bytes`). What a layout allocates itself is a term of its own: tensor parallelism's
vocabulary-parallel loss (:func:`vocab_parallel_loss_bytes`, in place of the fused loss's logits chunk the
single-device step holds, :func:`fused_loss_chunk_bytes`), the pipeline's receive buffers
(:func:`pipeline_buffer_bytes`) and what it has sent (:func:`pipeline_send_bytes`), expert parallelism's all-to-all
buffers (:func:`expert_exchange_bytes`), and, over several microbatches, the last one's backward with every gradient the
earlier ones accumulated (:func:`accumulated_backward_bytes`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from xscale.config.schema import Config
from xscale.estimate.activations import extra_block_activations
from xscale.estimate.model_shape import capacity_share
from xscale.models import build_model
from xscale.models.parameters import experts_per_token
from xscale.ops.chunked_cross_entropy import default_chunk_tokens, padded_row_length
from xscale.ops.optimizer_update import update_mode
from xscale.parallel.data import is_expert_parameter, local_tensor
from xscale.parallel.data.gather import GATHER_WINDOW_BYTES
from xscale.parallel.dims import ParallelDims
from xscale.parallel.pipeline import SCHEDULES
from xscale.parallel.pipeline.cost import stage_layers
from xscale.parallel.pipeline.stages import cut_stage, stage_to_rank
from xscale.parallel.pipeline.vocabulary import vocabulary_shard, vocabulary_stage_count
from xscale.parallel.tensor.shards import block_shards, parameter_shards

BYTES_PER_VALUE = 4
OPTIMIZER_VALUES = 2  # AdamW: exp_avg, exp_avg_sq


def predicted_state_bytes(num_params: int, dims: ParallelDims, expert_params: int = 0,
                          tp_replicated: int = 0) -> dict[str, float]:
    """Bytes of parameters, gradients and optimizer state on one rank under ``dims`` (formulas above);
    ``expert_params`` of the ``num_params`` are MoE expert weights, ``tp_replicated`` the other parameters that every
    tp rank holds whole (:func:`tensor_parallel_replicated`)."""
    stage = dims.zero_stage if dims.dp_cp > 1 else 0
    # context-parallel ranks hold the same parameters: ZeRO shards over dp x cp
    kinds = [(num_params - expert_params - tp_replicated, dims.tp * dims.pp, dims.dp_cp),
             (tp_replicated, dims.pp, dims.dp_cp),
             (expert_params, dims.ep * dims.pp, dims.edp * dims.cp)]
    state = {"parameters": 0.0, "gradients": 0.0, "optimizer": 0.0}
    for count, model_parallel, n in kinds:
        value = BYTES_PER_VALUE * count / model_parallel
        state["parameters"] += value / n if stage >= 3 else value
        state["gradients"] += value / n if stage >= 2 else value
        state["optimizer"] += OPTIMIZER_VALUES * value / n if stage >= 1 else OPTIMIZER_VALUES * value
    return state


def tensor_parallel_replicated(model: nn.Module, tp: int) -> int:
    """The non-expert parameters of ``model`` (a model or a pipeline stage, on any device) that the tensor-parallel
    plan leaves whole on each of ``tp`` ranks (:func:`~xscale.parallel.tensor.shards.parameter_shards`); 0 at tp=1."""
    if tp == 1:
        return 0
    shards = parameter_shards(model, tp)
    return sum(param.numel() for name, param in model.named_parameters()
               if shards[name] is None and not is_expert_parameter(name))


def model_parameters(config: Config, tp: int) -> tuple[int, int, int]:
    """(parameters, expert parameters, parameters whole on every tp rank) of the model, counted on the meta device
    (tied weights once)."""
    meta = build_model(config.model, materialize=False)
    named = list(meta.named_parameters())
    return (sum(param.numel() for _, param in named),
            sum(param.numel() for name, param in named if is_expert_parameter(name)),
            tensor_parallel_replicated(meta, tp))


def predicted_model_state_bytes(config: Config, dims: ParallelDims) -> dict[str, float]:
    """:func:`predicted_state_bytes` of a rank of a layout without a pipeline (every rank holds the same bytes)."""
    total, expert, replicated = model_parameters(config, dims.tp)
    return predicted_state_bytes(total, dims, expert, replicated)


def pipeline_rank_parameters(config: Config, dims: ParallelDims) -> list[tuple[int, int, int]]:
    """(parameters, expert parameters, parameters whole on every tp rank) of each pp rank's stages, counted on
    meta-device stage modules."""
    parallel = config.parallel
    num_stages = dims.pp * parallel.pp_stages_per_rank
    ranks = stage_to_rank(num_stages, dims.pp, SCHEDULES[parallel.pp_schedule].placement)
    meta = build_model(config.model, materialize=False)
    counts = [[0, 0, 0] for _ in range(dims.pp)]
    vocabulary = vocabulary_stage_count(parallel)
    for index, layers in enumerate(stage_layers(config, num_stages)):
        stage = cut_stage(meta, layers, vocabulary_shard(index, ranks, vocabulary), vocabulary > 0)
        for name, param in stage.named_parameters():  # a last stage's output.weight is the tied copy
            counts[ranks[index]][0] += param.numel()
            counts[ranks[index]][1] += param.numel() if is_expert_parameter(name) else 0
        counts[ranks[index]][2] += tensor_parallel_replicated(stage, dims.tp)
    return [(total, expert, replicated) for total, expert, replicated in counts]


def predicted_pipeline_state_bytes(config: Config, dims: ParallelDims) -> list[dict[str, float]]:
    """:func:`predicted_state_bytes` of each pp rank over the parameters its stages hold."""
    within_stage = dataclasses.replace(dims, pp=1)
    return [predicted_state_bytes(total, within_stage, expert, replicated)
            for total, expert, replicated in pipeline_rank_parameters(config, dims)]


@dataclass
class PeakTerms:
    """One rank's predicted bytes, term by term. ``peak`` = parameters + optimizer state + the largest of the
    forward/backward peak (gathered weights + the loss's and the pipeline's buffers + the larger of activations with
    the gradients alive then and the last microbatch's backward), the optimizer step (all gradients + the step's
    temporaries) and, under ZeRO-1/2's overlapped gather, the next forward's start."""

    parameters: float
    gradients: float
    optimizer: float
    activations: float = 0.0
    all_gather: float = 0.0
    live_gradients: float | None = None  # gradients alive at the forward/backward peak; None: all of them
    step_temporaries: float = 0.0
    vocab_parallel_loss: float = 0.0  # tp: the loss's logits shard and its copies (vocab_parallel_loss_bytes)
    pipeline_buffers: float = 0.0  # pp: received and sent hidden states and gradients (pipeline_*_bytes)
    expert_exchange: float = 0.0  # ep: one MoE layer's all-to-all buffers (expert_exchange_bytes)
    accumulated_backward: float = 0.0  # the last microbatch's backward (accumulated_backward_bytes)
    gather_in_forward: float = 0.0  # ZeRO-1/2: gathered parameters still in flight late in the forward
    forward_start: float = 0.0  # ZeRO-1/2: what the next forward starts with (parameter_gather_bytes)

    @property
    def model_state(self) -> float:
        return self.parameters + self.gradients + self.optimizer

    @property
    def peak(self) -> float:
        live = self.gradients if self.live_gradients is None else self.live_gradients
        layout_buffers = (self.all_gather + self.gather_in_forward + self.vocab_parallel_loss + self.pipeline_buffers
                          + self.expert_exchange)
        backward = layout_buffers + max(self.activations + live, self.accumulated_backward)
        return self.parameters + self.optimizer + max(backward, self.gradients + self.step_temporaries,
                                                      self.forward_start)


@dataclass
class UnitSizes:
    """Parameter counts of one rank's stages before any sharding: ``root`` (embedding, final norms, head: FSDP's
    root unit) and each block (one FSDP unit each); ``largest`` the largest single parameter. ``replicated_root`` and
    ``replicated_blocks``: of those, the parameters the tensor-parallel plan keeps whole on every tp rank (MoE
    layers' experts too; ep is not modelled in the terms these feed) (none given: all split)."""

    root: int
    blocks: list[int]
    largest: int
    replicated_root: int = 0
    replicated_blocks: list[int] | None = None

    def per_tp_rank(self, tp: int) -> tuple[float, list[float]]:
        """(root, blocks) as one of ``tp`` ranks holds them: 1/tp of what the plan splits, all of what it keeps
        whole."""
        replicated = self.replicated_blocks or [0] * len(self.blocks)
        return ((self.root - self.replicated_root) / tp + self.replicated_root,
                [(held - whole) / tp + whole for held, whole in zip(self.blocks, replicated, strict=True)])


def unit_sizes(config: Config, layers: list[int] | None = None, tp: int = 1) -> UnitSizes:
    """:class:`UnitSizes` of the model on the meta device, or of the stage holding ``layers`` (pipeline), with what
    ``tp`` ranks hold whole."""
    model = build_model(config.model, materialize=False)
    if layers is not None:
        model.keep_layers(layers)
    stacks = [stack for stack in (getattr(model, "stack", None), getattr(model, "decoder", None)) if stack is not None]
    units = [block for stack in stacks for block in stack.layers.values()]
    blocks = [sum(p.numel() for p in block.parameters()) for block in units]
    total = sum(p.numel() for p in model.parameters())
    if tp == 1:
        return UnitSizes(total - sum(blocks), blocks, max(p.numel() for p in model.parameters()))
    shards = parameter_shards(model, tp)
    replicated = sum(param.numel() for name, param in model.named_parameters() if shards[name] is None)
    replicated_blocks = [sum(param.numel() for name, param in block.named_parameters() if name not in split)
                         for block, split in ((block, block_shards(block, tp)) for block in units)]
    return UnitSizes(total - sum(blocks), blocks, max(p.numel() for p in model.parameters()),
                     replicated - sum(replicated_blocks), replicated_blocks)


GATHERED_BLOCKS = 2  # FSDP2's implicit prefetch: the block that runs and the next one, gathered at once
GATHER_COPIES = 2  # a gathered unit lives twice while it is copied out of the flat all-gather output


def all_gather_bytes(config: Config, dims: ParallelDims, sizes: UnitSizes) -> float:
    """ZeRO-3's (FSDP2's) temporarily unsharded weights on one rank during forward and backward, in the compute
    dtype (2 bytes under bf16), 0 without ZeRO-3: the root unit stays gathered from forward to backward
    (:mod:`xscale.parallel.data.fsdp`) minus the rank's own shard, plus ``GATHERED_BLOCKS`` blocks at once (all of a
    pipeline stage's blocks: they stay gathered over its microbatches), each counted ``GATHER_COPIES`` times (the
    flat all-gather output and the unsharded parameters it is copied into), each unit as a tp rank holds it
    (:meth:`UnitSizes.per_tp_rank`)."""
    if not dims.fsdp:
        return 0.0
    value_bytes = 2 if config.train.low_precision else BYTES_PER_VALUE
    n = dims.dp_cp
    root, per_block = sizes.per_tp_rank(dims.tp)
    blocks = per_block if dims.pp > 1 else sorted(per_block)[-GATHERED_BLOCKS:]
    gathered = root * (1 - 1 / n) + GATHER_COPIES * sum(blocks)
    return value_bytes * gathered


def parameter_gather_bytes(config: Config, dims: ParallelDims, sizes: UnitSizes,
                           gradients: float) -> tuple[float, float]:
    """ZeRO-1/2 with ``parallel.overlap_param_gather``: (the next forward's start, late in that forward). The
    optimizer step starts gathering the updated parameters, ``GATHER_WINDOW_BYTES`` in flight at once (or one larger
    bucket: ``parallel.bucket_mb``, or one larger parameter), and each module's forward unpacks its own and frees them
    (:mod:`xscale.parallel.data.gather`). So the forward starts with that window of gathered copies next to the
    gradient buffers ZeRO-1 keeps (its ``gradients``); late in it, its activations nearly all made, the window holds
    at most the copies of the last block and of an untied head (units as a tp rank holds them). (0, 0) otherwise."""
    if not (dims.dp_cp > 1 and dims.zero_stage in (1, 2) and config.parallel.overlap_param_gather):
        return 0.0, 0.0
    model = config.model
    root, blocks = sizes.per_tp_rank(dims.tp)
    window = max(GATHER_WINDOW_BYTES, config.parallel.bucket_mb * 2**20, BYTES_PER_VALUE * sizes.largest / dims.tp)
    in_flight = min(BYTES_PER_VALUE * (root + sum(blocks)), window)
    head = 0 if model.tie_embeddings else model.vocab_size * model.d_model / dims.tp  # split by vocabulary
    kept = gradients if dims.zero_stage == 1 else 0.0
    return kept + in_flight, min(in_flight, BYTES_PER_VALUE * (max(blocks, default=0) + head))


def largest_gradient_bytes(dims: ParallelDims, sizes: UnitSizes) -> float:
    """The largest parameter's whole gradient as autograd makes it (tp divides it)."""
    return BYTES_PER_VALUE * sizes.largest / dims.tp


def live_gradient_bytes(dims: ParallelDims, gradients: float, fraction: float, sizes: UnitSizes) -> float:
    """Gradient bytes alive at the forward/backward peak. DDP and ZeRO-1 keep every gradient in bucket buffers
    from step to step (:mod:`xscale.parallel.data.buckets`); elsewhere gradients are freed after each step and the
    peak comes early in backward, when ``fraction`` of them exist (measured on the fake step). Either way add the
    largest parameter's whole gradient (tp divides it) as autograd makes it: the head's, next to the logits'
    gradient, before it is copied into its bucket or reduce-scattered to this rank's shard."""
    largest = largest_gradient_bytes(dims, sizes)
    if dims.dp_cp > 1 and dims.zero_stage <= 1:
        return gradients + largest
    return fraction * gradients + largest


STEP_TEMPORARIES = {"per_parameter": 3, "foreach": 1, "fused": 0}  # see step_temporary_bytes


def step_temporary_bytes(config: Config, dims: ParallelDims, sizes: UnitSizes, local_parameters: float) -> float:
    """The optimizer step's temporaries on one rank (:mod:`xscale.train.optim`): one parameter at a time, 3 of the
    largest local piece (``sqrt(v)``, its bias correction and the weight-decay product, each the piece's size;
    ZeRO-1..3 and tp divide it); ``foreach``, one of every local parameter at once (``local_parameters`` bytes);
    ``fused``, none."""
    mode = update_mode(config.train.optimizer_foreach, "cuda" if torch.cuda.is_available() else "cpu")
    if mode == "foreach":
        return local_parameters
    shards = dims.dp_cp if dims.zero_stage >= 1 and dims.dp_cp > 1 else 1
    return STEP_TEMPORARIES[mode] * BYTES_PER_VALUE * sizes.largest / (shards * dims.tp)


def replicated_activation_fraction(config: Config) -> float:
    """Share of a layer's activations that tensor parallelism without sequence parallelism leaves whole on every
    rank: 10 of s b h (34 + 5 a s / h) (Korthikanti et al. 2022, eq. 2), with what a block kind's parts kept whole
    store beyond the standard block's (:func:`~xscale.estimate.activations.extra_block_activations`: GTrXL's gates)."""
    model = config.model
    whole = extra_block_activations(model)
    return (10 + whole) / (34 + whole + 5 * model.n_heads * config.train.seq_len / model.d_model)


def activation_share(config: Config, dims: ParallelDims) -> float:
    """A rank's share of one device's activations: 1/tp under sequence parallelism (eq. 5), else all but the
    replicated part divided by tp (eq. 2); context parallelism divides by cp (each rank's T/cp queries)."""
    if dims.tp == 1 or config.parallel.sequence_parallel:
        return 1 / dims.tp / dims.cp
    replicated = replicated_activation_fraction(config)
    return (replicated + (1 - replicated) / dims.tp) / dims.cp


def head_activation_share(config: Config, dims: ParallelDims, head: float, tokens: int) -> float:
    """A rank's share of the head's measured activations (embedding output, final norm, fused loss; ``head``
    bytes for ``tokens`` tokens): under tp, the fused loss's logits chunk gives way to the vocabulary-parallel loss
    (a term of its own) and the rest is replicated (1/tp under sequence parallelism); else
    :func:`activation_share`."""
    if dims.tp == 1:
        return head * activation_share(config, dims)
    rest = max(head - fused_loss_chunk_bytes(config, tokens), 0.0)
    return rest / (dims.tp if config.parallel.sequence_parallel else 1) / dims.cp


def microbatches_in_flight(config: Config, pp: int, pp_rank: int) -> int:
    """Micro-batches whose activations a pipeline rank holds at once (GPipe: all; 1F1B: pp - rank)."""
    microbatches = config.parallel.microbatches or pp
    return microbatches if config.parallel.pp_schedule == "gpipe" else min(pp - pp_rank, microbatches)


LOSS_LOGIT_COPIES = 3  # the vocabulary-parallel loss's forward: the logits shard, shifted by the max, their exp


def vocab_parallel_loss_bytes(config: Config, dims: ParallelDims, tokens: int, microbatches: int = 1) -> float:
    """Tensor parallelism's vocabulary-parallel cross-entropy (:mod:`xscale.parallel.tensor.vocab_parallel`) on one
    rank: its forward holds ``LOSS_LOGIT_COPIES`` fp32 (tokens, V/tp) tensors at once (under bf16 also the bf16
    logits), and keeps one (the softmax, for backward) for each further microbatch in flight; 0 without tp."""
    if dims.tp == 1 or config.model.num_classes > 0:
        return 0.0
    shard = tokens * config.model.vocab_size / dims.tp
    low_precision = 2 if config.train.low_precision else 0
    return shard * (BYTES_PER_VALUE * (LOSS_LOGIT_COPIES + microbatches - 1) + low_precision)


def fused_loss_chunk_bytes(config: Config, tokens: int) -> float:
    """The fp32 logits chunk (min(tokens, chunk) x V) of the single-device fused loss
    (:mod:`xscale.ops.chunked_cross_entropy`): part of the measured head, what tensor parallelism's loss replaces."""
    if config.model.num_classes > 0:
        return 0.0
    vocab = config.model.vocab_size
    return float(BYTES_PER_VALUE * default_chunk_tokens(tokens, vocab) * padded_row_length(vocab))


def pipeline_buffer_bytes(config: Config, dims: ParallelDims, tokens: int, stages: list[int]) -> float:
    """The pipeline's own buffers on the rank running ``stages`` (:mod:`torch.distributed.pipelining` allocates
    them for every microbatch of the step and keeps them): every stage but the first a receive buffer of the
    hidden states (tokens x d, fp32; this tp rank's T/tp under sequence parallelism), every stage but the last one
    of their gradient."""
    if dims.pp == 1:
        return 0.0
    hidden = BYTES_PER_VALUE * tokens * config.model.d_model / (dims.tp if config.parallel.sequence_parallel else 1)
    last = dims.pp * config.parallel.pp_stages_per_rank - 1
    buffers = sum(stage > 0 for stage in stages) + sum(stage < last for stage in stages)
    return hidden * dims.microbatches * buffers


def pipeline_send_bytes(config: Config, dims: ParallelDims, tokens: int, stages: list[int]) -> float:
    """What the pipeline has sent and still references on the rank running ``stages``: every stage but the last its
    output of each microbatch (the stage keeps it for that microbatch's backward, ``fwd_cache``), every stage but the
    first the gradient of its input (held by the send until it is waited for), each a hidden state (tokens x d, fp32;
    T/tp under sequence parallelism). torch's 1F1B (one stage per rank, its index the rank r) waits for each send
    before the next: its outputs are the microbatches in flight, min(pp - r, m), and one gradient; GPipe and the
    schedules run from an action list (interleaved 1F1B, ZB-V) wait for their sends at the end of the step (GPipe
    its forward's after the last forward, when every output is still kept for its backward anyway): m of each."""
    if dims.pp == 1:
        return 0.0
    hidden = BYTES_PER_VALUE * tokens * config.model.d_model / (dims.tp if config.parallel.sequence_parallel else 1)
    last = dims.pp * config.parallel.pp_stages_per_rank - 1
    microbatches = dims.microbatches
    if config.parallel.pp_schedule == "1f1b":
        outputs = sum(min(dims.pp - stage, microbatches) for stage in stages if stage < last)
        gradients = sum(stage > 0 for stage in stages)
    else:
        outputs = microbatches * sum(stage < last for stage in stages)
        gradients = microbatches * sum(stage > 0 for stage in stages)
    return hidden * (outputs + gradients)


def expert_exchange_bytes(config: Config, dims: ParallelDims, tokens: int, moe_layers: int) -> float:
    """Expert parallelism's all-to-all buffers (:mod:`xscale.parallel.expert.plan`) on a rank running ``moe_layers``
    MoE layers, one layer's at a time: the dispatch receives the routed tokens (R rows of d), the combine receives
    their outputs (R rows), one buffer per direction, 2 R d x 4 bytes (fp32 hidden states) in the forward, as many
    gradients in the backward. R = tokens x k x capacity factor (experts_per_token, the capacity the router pads
    each expert to; balanced load: what a rank sends, it receives); 0 without ep or MoE layers."""
    if dims.ep == 1 or moe_layers == 0:
        return 0.0
    routed = tokens * experts_per_token(config.model.moe) * capacity_share(config)
    return 2 * routed * config.model.d_model * BYTES_PER_VALUE


def accumulated_backward_bytes(microbatches: int, in_flight: int, held: float, transient: float, gradients: float,
                               largest: float) -> float:
    """With gradients accumulated over ``microbatches`` (> 1: a pipeline's, or micro-batches of the local batch), a
    backward after the first: every gradient exists, and the microbatches still in flight hold their activations
    (``held`` bytes each, at their activation peak: min(in flight, m - 1), as in 1F1B's steady state or GPipe's
    second backward), plus the head's ``transient`` once and the ``largest`` gradient being made; 0 for one
    microbatch (the peak is then early in backward, :func:`live_gradient_bytes`)."""
    if microbatches == 1:
        return 0.0
    return min(in_flight, microbatches - 1) * held + transient + gradients + largest


def _unique_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes held by ``tensors``: the union of their memory ranges, so views and slices of one buffer count once
    (0-dim counters skipped)."""
    ranges = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
                    for t in map(local_tensor, tensors) if t.ndim > 0 and t.numel() > 0)
    total, end = 0, -1
    for start, stop in ranges:
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def measured_state_bytes(model, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """What this rank holds right after backward (before the optimizer step): parameters, gradients (whole,
    ZeRO-2 chunks, or the gradient buffers DDP and ZeRO-1 keep between steps) and optimizer moments."""
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    grads += [shard.grad for group in optimizer.param_groups for shard in group["params"] if shard.grad is not None]
    data_parallel = getattr(model, "data_parallel", None)
    if data_parallel is not None:
        grads += data_parallel.gradient_buffers()
    moments = [value for state in optimizer.state.values() for value in state.values()
               if isinstance(value, torch.Tensor)]
    return {"parameters": _unique_bytes(params), "gradients": _unique_bytes(grads), "optimizer": _unique_bytes(moments)}
