"""How one optimizer step's forward and backward run under a layout.

The trainer knows neither the model variant nor the layout: it hands each step's batch (this
data-parallel rank's share of the global batch) to an :class:`Engine`. The contract every engine
keeps, and the parity tests check: the loss it returns and the gradients it leaves are those of
the single-process model on the whole global batch, where the loss is the mean token
cross-entropy over every labelled token of the global batch (plus MoE auxiliary terms).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions

from xscale.ops import cross_entropy_sum, linear_cross_entropy_sum

Batch = dict[str, torch.Tensor]
STATE_DICT_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def model_loss_sum(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Sum of token cross-entropies over labelled tokens (labels == -100 are ignored)."""
    hidden = model.hidden_states(batch["input_ids"], batch.get("decoder_input_ids"))
    if model.head_transform is not None:
        hidden = model.head_transform(hidden)
    if model.output.bias is None:
        return linear_cross_entropy_sum(hidden, model.output.weight, batch["labels"])
    return cross_entropy_sum(model.output(hidden), batch["labels"])


def split_microbatches(batch: Batch, micro_batch_size: int) -> list[Batch]:
    size = batch["input_ids"].shape[0]
    return [{key: value[start:start + micro_batch_size] for key, value in batch.items()}
            for start in range(0, size, micro_batch_size)]


class Engine:
    """Single device (and the base of the parallel engines): gradient accumulation over microbatches."""

    def __init__(self, model: nn.Module, micro_batch_size: int, autocast_dtype: torch.dtype | None = None) -> None:
        self.model = model
        self.micro_batch_size = micro_batch_size
        self.autocast_dtype = autocast_dtype

    @property
    def model_parts(self) -> list[nn.Module]:
        """The modules this rank holds (one, or several pipeline stages)."""
        return [self.model]

    def parameters(self) -> Iterator[nn.Parameter]:
        for part in self.model_parts:
            yield from part.parameters()

    def _autocast(self):
        device_type = next(self.model.parameters()).device.type
        return torch.autocast(device_type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None)

    def global_token_count(self, batch: Batch) -> torch.Tensor:
        """Labelled tokens in the global batch (a data-parallel engine sums over ranks)."""
        return (batch["labels"] != -100).sum()

    def train_step(self, batch: Batch) -> torch.Tensor:
        """Forward + backward over the microbatches; returns the global-batch mean loss (detached)."""
        self.model.train()
        tokens = self.global_token_count(batch).clamp_min(1)
        total = torch.zeros((), dtype=torch.float32)
        for micro in split_microbatches(batch, self.micro_batch_size):
            with self._autocast():
                loss = model_loss_sum(self.model, micro) / tokens
            loss.backward()
            total += loss.detach().float().cpu()
        return self.reduce_loss(total)

    @torch.no_grad()
    def eval_loss(self, batch: Batch) -> torch.Tensor:
        self.model.eval()
        tokens = self.global_token_count(batch).clamp_min(1)
        total = torch.zeros((), dtype=torch.float32)
        for micro in split_microbatches(batch, self.micro_batch_size):
            with self._autocast():
                total += (model_loss_sum(self.model, micro) / tokens).float().cpu()
        return self.reduce_loss(total)

    def reduce_loss(self, local: torch.Tensor) -> torch.Tensor:
        """Combine per-rank partial losses into the global one (identity on one device)."""
        return local

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip to ``max_norm`` (0: only measure) and return the global gradient norm."""
        params = [p for p in self.parameters() if p.grad is not None]
        if max_norm > 0:
            return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
        return torch.nn.utils.get_total_norm([p.grad for p in params])

    def state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        """Model and optimizer state keyed by canonical parameter names (DCP-friendly, any layout).

        The optimizer state is flattened to ``state.<name>.<key>`` / ``param_groups.<name>.<key>``:
        nested param groups are saved by group index, which collides when ranks hold different
        parameters (pipeline stages) and DCP keeps one rank's list.
        """
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optimizer_state = get_state_dict(self.model, optimizer, options=STATE_DICT_OPTIONS)
        return {"model": model_state, "optimizer": optimizer_state}

    def load_state_dict(self, state: dict, optimizer: torch.optim.Optimizer) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                       options=STATE_DICT_OPTIONS)
