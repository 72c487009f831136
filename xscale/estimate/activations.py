"""Stored activations of one block for one microbatch on one device (before any layout divides them).

Korthikanti et al. 2022, eq. 1, its MLP term written for any FFN width f: s b (18 h + c f g) bytes at 16 bits, where
c = 4 (pre-activation and activation) or 8 for a GLU FFN (gate, up, activation, product) and g = k x capacity
factor for a MoE layer's routed tokens (1 else), plus 5 a s keys b for the attention scores, their softmax and
dropout mask unless the core is dense (SDPA's fused kernels keep O(s) per head, Dao et al. 2022) or recomputed
(selective); a cross-attention adds 13 s b h; a block kind adds what its residuals store beyond the standard
block's (:func:`extra_block_activations`: GTrXL's gates, 12 s b h each). fp32 doubles it. Full recomputation keeps
each block's input, 2 s b h.
The same bytes are what a block's memory-bound ops (norms, activations, residual adds, dropout) move, the step
model's elementwise term (:mod:`~xscale.estimate.step_time`).
"""

from __future__ import annotations

from xscale.config.schema import ModelConfig
from xscale.estimate.model_shape import GLU_FFNS, BlockShape, ModelShape
from xscale.models.registry import BLOCK

FUSED_ATTENTION_KINDS = ("dense",)


def extra_block_activations(model: ModelConfig, cross: bool = False) -> int:
    """Bytes per token and model feature at 16 bits that the block kind's residuals store beyond the standard
    block's (``extra_activations_per_residual`` of :class:`~xscale.models.block.TransformerBlock`), ``cross``: with
    a cross-attention residual."""
    kind = BLOCK.get(model.block.kind)
    per_residual = getattr(kind, "extra_activations_per_residual", 0)
    return per_residual * len(kind.residual_names(cross)) if per_residual else 0


def block_activation_bytes(shape: ModelShape, block: BlockShape, micro_batch: int, checkpointing: str) -> float:
    """One block's stored activations for one microbatch on one device (module docstring)."""
    model = shape.model
    s, b, h = shape.seq_len, micro_batch, model.d_model
    scale = 1.0 if shape.config.train.low_precision else 2.0
    if checkpointing == "full":
        return 2.0 * s * b * h * scale
    routed = shape.expert_share * model.moe.num_experts if block.moe else 1.0
    per_width = 8 if model.ffn.kind in GLU_FFNS else 4
    stored = (s * b * (18 * h + per_width * model.ffn_hidden * routed) + (13 * s * b * h if block.cross_keys else 0)
              + extra_block_activations(model, bool(block.cross_keys)) * s * b * h)
    if model.attention.kind not in FUSED_ATTENTION_KINDS and checkpointing == "none":
        stored += 5 * model.n_heads * s * block.keys * b
    return stored * scale
