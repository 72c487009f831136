"""The early-exit heads of a classifier: DeeBERT (Xin et al. 2020) and PABEE (Zhou et al. 2020).

``model.stack=early_exit`` (:mod:`xscale.models.stacks.early_exit`) keeps every layer's output; these heads read it.

Every layer l = 1..L of the encoder ends in an exit: the classifier's pooling (shared) of its hidden state h_l, after
the stack's final norm when the placement has one, then a linear map of its own, z_l = W_l pool(h_l) + b_l (the
last exit is the model's classification head). All exits come out of the one forward and train jointly with
PABEE's weighted average of the per-layer losses (Zhou et al. 2020, eq. 6):

    L = sum_l l * CE(z_l, y) / sum_l l

At inference each example leaves at the first layer l where
    entropy (DeeBERT, eq. 3):  H(p_l) = -sum_c p_l,c log p_l,c < ``model.stack.options.entropy``,  p_l = softmax(z_l)
    patience (PABEE, eq. 3-4, ``model.stack.options.patience`` = t > 0):  cnt_l >= t, where cnt_1 = 0 and
                               cnt_l = cnt_{l-1} + 1 if argmax z_l = argmax z_{l-1}, else 0
and at layer L when no layer meets it; its prediction is argmax z_exit. z_l reads nothing after layer l, so
computing every exit and taking each example's exit layer's prediction gives the same predictions as stopping.
:func:`run_until_exit` realises the saving: layer l runs only on the examples still in the batch (rows are
independent examples: the exited ones are dropped) and the run stops when none is left
(``Transformer.forward(..., exit_early=True)``). Where rows are not independent (:func:`batch_coupling`: MoE routes
the batch's tokens together) it is refused, and evaluation computes every exit instead.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from xscale.config.schema import ModelConfig
from xscale.models.heads.classifier import pool


def batch_coupling(model: ModelConfig) -> str | None:
    """Why the rows of a batch are not independent examples at inference (None: they are), so that dropping the
    exited ones would change the others' outputs. Norms are per token (layer, RMS, scale norm) and attention per
    sequence; MoE routes the batch's tokens together."""
    if model.moe.num_experts:
        return ("model.moe routes the batch's tokens together (expert capacity, expert choice), so dropping the "
                "exited rows would change the other rows' routing")
    return None


class LayerExits(nn.Module):
    """The exits of layers 1..L-1 (one linear each); layer L's is the model's classification head. The loss and
    the exit rule are methods, so that the loss code reads them from the model (parallel/ imports no component)."""

    def __init__(self, config: ModelConfig, entropy: float, patience: int) -> None:
        super().__init__()
        self.pooling = config.pooling
        self.entropy, self.patience = entropy, patience
        self.rows_coupled = batch_coupling(config)  # why exited rows cannot be dropped (None: they can)
        self.linears = nn.ModuleList(nn.Linear(config.d_model, config.num_classes)
                                     for _ in range(config.n_layers - 1))

    def logits_at(self, layer: int, hidden: torch.Tensor, final_norm: nn.Module | None,
                  padding_mask: torch.Tensor | None) -> torch.Tensor:
        """z_l (B, classes) of the 0-based ``layer`` < L - 1 from its output ``hidden`` (B, T, D)."""
        hidden = final_norm(hidden) if final_norm is not None else hidden
        return self.linears[layer](pool(hidden, padding_mask, self.pooling))

    def forward(self, layer_states: list[torch.Tensor], final_norm: nn.Module | None,
                padding_mask: torch.Tensor | None, last_logits: torch.Tensor) -> torch.Tensor:
        """(L, B, classes): z_l for layers 1..L-1 from their states, then the head's ``last_logits``."""
        logits = [self.logits_at(layer, hidden, final_norm, padding_mask) for layer, hidden in
                  zip(range(len(self.linears)), layer_states, strict=True)]
        return torch.stack([*logits, last_logits])

    def loss_sum(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """:func:`joint_exit_loss_sum` of every layer's ``logits`` (L, B, classes)."""
        return joint_exit_loss_sum(logits, labels)

    def predict(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`exit_predictions` under the configured rule: (class, 0-based exit layer) per example."""
        return exit_predictions(logits, self.entropy, self.patience)


def joint_exit_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum over the examples of sum_l l * CE(z_l, y) / sum_l l (``logits``: (L, B, classes))."""
    layers = logits.shape[0]
    weights = torch.arange(1, layers + 1, dtype=torch.float32, device=logits.device)
    per_layer = torch.stack([F.cross_entropy(z.float(), labels, reduction="sum", ignore_index=-100) for z in logits])
    return (weights * per_layer).sum() / weights.sum()


def prediction_entropy(logits: torch.Tensor) -> torch.Tensor:
    """H(softmax(z)) over the last dimension, in nats."""
    log_probs = F.log_softmax(logits.float(), dim=-1)
    return -(log_probs.exp() * log_probs).sum(dim=-1)


def exit_layers(logits: torch.Tensor, entropy: float, patience: int = 0) -> torch.Tensor:
    """(B,) the 0-based layer each example leaves at (``logits``: (L, B, classes); the rules in the module
    docstring: ``patience`` > 0 the PABEE rule, else the entropy threshold)."""
    layers = logits.shape[0]
    if patience > 0:
        predictions = logits.argmax(dim=-1)
        counter = torch.zeros_like(predictions[0])
        meets = [counter >= patience]
        for layer in range(1, layers):
            same = predictions[layer] == predictions[layer - 1]
            counter = torch.where(same, counter + 1, torch.zeros_like(counter))
            meets.append(counter >= patience)
        meets = torch.stack(meets)
    else:
        meets = prediction_entropy(logits) < entropy
    meets[-1] = True  # the last layer always answers
    return meets.to(torch.int64).argmax(dim=0)  # the first True


def exit_predictions(logits: torch.Tensor, entropy: float, patience: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(predicted class, 0-based exit layer) per example."""
    layers = exit_layers(logits, entropy, patience)
    chosen = logits.gather(0, layers.view(1, -1, 1).expand(1, -1, logits.shape[-1]))[0]
    return chosen.argmax(dim=-1), layers


# run_layer(layer, carry, rows) -> carry: layer l on the carried states (x first) of the batch rows ``rows``.
RunLayer = Callable[[int, tuple[torch.Tensor | None, ...], torch.Tensor], tuple[torch.Tensor | None, ...]]
# exit_logits(layer, hidden, rows) -> z_l (rows, classes) of those rows.
ExitLogits = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]


def run_until_exit(carry: tuple[torch.Tensor | None, ...], run_layer: RunLayer, exit_logits: ExitLogits,
                   layers: int, entropy: float, patience: int = 0) -> torch.Tensor:
    """Realised early exit: layer l runs only on the rows that have not left before it (the exited rows are dropped
    from ``carry``, whose tensors have the batch first), under the rules of :func:`exit_layers`; stops when no row
    is left. Returns (B, 3) int64 per example: the predicted class, the 0-based exit layer and the layers it ran."""
    batch, device = carry[0].shape[0], carry[0].device
    rows = torch.arange(batch, device=device)
    result = torch.zeros(batch, 3, dtype=torch.int64, device=device)
    counter = previous = None
    for layer in range(layers):
        carry = run_layer(layer, carry, rows)
        result[rows, 2] += 1
        logits = exit_logits(layer, carry[0], rows)
        predictions = logits.argmax(dim=-1)
        if patience > 0:  # PABEE's counter: cnt_1 = 0, then + 1 while the prediction holds
            counter = (torch.zeros_like(predictions) if previous is None
                       else torch.where(predictions == previous, counter + 1, torch.zeros_like(counter)))
            leaving = counter >= patience
        else:
            leaving = prediction_entropy(logits) < entropy
        if layer == layers - 1:
            leaving = torch.ones_like(leaving)  # the last layer always answers
        result[rows[leaving], 0] = predictions[leaving]
        result[rows[leaving], 1] = layer
        staying = ~leaving
        if not bool(staying.any()):
            break
        rows, previous = rows[staying], predictions[staying]
        counter = None if counter is None else counter[staying]
        carry = tuple(None if state is None else state[staying] for state in carry)
    return result
