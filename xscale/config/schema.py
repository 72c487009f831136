"""Typed run configuration: model, parallel layout, training, data, checkpoint, launch.

A run is described by one YAML file plus dotted command-line overrides
(``train.steps=50 model.norm=rmsnorm``), read by :mod:`xscale.config.load`. Everything is validated before any
process group, model or dataset exists: an unknown key names the closest valid
key, a wrong type or an impossible value says what to change.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar


class ConfigError(ValueError):
    """A configuration that cannot run; the message says what to change."""


@dataclass(eq=False)
class Component:
    """A named component and its options: ``{kind: NAME, options: {...}}`` (a bare ``NAME`` is short for
    ``{kind: NAME}``). The options are checked against the component's ``Options`` dataclass, the one place its
    settings, defaults and ranges live, by the layer that registers it (:mod:`xscale.models.registry`)."""

    kind: str
    options: dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        return self.kind

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Component):
            return (self.kind, self.options) == (other.kind, other.options)
        # A component compared with its name would always be unequal: a mistake to make loud, not silent.
        raise TypeError(f"a component ({self.kind}) compared with {other!r}: compare its .kind")

    __hash__ = None  # type: ignore[assignment]  (mutable options; a dict key would be the kind)


class NamesComponents:
    """A section whose component fields (:attr:`COMPONENTS`) take a bare kind too: ``ModelConfig(norm="layernorm")``
    and ``config.norm = "layernorm"`` hold ``Component("layernorm")``."""

    COMPONENTS: tuple[str, ...] = ()

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self.COMPONENTS and isinstance(value, str):
            value = Component(value)
        super().__setattr__(name, value)


@dataclass
class AttentionConfig:
    """Which attention core each layer uses (``xscale.models.attention`` registry)."""

    kind: str = "dense"
    # Optional per-layer kinds, cycled over the layers (Sparse Transformer alternates, e.g. [local, strided]).
    per_layer: list[str] | None = None
    # Variant options (window, block_size, num_features, ...); each variant validates its own keys.
    options: dict[str, Any] = field(default_factory=dict)

    def kind_for_layer(self, layer_index: int) -> str:
        if self.per_layer:
            return self.per_layer[layer_index % len(self.per_layer)]
        return self.kind


@dataclass
class MoEConfig(NamesComponents):
    """Mixture-of-Experts FFN (GShard / Switch / expert choice / hash); ``num_experts=0`` disables it."""

    COMPONENTS: ClassVar[tuple[str, ...]] = ("router",)

    num_experts: int = 0
    top_k: int = 1
    router: Component = field(default_factory=lambda: Component("switch"))  # expert_choice | gshard | hash | switch
    capacity_factor: float = 1.25
    eval_capacity_factor: float = 2.0
    min_capacity: int = 4
    drop_policy: str = "probs"
    dropless: bool = False
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.001
    jitter: float = 0.0
    router_dtype: str = "float32"
    shared_expert: bool = False
    every: int = 1
    # GShard: dispatch the second expert with probability proportional to its gate (False: always).
    second_expert_policy: str = "sampling"

    def is_moe_layer(self, layer_index: int) -> bool:
        return self.num_experts > 0 and (layer_index + 1) % self.every == 0


@dataclass
class ModelConfig(NamesComponents):
    """The Transformer: family, width, depth and the named component of each kind."""

    COMPONENTS: ClassVar[tuple[str, ...]] = ("position", "norm", "ffn", "stack", "block", "objective_head")

    family: str = "decoder"  # decoder | encoder | encoder_decoder
    vocab_size: int = 0  # 0: the tokenizer's (or the dataset's) vocabulary, padded to 128 x parallel.tp
    d_model: int = 256
    n_layers: int = 4
    n_decoder_layers: int | None = None  # encoder_decoder only; defaults to n_layers
    n_heads: int = 4
    n_kv_heads: int | None = None  # None: = n_heads (MHA); 1: MQA; G: GQA
    d_ff: int | None = None  # None: 4*d_model, or 8/3*d_model rounded for GLU FFNs
    max_seq_len: int = 256
    # The named components, each {kind, options} (xscale inspect --components lists the kinds and their options).
    position: Component = field(default_factory=lambda: Component("rope"))
    norm: Component = field(default_factory=lambda: Component("rmsnorm"))
    norm_placement: str = "pre"  # pre | post | sandwich | rezero | deepnorm
    embedding_norm: bool = False  # norm after the embeddings (BERT)
    ffn: Component = field(default_factory=lambda: Component("swiglu"))
    bias: bool = False
    dropout: float = 0.0
    attention_dropout: float = 0.0
    tie_embeddings: bool = True
    share_layers: bool = False  # ALBERT / Universal Transformer: one block reused across depth
    # How the stack runs its blocks: plain | reversible | act | funnel | early_exit (xscale.models.stacks)
    stack: Component = field(default_factory=lambda: Component("plain"))
    # What one block holds and in which order: standard | macaron | sandwich | gtrxl (xscale.models.blocks)
    block: Component = field(default_factory=lambda: Component("standard"))
    # A pre-training objective's extra head: none | span_boundary (SpanBERT) | sentence_pair (NSP, SOP) |
    # replaced_token_detection (ELECTRA's generator and discriminator); the
    # objective that needs one names it (train.objective; docs/variants.md)
    objective_head: Component = field(default_factory=lambda: Component("none"))
    lm_head_transform: bool = False  # BERT MLM head: dense + act + norm before the vocab projection
    lm_head_bias: bool = False
    init_std: float = 0.02
    init: str = "normal"  # normal | admin (Liu et al. 2020: post-norm residuals scaled by omega, docs/variants.md)
    num_classes: int = 0  # > 0: a sequence-classification head (train.task=classify fills it from the labels)
    pooling: str = "cls"  # classification: cls (a class token prepended) | mean | max (over the real tokens)
    input: str = "tokens"  # tokens (ids) | patches (ViT: images cut into patch_size^2 patches, docs/classification.md)
    image_size: int = 16  # model.input=patches: image_size x image_size images of image_channels channels
    image_channels: int = 3
    patch_size: int = 4
    segment_memory: int = 0  # Transformer-XL recurrence: remembered states per layer (0: off; docs/variants.md)
    compressed_memory: int = 0  # Compressive Transformer: compressed states per layer (0: off), rate c, f_c below
    compression_rate: int = 2
    compression: str = "conv"  # conv | mean
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def ffn_hidden(self) -> int:
        if self.d_ff is not None:
            return self.d_ff
        if self.ffn.kind in ("swiglu", "geglu", "reglu"):
            # 2/3 of 4d keeps parameters equal to the 4d MLP (Shazeer 2020); round up to a multiple of 64.
            hidden = int(8 * self.d_model / 3)
            return 64 * ((hidden + 63) // 64)
        return 4 * self.d_model

    @property
    def decoder_layers(self) -> int:
        return self.n_decoder_layers if self.n_decoder_layers is not None else self.n_layers

    @property
    def total_layers(self) -> int:
        """Blocks a pipeline cuts: the encoder's (or the one stack's), then the decoder's of an encoder-decoder."""
        return self.n_layers + (self.decoder_layers if self.family == "encoder_decoder" else 0)


@dataclass
class ParallelConfig:
    """The layout: one DeviceMesh with dimensions (pp, dp_replicate, dp_shard, tp); ep folds into data parallel.

    ``microbatches`` left unset (None, YAML ``null``) means "auto": the fewest the pipeline schedule runs that divide
    each data-parallel rank's batch evenly (parallel.pp for 1f1b, interleaved_1f1b and zero_bubble; 1 for gpipe and
    without a pipeline), resolved once the world size is known (``xscale.parallel.checks.resolve_dims``, with
    ``xscale.parallel.pipeline.resolve_microbatches``). A set value is validated as given, never changed.
    """

    dp_replicate: int = 1
    dp_shard: int = -1  # -1: whatever the world size leaves
    tp: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1  # context parallelism: each sequence's tokens sharded over cp ranks (xscale.parallel.context)
    cp_load_balance: bool = False  # cp rank r holds chunks r and 2cp-1-r of 2cp (even causal work)
    pp_schedule: str = "1f1b"  # gpipe | 1f1b | interleaved_1f1b | zero_bubble
    pp_stages_per_rank: int = 1
    pp_split: list[int] | None = None  # blocks per stage; None: as even as possible
    # The output projection and the loss split by vocabulary over the pp ranks, as the last pp stages
    # (xscale.parallel.pipeline.vocabulary): interleaved_1f1b or zero_bubble
    pp_vocab_parallel: bool = False
    microbatches: int | None = None  # pipeline microbatches per step and dp rank; None (null): auto (see above)
    zero_stage: int = 0  # 0 DDP | 1 optimizer state | 2 + gradients | 3 + parameters (FSDP2)
    bucket_mb: float = 4.0  # DDP / ZeRO-1/2: gradient MiB per collective, started during the last backward
    overlap_param_gather: bool = True  # ZeRO-1/2: the updated parameters travel during the next forward
    sequence_parallel: bool = False
    activation_checkpointing: str = "none"  # none | full | selective
    backend: str = "auto"  # auto | gloo | nccl
    timeout_s: float = 600.0  # a collective waiting longer fails (torch's default: 30 min gloo, 10 min nccl)


@dataclass
class TrainConfig(NamesComponents):
    COMPONENTS: ClassVar[tuple[str, ...]] = ("objective",)

    steps: int = 200
    global_batch_size: int = 16  # sequences per optimizer step, over all data-parallel ranks
    micro_batch_size: int | None = None  # per rank per forward; None: global / dp (no accumulation)
    seq_len: int = 128
    # The pre-training objective and its options (train.objective.options.mask_probability=0.2): auto (the family's)
    # | clm | mlm | span | bart | spanbert | nsp | sop | electra (xscale.data.objectives; docs/variants.md)
    objective: Component = field(default_factory=lambda: Component("auto"))
    task: str = "lm"  # lm (the objective's token loss) | classify (one label per sequence: docs/classification.md)
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    schedule: str = "cosine"  # cosine | linear | constant | wsd (warmup-stable-decay)
    # The length the decay is defined over; None: train.steps. Set it to keep the curve when train.steps is raised.
    schedule_steps: int | None = None
    decay_steps: int | None = None  # wsd: steps of the final decay; None: the last 20% of the schedule
    decay_shape: str = "linear"  # wsd's decay: linear | cosine | sqrt (1 - sqrt(progress))
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # 0 disables
    on_nonfinite: str = "stop"  # a NaN/Inf loss or gradient norm: stop (no checkpoint of it) | skip the update
    max_skipped: int = 3  # on_nonfinite=skip: stop after this many non-finite steps in a row
    spike_factor: float = 3.0  # warn when a loss exceeds this x the median of the last spike_window losses; 0: off
    spike_window: int = 50
    # A model destroyed without a NaN (loss far up, or gradient norm ~0) never rotates out the last checkpoint taken
    # while training was healthy (docs/reliability.md); the stop message names it.
    health_check: bool = True
    health_window: int = 20  # healthy steps whose median loss and gradient norm are the reference
    health_loss_factor: float = 4.0  # a loss above this x the median is unhealthy
    health_grad_collapse: float = 1e-3  # a gradient norm below this x the median is unhealthy; 0: not checked
    watchdog: bool = True  # a step over step_timeout_s ends the job (exit 3) naming the hung rank, with stacks
    step_timeout_s: float = 0.0  # 0: auto, first_step_timeout_s, then 10x the median step after 5 steps, >= 60 s
    # The limit of the first steps under auto (before a median exists), and of each checkpoint save and evaluation
    # (or the step's limit, if longer); 0: those are unwatched
    first_step_timeout_s: float = 600.0
    # fp32 | bf16 (autocast) | fp8 (bf16 autocast, the blocks' linear layers in FP8 through torchao: xscale.models.float8)
    precision: str = "fp32"
    fp8_recipe: str = "tensorwise"  # precision=fp8's scaling: tensorwise | rowwise (torchao's recipes)
    seed: int = 1234
    # steps between evaluations; None: about 10 over the run when the data has an eval split (every
    # max(10, log_every, steps // 10) steps; xscale.train.trainer.evaluation_interval); 0: none
    eval_every: int | None = None
    eval_batches: int = 4
    log_every: int = 10
    output_dir: str = "runs/default"
    kernels: str = "auto"  # auto | triton | apex | torch
    sdpa_backend: str = "auto"  # scaled_dot_product_attention's kernel: auto | flash | efficient | cudnn | math
    # the position-sparse cores (local, bigbird, ...): gather (every device) | flex (FlexAttention on CUDA tensors)
    sparse_attention: str = "gather"
    # AdamW's update: auto (torch's fused kernel, on CPU as on CUDA) | true (foreach) | false (per parameter)
    optimizer_foreach: bool | str = "auto"
    compile: bool = False
    peak_flops: float | None = None  # FLOP/s per device for MFU; None: measured matmul peak
    loggers: list[str] = field(default_factory=lambda: ["tensorboard", "jsonl"])  # + csv | wandb
    tensorboard: bool | None = None  # old switch, still read: false drops tensorboard from loggers, true adds it
    plot: bool = True
    progress: bool = True
    profile_steps: int = 0  # torch.profiler Chrome traces of this many steps (0: off) in <output_dir>/profile/
    profile_start: int = 1  # the first profiled step (1-based)

    @property
    def low_precision(self) -> bool:
        """Whether the forward runs under bf16 autocast (precision bf16, or fp8, whose other ops are bf16)."""
        return self.precision in ("bf16", "fp8")

    def logger_names(self) -> list[str]:
        """``loggers`` with the old ``tensorboard`` switch applied."""
        names = [name for name in self.loggers if not (self.tensorboard is False and name == "tensorboard")]
        if self.tensorboard and "tensorboard" not in names:
            names.insert(0, "tensorboard")
        return names


@dataclass
class DataSource:
    """One corpus of a blend: ``weight`` is its share of the training samples (weights are normalised)."""

    path: str = ""  # a .txt/.jsonl file or folder (text, jsonl), or a .bin/.idx prefix (indexed)
    weight: float = 1.0
    kind: str = "auto"  # auto (from the path) | text | jsonl | indexed
    name: str | None = None  # the name in metrics (data/tokens/<name>); None: the file name


SOURCE_KINDS = ("auto", "text", "jsonl", "indexed")


@dataclass
class DataConfig(NamesComponents):
    COMPONENTS: ClassVar[tuple[str, ...]] = ("dataset",)

    # A registered dataset and its options (data.dataset.options.length=8; xscale inspect --components lists them).
    dataset: Component = field(default_factory=lambda: Component("stdlib_text"))
    path: str | None = None  # text file/folder (text) or .bin/.idx prefix (indexed)
    # A weighted blend of corpora (replaces dataset/path); eval_sources: held-out corpora for evaluation.
    sources: list[DataSource] = field(default_factory=list)
    eval_sources: list[DataSource] = field(default_factory=list)
    text_field: str = "text"  # the field of a .jsonl line that holds the text
    label_field: str = "label"  # train.task=classify: the field of a .jsonl line that holds the label
    # SentencePiece .model, Hugging Face tokenizer.json (or its folder), or a .tiktoken file; None: train a
    # SentencePiece model on the corpus (cached)
    tokenizer: str | None = None
    tokenizer_vocab_size: int = 4000
    num_samples: int = 0  # samples per epoch of a task or a blend (0: the task's default / the sources' windows)
    eval_fraction: float = 0.02
    order: str = "shuffled"  # shuffled | streams (consecutive windows per batch row: model.segment_memory)


@dataclass
class CheckpointConfig:
    dir: str | None = None  # None: <output_dir>/checkpoints
    every: int = 0  # 0: only at the end; -1: none at all (benchmarks, throwaway runs; a preemption still saves)
    keep: int = 3
    async_save: bool = False
    resume: str = "auto"  # auto (latest if any) | none | a checkpoint directory
    # Every N steps each rank keeps its state in /dev/shm and a replica on a peer rank; a restarted worker resumes
    # from it when it is newer than the disk checkpoint (xscale.checkpoint.memory_snapshot). 0: off
    memory_every: int = 0
    verify: str = "full"  # before loading, check every file against meta.json: full (SHA-256) | size | none
    # Start from other weights when no checkpoint is resumed: none | hf:DIR (a Hugging Face model folder; the model
    # section then defaults to its config.json, model.* settings given still apply; xscale.interop.hf)
    init_from: str = "none"


@dataclass
class LaunchConfig:
    nodes: int = 1
    min_nodes: int = 0  # 0: exactly `nodes`; M < nodes: Slurm may start or requeue the job on M..nodes nodes
    gpus_per_node: int = 0  # 0: CPU processes (nproc_per_node)
    nproc_per_node: int = 1
    partition: str | None = None
    account: str | None = None
    time: str = "01:00:00"
    job_name: str = "xscale"
    requeue_signal_seconds: int = 120
    max_restarts: int = 0  # torchrun restarts failed workers this many times; they resume from latest
    max_requeues: int = 0  # Slurm requeues a job that exits non-zero while SLURM_RESTART_COUNT is below this
    extra_sbatch: list[str] = field(default_factory=list)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# The values a field may take (checked by :func:`xscale.config.check.check_values`).
CHOICES = {
    "model.family": ("decoder", "encoder", "encoder_decoder"),
    "model.norm_placement": ("pre", "post", "sandwich", "rezero", "deepnorm"),
    "model.pooling": ("cls", "mean", "max"),
    "model.input": ("tokens", "patches"),
    "train.task": ("lm", "classify"),
    "parallel.pp_schedule": ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"),
    "parallel.activation_checkpointing": ("none", "full", "selective"),
    "parallel.backend": ("auto", "gloo", "nccl"),
    "train.schedule": ("cosine", "linear", "constant", "wsd"),
    "train.decay_shape": ("linear", "cosine", "sqrt"),
    "train.loggers": ("tensorboard", "jsonl", "csv", "wandb"),  # a list: each item one of these
    "train.precision": ("fp32", "bf16", "fp8"),
    "train.fp8_recipe": ("tensorwise", "rowwise"),
    "train.kernels": ("auto", "triton", "apex", "torch"),
    "train.sdpa_backend": ("auto", "flash", "efficient", "cudnn", "math"),
    "train.sparse_attention": ("gather", "flex"),
    "train.optimizer_foreach": ("auto", True, False),
    "train.on_nonfinite": ("stop", "skip"),
    "checkpoint.verify": ("full", "size", "none"),
    "model.moe.drop_policy": ("probs", "position"),
    "model.moe.router_dtype": ("float32", "bfloat16", "float16", "float64"),
    "model.moe.second_expert_policy": ("sampling", "all"),
    "data.order": ("shuffled", "streams"),
    "model.compression": ("conv", "mean"),
    "model.init": ("normal", "admin"),
}


def resolve_objective(config: Config) -> str:
    """The kind of ``train.objective``, ``auto`` read as the family's objective."""
    if config.train.objective.kind != "auto":
        return config.train.objective.kind
    return {"decoder": "clm", "encoder": "mlm", "encoder_decoder": "span"}[config.model.family]
