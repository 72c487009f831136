"""GTrXL blocks (Parisotto et al. 2019, "Stabilizing Transformers for Reinforcement Learning", sec. 3 and eq. 1-8):
each residual add is replaced by a GRU-type gate g(x, y) of the stream x and the sub-layer's output y, with the
identity-map reordering (the sub-layer reads norm(x), and a ReLU follows it):

  y = ReLU(f(norm(x)))
  r = sigmoid(W_r y + U_r x)
  z = sigmoid(W_z y + U_z x - b_g)
  h = tanh(W_g y + U_g (r * x))
  g(x, y) = (1 - z) * x + z * h

b_g starts at :data:`GATE_BIAS` (2, the paper's choice) so that z is small and each block starts near the identity.
Transformer-XL's memory (``model.segment_memory``, the paper's setting) works as in the standard block.

Under tensor parallelism the gates are replicated like norms (``tp="per_token"``), not split: g reads all d features
of x and of y for every feature it writes (U_g (r * x) mixes every feature of r), so a feature split would need r and
g all-gathered over tp at every gate, beside the sub-layer's own reduction; replicated, a gate costs no communication
(under sequence parallelism each rank gates its own tokens and the weights' gradients are summed).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from xscale.config.schema import ConfigError, ModelConfig
from xscale.models.block import Residual, TransformerBlock
from xscale.models.blocks.kind import OWN_ORDER, BlockTraits
from xscale.models.registry import BLOCK
from xscale.models.traits import BlockParts, ParallelTraits, Refusal
from xscale.runtime import StepContext

GATE_BIAS = 2.0  # b_g's initial value (Parisotto et al. 2019, sec. 3: "b_g = 2")


class GRUGate(nn.Module):
    """g(x, y) of the module docstring; ``gate_bias`` is b_g (initialised by :mod:`xscale.models.init`)."""

    parallel_traits = ParallelTraits(tp="per_token")

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.w_r, self.u_r = nn.Linear(d_model, d_model, bias=False), nn.Linear(d_model, d_model, bias=False)
        self.w_z, self.u_z = nn.Linear(d_model, d_model, bias=False), nn.Linear(d_model, d_model, bias=False)
        self.w_g, self.u_g = nn.Linear(d_model, d_model, bias=False), nn.Linear(d_model, d_model, bias=False)
        self.gate_bias = nn.Parameter(torch.full((d_model,), GATE_BIAS))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        reset = torch.sigmoid(self.w_r(y) + self.u_r(x))
        update = torch.sigmoid(self.w_z(y) + self.u_z(x) - self.gate_bias.to(x.dtype))
        candidate = torch.tanh(self.w_g(y) + self.u_g(reset * x))
        return (1 - update) * x + update * candidate


class GatedResidual(Residual):
    """A pre-norm residual whose add is the GRU gate: g(x, ReLU(dropout(f(norm(x)))))."""

    def __init__(self, config: ModelConfig, sublayer: nn.Module, in_decoder: bool = False) -> None:
        super().__init__(config, sublayer, in_decoder)
        self.gate = GRUGate(config.d_model)

    def forward(self, x: torch.Tensor, *args, context: StepContext | None = None, **kwargs) -> torch.Tensor:
        return self.gate(x, torch.relu(self.branch(x, *args, context=context, **kwargs)))


@BLOCK.register("gtrxl")
class GatedBlock(TransformerBlock):
    """The standard block with every residual a :class:`GatedResidual` (module docstring); needs
    ``model.norm_placement=pre`` (the identity-map reordering)."""

    residual_class = GatedResidual
    # A gate keeps six s x d tensors for its backward: y (the ReLU's output), r, z, r * x, h and 1 - z, at 2 bytes
    # each (tests/models/blocks/test_gtrxl.py counts what autograd saves).
    extra_activations_per_residual = 12

    @classmethod
    def check(cls, model: ModelConfig, options: object) -> None:
        if model.norm_placement != "pre":
            raise ConfigError(f"model.block=gtrxl reads norm(x) in each branch (the identity-map reordering); set "
                              f"model.norm_placement=pre (it is {model.norm_placement})")
    block_traits = BlockTraits(
        other_stacks=OWN_ORDER,
        carried_scores=Refusal("the gate reads one tensor, and RealFormer's attention returns its scores beside it"))

    def tensor_parallel_parts(self) -> BlockParts:
        """The standard block's parts and each residual's gate (replicated per token: module docstring)."""
        parts = super().tensor_parallel_parts()
        return dataclasses.replace(parts, modules=(*parts.modules, *(f"{name}.gate" for name in parts.residuals)))
