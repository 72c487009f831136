"""Random-feature attention: Performer FAVOR+ (Choromanski et al. 2021, eq. 7 and Lemma 1, positive orthogonal
features for exp(q.k)) and RFA (Peng et al. 2021, eq. 3-4, random Fourier features on unit-norm q, k).

Features live in a buffer drawn from a generator seeded by (seed, layer, draw count), so every rank holds the
same draw; in training they are redrawn every ``redraw_every`` optimizer steps (0: never), at the start of the
step, whatever the step's microbatches, data-parallel replicas or recomputed forwards
(:mod:`xscale.train.training_step`): a layout redraws at the step one process does.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import Tensor

from xscale.config.schema import ModelConfig
from xscale.models.attention.block_sparse import LOG2_E
from xscale.models.attention.core import (
    AttentionCore,
    causal_over_longer_keys,
    expand_kv,
    held_query_positions,
)
from xscale.models.attention.linear import kernel_attention, kernel_attention_at
from xscale.models.attention.sparse import layer_seed, require, require_non_negative, require_positive
from xscale.models.registry import ATTENTION
from xscale.models.traits import ParallelTraits
from xscale.runtime import StepContext


def gaussian_projection(n_features: int, dim: int, generator: torch.Generator, orthogonal: bool) -> Tensor:
    """(n_features, dim) rows ~ N(0, I); ``orthogonal``: rows orthogonal within each block of ``dim``, with
    chi-distributed lengths so that each row is still marginally Gaussian (Performer, sec. 2.4)."""
    if not orthogonal:
        return torch.randn(n_features, dim, generator=generator, dtype=torch.float64)
    blocks = []
    for _ in range(math.ceil(n_features / dim)):
        basis, _ = torch.linalg.qr(torch.randn(dim, dim, generator=generator, dtype=torch.float64))
        blocks.append(basis.T)
    lengths = torch.randn(n_features, dim, generator=generator, dtype=torch.float64).norm(dim=1)
    return torch.cat(blocks)[:n_features] * lengths[:, None]


class RandomFeatureAttention(AttentionCore):
    """Holds the projection buffer and its redraw schedule; subclasses define ``features``. Causal with a segment
    memory: the remembered keys are a prefix of the running sums, as in :class:`LinearAttention`."""

    parallel_traits = ParallelTraits(tp="split_heads", cp_positions=True)
    attends_to_memory = True

    @classmethod
    def applies_attention_dropout(cls, causal: bool) -> bool:
        return False  # a kernel feature map forms no attention probabilities

    def __init__(self, model: ModelConfig, layer_index: int, options) -> None:
        super().__init__(model, layer_index, options)
        self.register_buffer("projection", torch.empty(self.n_projections(), model.head_dim))
        # Training steps begun (the name predates the per-step schedule; kept so that checkpoints load).
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        if self.projection.device.type != "meta":
            self.reset_buffers()

    def n_projections(self) -> int:
        return self.options.features

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """The first draw and a zeroed step counter (called after the meta-device build is materialised)."""
        self.calls.zero_()
        self.draw(0)

    @torch.no_grad()
    def draw(self, draw: int) -> None:
        generator = torch.Generator().manual_seed(layer_seed(self.options.seed, self.layer_index) + 7919 * draw)
        projection = gaussian_projection(self.n_projections(), self.projection.shape[1], generator,
                                         self.options.orthogonal)
        self.projection.copy_(projection.to(self.projection.dtype))

    def begin_training_step(self, forwards: int) -> None:
        """Steps 0..N-1 use draw 0, steps N..2N-1 draw 1, ... (N = ``redraw_every``; Performer sec. 4.2)."""
        every = self.options.redraw_every
        if every > 0:
            steps = int(self.calls)
            if steps > 0 and steps % every == 0:
                self.draw(steps // every)
            self.calls += 1

    def features(self, x: Tensor, is_query: bool, causal: bool, single_use: bool = False) -> Tensor:
        """phi(x) (..., m) of queries or keys; ``single_use``: see :data:`xscale.models.attention.linear.FeatureMap`."""
        raise NotImplementedError

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, bias: Tensor | None = None, context: StepContext | None = None) -> Tensor:
        k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
        dtype = torch.promote_types(q.dtype, torch.float32)

        def feature_q(x: Tensor, single_use: bool = False) -> Tensor:
            return self.features(x, True, causal, single_use)

        def feature_k(x: Tensor, single_use: bool = False) -> Tensor:
            return self.features(x, False, causal, single_use)

        def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            return kernel_attention(q, k, v, feature_q, feature_k, causal=causal, chunk=self.options.chunk)

        q32, k32, v32 = q.to(dtype), k.to(dtype), v.to(dtype)
        if (positions := held_query_positions(q, k, context)) is not None:  # context parallelism
            out = kernel_attention_at(positions, q32, k32, v32, feature_q, feature_k, causal=causal,
                                      chunk=self.options.chunk)
        else:
            out = causal_over_longer_keys(attend, q32, k32, v32) if causal else attend(q32, k32, v32)
        return out.to(q.dtype)


@dataclasses.dataclass
class PerformerOptions:
    features: int = 64
    orthogonal: bool = True
    redraw_every: int = 0  # redraw the features every N optimizer steps (0: never)
    seed: int = 0
    chunk: int = 64

    def __post_init__(self) -> None:
        require_positive("performer", features=self.features, chunk=self.chunk)
        require_non_negative("performer", redraw_every=self.redraw_every)


@ATTENTION.register("performer", "favor")
class PerformerAttention(RandomFeatureAttention):
    """phi(x) = exp(w_i . x - |x|^2 / 2) / sqrt(m), x = q or k scaled by d^-1/4: E[phi(q).phi(k)] = exp(q.k/sqrt(d))
    (``features`` drops the factors that cancel in the normalised output)."""

    Options = PerformerOptions

    def features(self, x: Tensor, is_query: bool, causal: bool, single_use: bool = False) -> Tensor:
        # x scaled by d^-1/4 and exp(a) = exp2(a log2 e), both folded into the projection: on CPU torch.exp takes
        # a ~10-90x slower path for inputs below about -88, exp2 does not.
        scale = x.shape[-1] ** -0.25
        projection = self.projection.to(x.dtype) * (scale * LOG2_E)
        # Factors shared by a query's features (exp(-|q|^2 / 2), a max shift) cancel in that query's ratio, and
        # factors shared by all keys (1 / sqrt(m), a global shift) cancel in every ratio: they are left out. A
        # decoder's key shift taken over all keys would read the future, so causal keys go unshifted.
        if is_query:
            return PositiveFeatures.apply(x, projection, 0.0, "row", single_use)
        return PositiveFeatures.apply(x, projection, -0.5 * scale**2 * LOG2_E, "none" if causal else "all", single_use)


class PositiveFeatures(torch.autograd.Function):
    """phi(x) = exp2(x W^T + c |x|^2 - shift), the shift (a row's or the whole tensor's max, or none) a constant:
    FAVOR+'s positive features (Performer, Lemma 1) in base 2. The backward is one pass over the features,
    dx = (dphi * phi) (ln 2 W) + 2 c ln 2 x rowsum(dphi * phi), against autograd's several."""

    @staticmethod
    def forward(ctx, x: Tensor, projection: Tensor, norm_weight: float, shift: str, single_use: bool) -> Tensor:
        # One GEMM over every head's tokens: x's batch dimensions folded into its rows.
        logits = torch.mm(x.reshape(-1, x.shape[-1]), projection.T).view(*x.shape[:-1], projection.shape[0])
        if norm_weight:
            logits.add_((x * x).sum(-1, keepdim=True), alpha=norm_weight)
        if shift == "row":
            logits.sub_(logits.amax(-1, keepdim=True))
        elif shift == "all":
            logits.sub_(logits.amax(dim=(-1, -2), keepdim=True))
        phi = logits.exp2_()
        ctx.save_for_backward(x, phi, projection)
        ctx.norm_weight, ctx.overwrite = norm_weight, single_use  # single_use: the backward may overwrite phi
        return phi

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, phi, projection = ctx.saved_tensors
        grad_logits = phi.mul_(grad) if ctx.overwrite else grad * phi
        # under autocast phi comes from a bf16 GEMM while x (and the projection) may be fp32: dx in x's dtype
        grad_logits = grad_logits.to(projection.dtype)
        grad_x = grad_logits @ (projection * math.log(2.0))
        if ctx.norm_weight:
            grad_x.add_(x * grad_logits.sum(-1, keepdim=True), alpha=2 * ctx.norm_weight * math.log(2.0))
        return grad_x, None, None, None, None


@dataclasses.dataclass
class RFAOptions:
    features: int = 64
    sigma: float = 1.0
    orthogonal: bool = False
    redraw_every: int = 0  # redraw the features every N optimizer steps (0: never)
    seed: int = 0
    chunk: int = 64

    def __post_init__(self) -> None:
        require_positive("rfa", features=self.features, chunk=self.chunk)
        require_non_negative("rfa", redraw_every=self.redraw_every)
        require(self.sigma > 0, f"model.attention.options.sigma must be > 0 for 'rfa' (got {self.sigma})")


@ATTENTION.register("rfa")
class RFAAttention(RandomFeatureAttention):
    """phi(x) = [sin(W x^), cos(W x^)] / sqrt(m), W ~ N(0, I/sigma^2), x^ = x/|x|: approximates
    softmax(q^.k^ / sigma^2). (RFA's optional recency gate is not implemented.)"""

    Options = RFAOptions

    def features(self, x: Tensor, is_query: bool, causal: bool, single_use: bool = False) -> Tensor:
        x = F.normalize(x, dim=-1)
        angles = x @ (self.projection.to(x.dtype).T / self.options.sigma)
        return torch.cat([torch.sin(angles), torch.cos(angles)], dim=-1) / math.sqrt(angles.shape[-1])
