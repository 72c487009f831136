"""Distance priors on dense attention logits, one learned quantity per head.

gaussian: logits + -(j - i)^2 / (2 sigma_h^2), sigma_h = sigma * exp(s_h) with s_h learned (a localness prior,
  Guo et al. 2019; Yang et al. 2018 predict the centre and width per query instead, which is not done here).
adaptive_span (Sukhbaatar et al. 2019): a_ij = m_z(i - j) exp(s_ij) / sum_r m_z(i - r) exp(s_ir), with
  the soft mask m_z(x) = clamp((R + z - x) / R, 0, 1), z_h = max_span * f_h learned per head, ramp R; the L1
  penalty span_loss * sum_h z_h reaches the gradients as an auxiliary loss (:meth:`span_penalty`), once per
  training step however many forwards the step runs.
Both cost T^2 (dense logits); adaptive_span does not yet crop the keys beyond the largest span.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor, nn

from xscale.config.schema import ModelConfig
from xscale.models.attention.core import AttentionCore, check_heads, expand_kv
from xscale.models.attention.dense import causal_bias
from xscale.models.attention.sparse import require, require_positive
from xscale.models.moe.layer import attach_auxiliary_loss
from xscale.models.registry import ATTENTION
from xscale.models.traits import ParallelTraits
from xscale.runtime import StepContext


def signed_distance(q_len: int, k_len: int, device: torch.device) -> Tensor:
    """i - j for query i and key j, queries aligned to the end of the keys (as the causal mask aligns them)."""
    offset = k_len - q_len
    return (torch.arange(q_len, device=device)[:, None] + offset) - torch.arange(k_len, device=device)[None, :]


def attend_with_logit_bias(core: AttentionCore, q: Tensor, k: Tensor, v: Tensor, logit_bias: Tensor, *,
                           causal: bool, context: StepContext | None = None) -> Tensor:
    """softmax(QK^T / sqrt(d) + logit_bias (+ causal mask)) V through ``core.attend`` (SDPA unless dropping
    probabilities); logit_bias broadcasts to (B, H, Tq, Tk)."""
    k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
    mask = logit_bias.to(q.dtype)
    if causal:
        mask = mask + causal_bias(q.shape[2], k.shape[2], q.device, q.dtype)
    return core.attend(q, k, v, mask, context)


@dataclasses.dataclass
class GaussianOptions:
    sigma: float = 8.0  # initial standard deviation of the prior, in tokens

    def __post_init__(self) -> None:
        require(self.sigma > 0, f"model.attention.options.sigma must be > 0 for 'gaussian' (got {self.sigma})")


@ATTENTION.register("gaussian", "gaussian_prior")
class GaussianPriorAttention(AttentionCore):
    """Dense attention plus -(j - i)^2 / (2 sigma_h^2); the log-offset s_h starts near 0 (sigma_h ~ sigma)."""

    Options = GaussianOptions
    supports_bias = True
    takes_padding_mask = True  # the padding mask enters as a -inf logit bias on the padded keys
    per_head_state = ("log_sigma_offset",)
    parallel_traits = ParallelTraits(tp="head_state", cp_whole_sequence=True)

    def __init__(self, model: ModelConfig, layer_index: int, options: GaussianOptions) -> None:
        super().__init__(model, layer_index, options)
        self.log_sigma_offset = nn.Parameter(torch.zeros(model.n_heads))

    def sigma(self) -> Tensor:
        return self.options.sigma * torch.exp(self.log_sigma_offset)

    def prior(self, q_len: int, k_len: int) -> Tensor:
        """(H, q_len, k_len) log-prior."""
        distance = signed_distance(q_len, k_len, self.log_sigma_offset.device).to(self.log_sigma_offset.dtype)
        return -(distance**2)[None] / (2 * self.sigma()[:, None, None] ** 2)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, bias: Tensor | None = None, context: StepContext | None = None) -> Tensor:
        check_heads(self, self.log_sigma_offset, q.shape[1])
        logit_bias = self.prior(q.shape[2], k.shape[2])
        if bias is not None:
            logit_bias = logit_bias + bias
        return attend_with_logit_bias(self, q, k, v, logit_bias, causal=causal, context=context)


@dataclasses.dataclass
class AdaptiveSpanOptions:
    max_span: int = 1024  # S: z_h = S * f_h, clamped to [-ramp / 2, S]
    ramp: int = 32  # R: width of the soft edge of the mask
    span_loss: float = 2e-6  # lambda of the L1 penalty on the spans (the paper's value for character LMs)

    def __post_init__(self) -> None:
        require_positive("adaptive_span", max_span=self.max_span, ramp=self.ramp)
        require(self.span_loss >= 0,
                f"model.attention.options.span_loss must be >= 0 for 'adaptive_span' (got {self.span_loss})")


@ATTENTION.register("adaptive_span")
class AdaptiveSpanAttention(AttentionCore):
    """Per-head soft span mask; the span fraction f_h starts near 0 (the paper's initialisation), so every head
    begins as a window of ``ramp`` tokens and grows where the loss pays for it.

    ``aux_loss_scale`` (1.0) scales the penalty each forward attaches; the trainer's step sets it to 1 / forwards per step
    (:meth:`begin_training_step`), so that a step's gradient holds the penalty once, as the paper's loss does,
    whatever its microbatches and data-parallel replicas.
    Encoders use |i - j|; the paper's causal models use i - j >= 0.
    """

    Options = AdaptiveSpanOptions
    supports_bias = True
    takes_padding_mask = True  # the padding mask enters as a -inf logit bias on the padded keys
    per_head_state = ("span_fraction",)
    parallel_traits = ParallelTraits(tp="head_state", cp_whole_sequence=True)

    def __init__(self, model: ModelConfig, layer_index: int, options: AdaptiveSpanOptions) -> None:
        super().__init__(model, layer_index, options)
        self.span_fraction = nn.Parameter(torch.zeros(model.n_heads))
        self.aux_loss_scale = 1.0

    def span(self) -> Tensor:
        """z_h in tokens; kept above -ramp / 2 so that every query keeps weight on itself."""
        o = self.options
        return (o.max_span * self.span_fraction).clamp(-o.ramp / 2, o.max_span)

    def begin_training_step(self, forwards: int) -> None:
        """The step's penalty is shared out over its ``forwards`` (microbatches x data-parallel replicas)."""
        self.aux_loss_scale = 1.0 / forwards

    def span_penalty(self) -> Tensor:
        """The auxiliary loss span_loss * sum_h max(z_h, 0) (Sukhbaatar et al. 2019)."""
        return self.options.span_loss * self.span().clamp_min(0).sum()

    def soft_mask(self, q_len: int, k_len: int, causal: bool) -> Tensor:
        """(H, q_len, k_len) m_z(distance) in [0, 1]."""
        distance = signed_distance(q_len, k_len, self.span_fraction.device).to(self.span_fraction.dtype)
        if not causal:
            distance = distance.abs()
        ramp = self.options.ramp
        return ((ramp + self.span()[:, None, None] - distance[None]) / ramp).clamp(0, 1)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, bias: Tensor | None = None, context: StepContext | None = None) -> Tensor:
        check_heads(self, self.span_fraction, q.shape[1])
        mask = self.soft_mask(q.shape[2], k.shape[2], causal)
        # m * exp(s) / sum(m * exp(s)) == softmax(s + log m): the mask enters as a logit bias.
        log_mask = torch.where(mask > 0, mask.clamp_min(torch.finfo(mask.dtype).tiny).log(), float("-inf"))
        logit_bias = log_mask if bias is None else log_mask + bias
        out = attend_with_logit_bias(self, q, k, v, logit_bias, causal=causal, context=context)
        if self.options.span_loss > 0 and torch.is_grad_enabled() and self.span_fraction.requires_grad:
            out = attach_auxiliary_loss(out, self.aux_loss_scale * self.span_penalty())
        return out


def adaptive_span_metrics(model: nn.Module) -> dict[str, float]:
    """``attention/layer{i}/span_mean`` and ``.../span_max`` (tokens) of every adaptive-span core, for the logs."""
    metrics: dict[str, float] = {}
    for module in model.modules():
        if isinstance(module, AdaptiveSpanAttention):
            with torch.no_grad():
                span = module.span().clamp_min(0)
            metrics[f"attention/layer{module.layer_index}/span_mean"] = float(span.mean())
            metrics[f"attention/layer{module.layer_index}/span_max"] = float(span.max())
    return metrics

