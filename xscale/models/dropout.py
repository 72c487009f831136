"""Dropout (Srivastava et al. 2014) whose mask depends on where an element sits, not on which rank computes it.

keep(element) = splitmix64(key(seed, site, step, sample) + index * golden) >= p * 2^64 (Steele et al. 2014,
a counter-based draw like Philox: Salmon et al. 2011), in vectorised int64 tensor ops. ``sample`` is the
element's row in the step's global batch and ``index`` its position inside the sample, both in global
coordinates; ``site`` hashes the module's name (and, for a block shared across depths, the depth it runs at). So one device, tensor-parallel ranks holding replicas,
sequence-parallel ranks holding a slice of the tokens and data-parallel ranks holding a slice of the batch all
drop the same elements, and a resumed run drops what the uninterrupted one would.

The model stays plain PyTorch: each call takes the forward's :class:`~xscale.runtime.StepContext` (the trainer's step builds
one per microbatch); without one the per-sample keys come from torch's RNG and the module behaves like ``nn.Dropout``.
Each module declares the dim of its tensors that holds the (query) tokens (``token_dim``: 1 for (B, T, D)
activations, 2 for (B, H, Tq, Tk) attention probabilities, whose dim 1 holds heads). The context says which slice a
rank holds: under tensor parallelism slice ``tensor_rank`` of the heads (probabilities) and, with sequence
parallelism, of the tokens (activations); under context parallelism the global positions of its tokens
(``StepContext.sequence``). Everything else is global already.
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch import nn

from xscale.runtime import StepContext
from xscale.runtime.eager import eager_under_compile
from xscale.runtime.hooks import DrawsNoise

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15  # 2^64 / golden ratio: splitmix64's stream increment
MIX1, MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _signed(value: int) -> int:
    """The int64 with the same 64 bits as ``value`` (torch integers are signed)."""
    value &= MASK64
    return value - (1 << 64) if value >> 63 else value


def mix64(value: int) -> int:
    """splitmix64's finaliser on a Python int (unsigned 64-bit arithmetic)."""
    value = ((value ^ (value >> 30)) * MIX1) & MASK64
    value = ((value ^ (value >> 27)) * MIX2) & MASK64
    return value ^ (value >> 31)


def _mix_(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser in place on int64, two passes leaner: torch shifts int64 arithmetically (each
    xor-shift then clears bit 63: a 62-bit hash, which a keep/drop decision does not notice) instead of masking,
    and the last xor-shift is left out: only the high bits are read, and those of a product depend on every bit."""
    z ^= z >> 30
    z *= _signed(MIX1)
    z ^= z >> 27
    z *= _signed(MIX2)
    return z


class _ScaleKept(torch.autograd.Function):
    """x * keep / (1 - p) forward and backward in one pass each, saving only the bool mask."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, keep: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(keep)
        ctx.scale = scale
        return torch.ops.aten.native_dropout_backward(x, keep, scale)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (keep,) = ctx.saved_tensors
        return torch.ops.aten.native_dropout_backward(grad, keep, ctx.scale), None, None


def site_id(name: str) -> int:
    """A stable 64-bit id for a module name (Python's ``hash`` of a str changes between processes)."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")


class Dropout(nn.Module):
    """``nn.Dropout`` with layout-independent masks: drop x[b, i1, i2, ...] by its global coordinates."""

    def __init__(self, p: float = 0.5, token_dim: int = 1) -> None:
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability must be in [0, 1), got {p}")
        self.p = p
        self.token_dim = token_dim  # the dim of the tensors it drops that holds the (query) tokens
        self.site = 0  # set from the module's name by name_dropout_sites

    def extra_repr(self) -> str:
        return f"p={self.p}"

    def forward(self, x: torch.Tensor, context: StepContext | None = None) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        return _ScaleKept.apply(x, self.keep_mask(x.shape, x.device, context), 1.0 / (1.0 - self.p))

    def at(self, x: torch.Tensor, index: torch.Tensor, context: StepContext | None = None) -> torch.Tensor:
        """Dropout of ``x`` (batch first) whose elements sit at the flat positions ``index`` (broadcastable to
        ``x.shape[1:]``) of each sample's whole, unsharded tensor: for gathered layouts (block-sparse attention)."""
        if not self.training or self.p == 0.0:
            return x
        return _ScaleKept.apply(x, self.keep_at(x.shape[0], index, context).expand(x.shape), 1.0 / (1.0 - self.p))

    def at_each(self, x: torch.Tensor, index: torch.Tensor, context: StepContext | None = None) -> torch.Tensor:
        """As :meth:`at`, with ``index`` of ``x``'s shape: each sample's own flat positions, for layouts that
        depend on the sample's content (routing attention's clusters)."""
        if not self.training or self.p == 0.0:
            return x
        return _ScaleKept.apply(x, self.keep_at(x.shape[0], index, context, per_sample=True), 1.0 / (1.0 - self.p))

    def keep_at(self, batch: int, index: torch.Tensor, context: StepContext | None = None,
                per_sample: bool = False) -> torch.Tensor:
        """Bool (batch, *index.shape): the keep mask at flat positions ``index`` (int64, inside a sample, global
        coordinates); :meth:`keep_mask` of a tensor equals this at its elements' row-major flat positions.
        ``per_sample``: ``index`` has a leading batch dim (each sample's own positions), giving (batch, ...)."""
        keys = _sample_keys(self.site, batch, index.device, context)
        z = keys.view(-1, *[1] * (index.dim() - 1 if per_sample else index.dim()))
        return _mix_(z + index.to(torch.int64) * _signed(GOLDEN)) >= round(self.p * 2**64) - 2**63

    def keep_mask(self, shape: torch.Size, device: torch.device, context: StepContext | None = None) -> torch.Tensor:
        """Bool tensor of ``shape`` (batch first), True where an element is kept."""
        return _element_hashes(self.site, shape, device, context, self.shard_index(context), self.token_dim) >= \
            round(self.p * 2**64) - 2**63

    def shard_index(self, context: StepContext | None) -> int:
        """Which of equal slices of dim 1 this rank holds: its heads of attention probabilities under tensor
        parallelism, its tokens of the residual stream under sequence parallelism."""
        if context is None or context.tensor_size == 1:
            return 0
        if self.token_dim == 2:
            return context.tensor_rank
        return context.tensor_rank if context.sequence_parallel else 0


@eager_under_compile  # eager: compiled, it would recompile every step (and inductor folds without wrapping)
def _sample_keys(site: int, batch: int, device: torch.device, context: StepContext | None) -> torch.Tensor:
    """One key per sample of the batch in flight: of (seed, site, step, global row) under a positioned context."""
    if context is None or not context.positioned:  # plain PyTorch use: keys from torch's generator, like nn.Dropout
        return torch.randint(-2**63, 2**63 - 1, (batch,), dtype=torch.int64, device=device)
    if context.depth is not None:  # a shared block's site at one of its depths
        site = mix64(site + (context.depth + 1) * GOLDEN)
    base = mix64(mix64(mix64(context.seed) ^ site) + context.step * GOLDEN)
    rows = torch.arange(context.first_sample + 1, context.first_sample + batch + 1, device=device)
    return _mix_(rows * _signed(GOLDEN) + _signed(base))


def _element_hashes(site: int, shape: torch.Size, device: torch.device, context: StepContext | None,
                    shard_index: int = 0, token_dim: int = 1) -> torch.Tensor:
    """int64 hash of every element of a batch-first tensor of ``shape`` from its global coordinates (dim 1 being
    slice ``shard_index`` of equal slices; dim ``token_dim`` holding the context's sequence positions, if any)."""
    z = _sample_keys(site, shape[0], device, context).view(-1, *[1] * (len(shape) - 1))
    full = list(shape)  # the global shape, whose row-major strides the flat index uses
    sliced = context is not None and context.sequence is not None and token_dim < len(shape)
    # sequence parallelism inside a context-parallel slice: dim 1 holds slice shard_index of the slice's tokens
    split = context.tensor_size if sliced and token_dim == 1 and context.sequence_parallel else 1
    if sliced:
        full[token_dim] = context.sequence_length(shape[token_dim] * split)
    # index * golden = sum over dims of coordinate * stride * golden (mod 2^64): one broadcast add per dim,
    # outermost first, so that only the last add is full-sized.
    for dim in range(1, len(shape)):
        stride = math.prod(full[dim + 1:])
        if sliced and dim == token_dim:
            coordinates = context.positions(shape[dim] * split, device)
            coordinates = coordinates[shard_index * shape[dim]:(shard_index + 1) * shape[dim]] if split > 1 else coordinates
        else:
            first = shard_index * shape[dim] if dim == 1 else 0
            coordinates = torch.arange(first, first + shape[dim], device=device, dtype=torch.int64)
        z = z + (coordinates * _signed(stride * GOLDEN)).view(-1, *[1] * (len(shape) - 1 - dim))
    return _mix_(z)


def uniform_draws(site: int, shape: torch.Size, device: torch.device, context: StepContext | None) -> torch.Tensor:
    """float32 uniform on [0, 1) (24 bits) for every element of a batch-first tensor of ``shape``, drawn as the
    dropout masks are: from the element's global coordinates under a positioned context, so every layout
    draws the same noise for the same token (MoE router jitter, GShard's sampled second expert); from torch's
    generator without one."""
    if context is None or not context.positioned:
        return torch.rand(shape, device=device)
    return ((_element_hashes(site, shape, device, context) >> 40) & ((1 << 24) - 1)).float() * 2.0**-24


def name_dropout_sites(model: nn.Module) -> None:
    """Give each module of ``model`` that draws by position (a :class:`Dropout`, an MoE router: those with a
    ``site`` attribute) the id of its name, the same in every layout."""
    for name, module in model.named_modules():
        if isinstance(module, Dropout | DrawsNoise):
            module.site = site_id(name)
