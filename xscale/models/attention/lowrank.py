"""Low-rank attention: Linformer (Wang et al. 2020, eq. 7: softmax(Q (EK)^T / sqrt(d)) FV) and Nystromformer
(Xiong et al. 2021, eq. 14: softmax(Q K~^T) pinv(softmax(Q~ K~^T)) softmax(Q~ K^T) V, landmarks = segment means).

Both mix information across the whole sequence, so neither can be causally masked: they are encoder-only.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor, nn

from xscale.config.schema import ModelConfig
from xscale.models.attention.core import AttentionCore, expand_kv
from xscale.models.attention.sparse import require, require_positive
from xscale.models.registry import ATTENTION
from xscale.models.traits import ParallelTraits
from xscale.runtime import StepContext


@dataclasses.dataclass
class LinformerOptions:
    projected_length: int = 16
    share_projections: bool = False

    def __post_init__(self) -> None:
        require_positive("linformer", projected_length=self.projected_length)


@ATTENTION.register("linformer")
class LinformerAttention(AttentionCore):
    """Keys and values projected along the length by learned E, F (k x max_seq_len), shared by the heads. Each query
    reads only the projected keys and values, so a context-parallel rank's queries against the all-gathered K/V
    (E and F over the whole length, in the sequence's order) give their rows of the whole sequence's output."""

    Options = LinformerOptions
    causal_capable = False
    parallel_traits = ParallelTraits(tp="split_heads", cp_positions=True)

    def __init__(self, model: ModelConfig, layer_index: int, options: LinformerOptions) -> None:
        super().__init__(model, layer_index, options)
        shape = (options.projected_length, model.max_seq_len)
        self.key_projection = nn.Parameter(torch.randn(shape) / options.projected_length**0.5)
        if not options.share_projections:
            self.value_projection = nn.Parameter(torch.randn(shape) / options.projected_length**0.5)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, bias: Tensor | None = None, context: StepContext | None = None) -> Tensor:
        length = k.shape[2]
        require(not causal, "linformer cannot be causally masked (E, F mix the whole sequence); use an encoder")
        if length > self.key_projection.shape[1]:
            raise ValueError(f"linformer was built for at most model.max_seq_len={self.key_projection.shape[1]} "
                             f"tokens and got {length}; raise model.max_seq_len")
        key_projection = self.key_projection[:, :length]
        value_projection = key_projection if self.options.share_projections else self.value_projection[:, :length]
        k = key_projection.to(k.dtype) @ expand_kv(k, q.shape[1])  # (B, H, k, hd)
        v = value_projection.to(v.dtype) @ expand_kv(v, q.shape[1])
        return self.attend(q, k, v, context=context)  # dropout on the probabilities over the projected slots (B, H, T, k)


def segment_means(x: Tensor, n_segments: int) -> Tensor:
    """(B, H, T, d) -> (B, H, n_segments, d): means of n_segments contiguous, near-equal segments."""
    length = x.shape[2]
    segment = torch.arange(length, device=x.device) * n_segments // length
    sums = x.new_zeros(*x.shape[:2], n_segments, x.shape[-1]).index_add(2, segment, x)
    counts = torch.bincount(segment, minlength=n_segments).to(x.dtype)
    return sums / counts[:, None]


def iterative_pinv(matrix: Tensor, iterations: int) -> Tensor:
    """Moore-Penrose pseudo-inverse by the iteration of Razavi et al. 2014 (Nystromformer eq. 16)."""
    identity = torch.eye(matrix.shape[-1], dtype=matrix.dtype, device=matrix.device)
    # Z0 = A^T / (max row sum * max column sum) makes ||I - A Z0|| < 1 for a row-stochastic A.
    z = matrix.transpose(-1, -2) / (matrix.abs().sum(-1).amax(-1) * matrix.abs().sum(-2).amax(-1))[..., None, None]
    for _ in range(iterations):
        az = matrix @ z
        z = 0.25 * z @ (13 * identity - az @ (15 * identity - az @ (7 * identity - az)))
    return z


@dataclasses.dataclass
class NystromOptions:
    landmarks: int = 8
    pinv_iterations: int = 6

    def __post_init__(self) -> None:
        require_positive("nystrom", landmarks=self.landmarks, pinv_iterations=self.pinv_iterations)


@ATTENTION.register("nystrom", "nystromformer")
class NystromAttention(AttentionCore):
    """m landmarks from segment means of Q and K; exact when every token is its own landmark (m = T)."""

    Options = NystromOptions
    causal_capable = False
    parallel_traits = ParallelTraits(tp="split_heads", cp_whole_sequence=True)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, bias: Tensor | None = None, context: StepContext | None = None) -> Tensor:
        require(not causal, "nystrom cannot be causally masked (landmarks average the future); use an encoder")
        k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
        scale = q.shape[-1] ** -0.5
        n_landmarks = min(self.options.landmarks, q.shape[2], k.shape[2])
        q_landmarks, k_landmarks = segment_means(q, n_landmarks), segment_means(k, n_landmarks)
        kernel_1 = torch.softmax(q @ k_landmarks.transpose(-1, -2) * scale, dim=-1)  # (B, H, T, m)
        kernel_2 = torch.softmax(q_landmarks @ k_landmarks.transpose(-1, -2) * scale, dim=-1)  # (B, H, m, m)
        kernel_3 = torch.softmax(q_landmarks @ k.transpose(-1, -2) * scale, dim=-1)  # (B, H, m, T)
        return kernel_1 @ (iterative_pinv(kernel_2, self.options.pinv_iterations) @ (kernel_3 @ v))
