"""The decoding loop: prefill the prompt, then one token per step until eos or ``max_new_tokens``.

Two paths give the same tokens and logits (tests/generation/test_decode.py checks them at 1e-5):
  cached     each step feeds the new token only; every attention layer reads the prefix's keys/values from a
             :class:`~xscale.models.kv_cache.KVCache` in the forward's context (decoders whose attention cores can
             all use one: dense / mha / gqa / mqa);
  recompute  each step runs the whole prefix again and keeps the last position's logits (every other core:
             sparse patterns, linear, low-rank, content-based, RealFormer, ...; correct, O(T) times slower).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from xscale.generation.sampling import Sampling, next_tokens
from xscale.models.attention import Attention
from xscale.models.kv_cache import KVCache, cached_forward, can_cache

GREEDY = Sampling(temperature=0.0)


@dataclass
class Generation:
    tokens: torch.Tensor  # (B, N) the new tokens (after a row's eos: eos again), N <= max_new_tokens
    logits: torch.Tensor  # (B, N, vocab) the logits each new token was chosen from
    cached: bool  # whether the KV cache path ran (else the prefix was recomputed every step)


def decodes_with_cache(model: nn.Module) -> bool:
    """Whether ``model`` can decode from a KV cache: a decoder whose every self-attention core can use one."""
    cores = [module.core for module in model.modules() if isinstance(module, Attention)]
    return model.config.family == "decoder" and model.stack.decodes_from_cache and all(can_cache(core) for core in cores)


def check_decoder(model: nn.Module, prompt_length: int, max_new_tokens: int) -> None:
    """Refuse what the loop cannot serve, with what to change."""
    config = model.config
    if config.family != "decoder":
        raise ValueError(f"generation needs a decoder (model.family=decoder); this model is an {config.family}")
    if prompt_length < 1:
        raise ValueError("the prompt holds no tokens; give some text or token ids")
    if max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    if prompt_length + max_new_tokens > config.max_seq_len:
        raise ValueError(f"the prompt ({prompt_length} tokens) plus --max-new-tokens={max_new_tokens} exceeds the "
                         f"model's model.max_seq_len={config.max_seq_len}; shorten the prompt or lower --max-new-tokens")


@torch.no_grad()
def generate(model: nn.Module, prompt: torch.Tensor, max_new_tokens: int, sampling: Sampling = GREEDY, *,
             seed: int = 0, eos_id: int | None = None, use_cache: bool | None = None,
             vocab_size: int | None = None) -> Generation:
    """Continue ``prompt`` (B, T) token ids (B prompts of equal length). ``use_cache``: None picks the cache when
    the model can use one (:func:`decodes_with_cache`); True insists on it. Draws come from a generator seeded
    with ``seed``, so a seed fixes the output. ``vocab_size``: only ids below it are chosen (the tokenizer's,
    when the model's vocabulary was padded beyond it)."""
    check_decoder(model, prompt.shape[1], max_new_tokens)
    cached = decodes_with_cache(model) if use_cache is None else use_cache
    if cached and not decodes_with_cache(model):
        raise ValueError("this model's attention cannot decode from a KV cache; use_cache=None recomputes instead")
    model.eval()
    generator = torch.Generator(prompt.device).manual_seed(seed)
    cache = KVCache(capacity=prompt.shape[1] + max_new_tokens) if cached else None
    sequence, finished = prompt, torch.zeros(prompt.shape[0], dtype=torch.bool, device=prompt.device)
    tokens, step_logits = [], []
    fed = prompt  # what the next forward feeds: the prompt (prefill), then the last token (cached) or everything
    for _ in range(max_new_tokens):
        logits = cached_forward(model, fed, cache) if cached else model(fed)
        last = logits[:, -1].float()
        if vocab_size is not None and vocab_size < last.shape[-1]:
            last[:, vocab_size:] = float("-inf")
        token = next_tokens(last, sampling, generator)
        if eos_id is not None:
            token = torch.where(finished, torch.full_like(token, eos_id), token)
            finished = finished | (token == eos_id)
        tokens.append(token)
        step_logits.append(last)
        sequence = torch.cat([sequence, token[:, None]], dim=1)
        if bool(finished.all()):
            break
        fed = token[:, None] if cached else sequence
    return Generation(torch.stack(tokens, dim=1), torch.stack(step_logits, dim=1), cached)
