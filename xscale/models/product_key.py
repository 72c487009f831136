"""Product-key memory layers (Lample et al. 2019, "Large Memory Layers with Product Keys", sec. 3) in place of the
feed-forward network: a query q(x) searches N = n^2 keys that are the Cartesian product of two sets of n sub-keys,

  q = [q1 ; q2],   k_(i,j) = [c_i ; c'_j],   q . k_(i,j) = q1 . c_i + q2 . c'_j           (eq. 4)
  I = top-k over (i, j) of q . k_(i,j), found among the k x k sums of the top-k of each half  (sec. 3.2, exact)
  w = softmax(q . k_I),   m(x) = sum_{l in I} w_l v_l                                          (eq. 2-3)

with the memory's H heads (``heads``) each searching with its own query projection and sub-keys and their outputs
summed (sec. 3.2, multi-head memory), the values shared. The search costs O((n + k^2) d_k) per head instead of
O(n^2 d_k).

Departures: the query network is a linear map followed by LayerNorm (the paper uses BatchNorm, whose batch
statistics would differ between data-parallel layouts); every layer's FFN is a memory (``model.ffn`` is one kind
for the stack; the paper swaps one or two layers' FFN); the values train by dense gradients (the paper's sparse
updates with a higher learning rate are not used); ``model.ffn_hidden`` is not read. It declares no tensor-parallel
split (the top-k reads every key), so ``parallel.tp > 1`` is refused; it runs under data parallelism and ZeRO.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor, nn

from xscale.config.schema import ConfigError
from xscale.models.dropout import Dropout
from xscale.models.registry import FFN
from xscale.runtime import StepContext


@dataclasses.dataclass
class ProductKeyOptions:
    sub_keys: int = dataclasses.field(default=32, metadata={"help": "n: sub-keys per half (n^2 memory slots)"})
    topk: int = dataclasses.field(default=8, metadata={"help": "k: slots each query reads"})
    heads: int = dataclasses.field(default=4, metadata={"help": "memory heads (own queries and keys, shared values)"})
    key_dim: int = dataclasses.field(default=64, metadata={"help": "d_k: query and key width (even)"})

    def __post_init__(self) -> None:
        for name in ("sub_keys", "topk", "heads", "key_dim"):
            if getattr(self, name) < 1:
                raise ConfigError(f"model.ffn.options.{name} must be >= 1 for 'product_key' "
                                  f"(got {getattr(self, name)})")
        if self.key_dim % 2:
            raise ConfigError(f"model.ffn.options.key_dim={self.key_dim} must be even for 'product_key' (two halves)")
        if self.topk > self.sub_keys:
            raise ConfigError(f"model.ffn.options.topk={self.topk} must be <= sub_keys={self.sub_keys} for "
                              "'product_key'")


@FFN.register("product_key")
class ProductKeyMemory(nn.Module):
    """m(x) = sum over heads of softmax(top-k product-key scores) . values (Lample et al. 2019, eq. 2-4)."""

    Options = ProductKeyOptions

    def __init__(self, d_model: int, hidden: int, bias: bool = False, dropout: float = 0.0,
                 options: ProductKeyOptions | None = None) -> None:
        super().__init__()
        self.options = options = options or ProductKeyOptions()
        self.query = nn.Linear(d_model, options.heads * options.key_dim, bias=bias)
        self.query_norm = nn.LayerNorm(options.key_dim)
        self.sub_keys = nn.Parameter(torch.randn(options.heads, 2, options.sub_keys, options.key_dim // 2))
        self.values = nn.Embedding(options.sub_keys ** 2, d_model)
        self.dropout = Dropout(dropout)

    def forward(self, x: Tensor, context: StepContext | None = None) -> Tensor:
        scores, slots = self.search(x)
        weights = torch.softmax(scores, dim=-1)  # (..., heads, k)
        read = (weights[..., None] * self.values(slots)).sum(-2)  # (..., heads, d_model)
        return self.dropout(read.sum(-2), context)

    def search(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """The top-k scores q . k_(i,j) and slots i n + j (..., heads, k) of every head's query."""
        options = self.options
        queries = self.query_norm(self.query(x).unflatten(-1, (options.heads, options.key_dim)))
        halves = queries.unflatten(-1, (2, options.key_dim // 2))  # (..., heads, 2, d_k / 2)
        half_scores = (halves[..., None, :] * self.sub_keys.to(x.dtype)).sum(-1)  # (..., heads, 2, n)
        top_scores, top_index = half_scores.topk(options.topk, dim=-1)  # (..., heads, 2, k)
        candidates = top_scores[..., 0, :, None] + top_scores[..., 1, None, :]  # (..., heads, k, k)
        scores, flat = candidates.flatten(-2).topk(options.topk, dim=-1)
        first = top_index[..., 0, :].gather(-1, flat // options.topk)
        second = top_index[..., 1, :].gather(-1, flat % options.topk)
        return scores, first * options.sub_keys + second
