"""FNet token mixing (Lee-Thorp et al. 2022, "FNet: Mixing Tokens with Fourier Transforms", sec. 3.2, eq. 3): the
attention sub-layer replaced by the real part of a 2-D discrete Fourier transform over the sequence and the hidden
dimension,

  y = Re(F_seq(F_hidden(x))),

parameter-free and O(T log T). Departures: it runs in the attention slot of the block, on each head's slice of the
value projection (the hidden transform is over the d/H features of a head, not the whole width), and the module's
output projection follows; FNet mixes the block input itself with no projection. Keeping the heads independent lets
tensor parallelism split them. The Fourier transform mixes every position with every other, so FNet has no causal
form: a decoder is refused by name (the paper's FNet is an encoder). Context parallelism runs it on the gathered
sequence. There are no attention probabilities, so attention dropout does not apply.
"""

from __future__ import annotations

import torch
from torch import Tensor

from xscale.config.schema import ModelConfig
from xscale.models.attention.core import AttentionCore, NoOptions, expand_kv
from xscale.models.registry import ATTENTION
from xscale.models.traits import ParallelTraits
from xscale.runtime import StepContext


@ATTENTION.register("fnet")
class FourierMixing(AttentionCore):
    """Re(FFT2) over (tokens, head features) of the values (Lee-Thorp et al. 2022, eq. 3)."""

    Options = NoOptions
    causal_capable = False
    parallel_traits = ParallelTraits(tp="split_heads", cp_whole_sequence=True)

    def __init__(self, model: ModelConfig, layer_index: int, options: NoOptions) -> None:
        super().__init__(model, layer_index, options)
        self.uses_queries = False
        self.uses_keys = False

    @classmethod
    def applies_attention_dropout(cls, causal: bool) -> bool:
        return False  # a Fourier transform forms no attention probabilities

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, bias: Tensor | None = None,
                context: StepContext | None = None) -> Tensor:
        values = expand_kv(v, q.shape[1])
        at_least_fp32 = values.to(torch.promote_types(values.dtype, torch.float32))  # no half-precision FFT on CPU
        return torch.fft.fft2(at_least_fp32, dim=(-2, -1)).real.to(v.dtype)
