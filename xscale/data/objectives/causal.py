"""Causal language modelling (GPT): predict token t+1 from the tokens up to t."""

from __future__ import annotations

import torch

from xscale.data.objectives.registry import OBJECTIVES, Sample, TextObjective


def causal_lm(window: torch.Tensor) -> dict[str, torch.Tensor]:
    """A window of T+1 tokens: predict token t+1 from tokens <= t."""
    return {"input_ids": window[:-1].clone(), "labels": window[1:].clone()}


@OBJECTIVES.register("clm")
class CausalLM(TextObjective):
    """Windows of T+1 tokens, consecutive windows overlapping by one; no options."""

    family, text_only = "decoder", False

    def __init__(self, tokenizer, seq_len: int, stream, options) -> None:
        super().__init__(tokenizer, seq_len, stream, options)
        self.window_length = seq_len + 1

    def __call__(self, window: torch.Tensor, generator: torch.Generator) -> Sample:
        return causal_lm(window)
