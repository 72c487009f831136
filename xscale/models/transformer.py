"""The Transformer: decoder-only (GPT), encoder-only (BERT) or encoder-decoder (T5), by config.

Plain single-device PyTorch. Layers live in a ``ModuleDict`` keyed by their index so that
pipeline stages can drop layers and keep the names that checkpoints use.
"""

from __future__ import annotations

import torch
from torch import nn

from xscale.config import ModelConfig
from xscale.models.block import TransformerBlock
from xscale.models.dropout import Dropout, dropout_depth, name_dropout_sites
from xscale.models.moe.token_ids import routing_token_ids
from xscale.models.norm import build_norm
from xscale.models.position import build_position
from xscale.ops.reference import ACTIVATIONS


class LMHeadTransform(nn.Module):
    """BERT's MLM head transform: norm(act(x W + b)) before the vocabulary projection."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.d_model, config.d_model)
        self.activation = "gelu" if config.ffn in ("gelu", "relu") else "gelu_tanh"
        self.norm = build_norm(config.norm, config.d_model, config.norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(ACTIVATIONS[self.activation](self.dense(x)))


class Stack(nn.Module):
    """A stack of blocks with its own position encoding and (for pre/sandwich) final norm."""

    def __init__(self, config: ModelConfig, n_layers: int, *, causal: bool, cross: bool, first_index: int) -> None:
        super().__init__()
        self.n_layers = n_layers
        self.share_layers = config.share_layers
        self.first_depth = 0  # the depth of blocks()[0] in the whole stack (a pipeline stage may start later)
        self.position = build_position(config.position, config.d_model, config.n_heads, config.head_dim,
                                       config.max_seq_len, causal, config.rope_theta)
        uses_bias = self.position.biases_logits
        built = 1 if config.share_layers else n_layers
        self.layers = nn.ModuleDict({
            str(i): TransformerBlock(config, first_index + i, causal=causal, cross=cross, uses_bias=uses_bias)
            for i in range(built)
        })
        self.final_norm = (
            build_norm(config.norm, config.d_model, config.norm_eps) if config.norm_placement != "post" else None
        )

    def blocks(self) -> list[nn.Module]:
        """The blocks in execution order (one block repeated when weights are shared)."""
        if self.share_layers:
            return [self.layers["0"]] * self.n_layers
        return list(self.layers.values())

    @property
    def shared_first_depth(self) -> int | None:
        """With weights shared, the depth :func:`run_blocks` numbers ``blocks()[0]`` (dropout draws per depth)."""
        return self.first_depth if self.share_layers else None


def run_blocks(blocks: list[nn.Module], x: torch.Tensor, position: nn.Module | None,
               memory: torch.Tensor | None = None, scores: torch.Tensor | None = None,
               first_depth: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Apply ``blocks`` in order; returns (x, scores). ``scores`` are the pre-softmax scores that RealFormer
    blocks (``carries_scores``) pass on; other blocks leave them as they are. A pipeline stage calls this on
    its blocks and sends ``scores`` along with ``x`` when it is not None. ``first_depth`` (shared weights:
    :attr:`Stack.shared_first_depth`): block i runs at depth first_depth + i, where its dropout draws its own masks."""
    for index, block in enumerate(blocks):
        with dropout_depth(None if first_depth is None else first_depth + index):
            if block.carries_scores:
                x, scores = block(x, position, memory, scores=scores)
            else:
                x = block(x, position, memory)
    return x, scores


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embedding = nn.Embedding(config.vocab_size, config.d_model)
        self.embedding_norm = (
            build_norm(config.norm, config.d_model, config.norm_eps) if config.embedding_norm else None
        )
        self.embedding_dropout = Dropout(config.dropout)
        decoder_only = config.family == "decoder"
        self.stack = Stack(config, config.n_layers, causal=decoder_only, cross=False, first_index=0)
        self.decoder = (
            Stack(config, config.decoder_layers, causal=True, cross=True, first_index=config.n_layers)
            if config.family == "encoder_decoder" else None
        )
        self.head_transform = LMHeadTransform(config) if config.lm_head_transform else None
        self.output = nn.Linear(config.d_model, config.vocab_size, bias=config.lm_head_bias)
        self.tie_weights()
        name_dropout_sites(self)

    def tie_weights(self) -> None:
        """Share the embedding matrix with the output projection (Press & Wolf 2017); re-run after to_empty."""
        if self.config.tie_embeddings:
            self.output.weight = self.embedding.weight

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)
        if self.config.family == "encoder_decoder" and self.config.tie_embeddings:
            x = x * self.config.d_model**0.5  # T5/Vaswani scaling keeps tied embeddings well-conditioned
        return x

    def _embed_for_stack(self, tokens: torch.Tensor, stack: Stack) -> torch.Tensor:
        x = stack.position.embed(self.embed(tokens))
        if self.embedding_norm is not None:
            x = self.embedding_norm(x)
        return self.embedding_dropout(x)

    def hidden_states(self, input_ids: torch.Tensor, decoder_input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states (B, T, D) of the stack that feeds the LM head."""
        x = self._embed_for_stack(input_ids, self.stack)
        with routing_token_ids(input_ids):  # hash-routed MoE layers route by the ids of the tokens they see
            x, _ = run_blocks(self.stack.blocks(), x, self.stack.position,
                              first_depth=self.stack.shared_first_depth)
        if self.stack.final_norm is not None:
            x = self.stack.final_norm(x)
        if self.decoder is None:
            return x
        if decoder_input_ids is None:
            raise ValueError("an encoder-decoder model needs decoder_input_ids")
        memory = x
        y = self._embed_for_stack(decoder_input_ids, self.decoder)
        with routing_token_ids(decoder_input_ids):
            y, _ = run_blocks(self.decoder.blocks(), y, self.decoder.position, memory,
                              first_depth=self.decoder.shared_first_depth)
        return self.decoder.final_norm(y) if self.decoder.final_norm is not None else y

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.head_transform is not None:
            hidden = self.head_transform(hidden)
        return self.output(hidden)

    def forward(self, input_ids: torch.Tensor, decoder_input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids (B, T) -> logits (B, T, vocab) (of the decoder, for encoder-decoder models)."""
        return self.logits(self.hidden_states(input_ids, decoder_input_ids))
