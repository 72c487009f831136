"""Autoregressive generation from a trained decoder: sampling rules and the decoding loop (KV cache or recompute)."""

from xscale.generation.decode import Generation, decodes_with_cache, generate
from xscale.generation.sampling import Sampling, next_tokens

__all__ = ["Generation", "Sampling", "decodes_with_cache", "generate", "next_tokens"]
