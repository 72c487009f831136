"""Choosing the next token from logits: greedy, temperature, top-k (Fan et al. 2018) and top-p / nucleus sampling
(Holtzman et al. 2020), applied in that order (temperature, then top-k, then top-p), as Hugging Face's
``generate`` orders its logits warpers. Draws come from a ``torch.Generator`` the caller seeds, so a seed fixes them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    temperature: float = 1.0  # logits / temperature; 0: greedy (argmax)
    top_k: int = 0  # keep the k most likely tokens (0: all)
    top_p: float = 1.0  # keep the smallest set of most likely tokens whose probability reaches p (1: all)

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"--temperature must be >= 0 (0: greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"--top-k must be >= 0 (0: no limit), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p must be in (0, 1] (1: no limit), got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """-inf for every token below the k-th largest logit of its row (ties at the k-th are kept)."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """-inf for every token outside the nucleus: the most likely tokens, in order, while the probability of those
    before each is below p (so the kept set's probability reaches p; the most likely token is always kept)."""
    if p >= 1:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probabilities = torch.softmax(sorted_logits, dim=-1)
    before = torch.cumsum(probabilities, dim=-1) - probabilities
    dropped_sorted = before >= p
    dropped = torch.zeros_like(dropped_sorted).scatter(-1, order, dropped_sorted)
    return logits.masked_fill(dropped, float("-inf"))


def next_tokens(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None = None) -> torch.Tensor:
    """(B, vocab) logits of the last position -> (B,) token ids."""
    logits = logits.float()
    if sampling.greedy:
        return logits.argmax(dim=-1)
    logits = top_p_filter(top_k_filter(logits / sampling.temperature, sampling.top_k), sampling.top_p)
    return torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator).squeeze(-1)
