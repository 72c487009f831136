"""The MoE feed-forward layer: route, dispatch to experts, combine by gates (GShard / Switch).

y(x) = sum over x's kept assignments (e, g) of g * FFN_e(x); a token whose every assignment overflowed
its expert's capacity gets 0 (the residual connection passes it through). The auxiliary losses reach
the gradients through :func:`attach_auxiliary_loss`, so no trainer step or pipeline schedule needs to
know they exist.
"""

from __future__ import annotations

import torch
from torch import nn

from xscale.config.schema import ConfigError, ModelConfig
from xscale.models.ffn import build_ffn
from xscale.models.moe.experts import StackedExperts
from xscale.models.moe.routing import LocalTokens
from xscale.models.registry import FFN, ROUTER
from xscale.models.traits import ParallelTraits
from xscale.ops.moe_permute import assignment_of_token, combine_by_gate, gather_tokens
from xscale.runtime import ExpertExchange, StepContext
from xscale.runtime.eager import eager_under_compile


class AttachAuxiliaryLoss(torch.autograd.Function):
    """Identity on ``output``; in backward also sends d(aux)/d(aux) = 1 into ``aux``'s graph.

    Adding the layer's weighted auxiliary loss to the training loss is equivalent: the loss is a sum,
    so its gradient is the output's gradient path plus the auxiliary term's own.
    """

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad_output, torch.ones((), dtype=torch.float32, device=grad_output.device)


@eager_under_compile
def attach_auxiliary_loss(output: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
    """:class:`AttachAuxiliaryLoss` applied eagerly, also inside a compiled module (``train.compile``): traced, its
    output aliases an input of the graph, so a view of it (the layer's ``view_as(x)``) was replayed by AOTAutograd
    from that input outside the graph and the auxiliary loss's gradient was dropped without a word."""
    return AttachAuxiliaryLoss.apply(output, aux)


class LocalExperts(LocalTokens):
    """Every expert on this device: the forward's own tokens are the routing group, applied to the experts directly."""

    experts_local = True

    def dispatch(self, tokens_by_expert: torch.Tensor, tokens_per_expert: torch.Tensor,
                 experts: StackedExperts) -> torch.Tensor:
        return experts(tokens_by_expert, tokens_per_expert.tolist())


class StaticLocalExperts(LocalExperts):
    """Every expert on this device and the routing's shapes fixed by the token count (``static_rows``): the routers
    keep every assignment as a row (:func:`xscale.models.moe.routing.static_rows_routing`), so the layer makes no
    host sync. Chosen where the experts run as grouped GEMMs (:meth:`StackedExperts.static_rows_apply`)."""

    static_rows = True


LOCAL_EXPERTS = LocalExperts()
STATIC_LOCAL_EXPERTS = StaticLocalExperts()


class MoELayer(nn.Module):
    """Mixture-of-Experts FFN (Shazeer et al. 2017; GShard; Switch): router + E stacked FFN experts.

    A hash router reads the token ids of the sequence the layer sees from the forward's context
    (``StepContext.token_ids``), which the model sets for each stack. Under expert parallelism the layer holds some
    of the experts (:func:`xscale.parallel.expert.apply_expert_parallel`) and the context's ``experts`` exchange
    routes over the ep group and sends tokens to the ranks holding theirs; without one, every expert is here.
    The context's ``moe_loss_scale`` is the weight of this forward's auxiliary losses. A routing group is the
    tokens one forward routes together (one microbatch on one device; under expert parallelism, that microbatch on
    every rank of the ep group). A step that sums gradients over the G routing groups passes 1/G, so
    the auxiliary losses are the mean over the step's routing groups (1.0: one group).
    After each forward, ``metrics`` holds detached tensors over the forward's routing group: tokens_per_expert,
    dropped_fraction, aux_loss, z_loss (unscaled); :meth:`layer_metrics` gives them as floats. A training step's
    statistics over all its routing groups come from :class:`xscale.parallel.expert.routing_groups.RoutingGroups`.
    """

    # Tensor parallelism replicates the layer: every tp rank routes the whole sequence (the experts, which an
    # expert-parallel ZeRO-3 plan may shard as their own unit, swap in their local parameters on their own).
    parallel_traits = ParallelTraits(tp="replicated", replicated_parts=("experts",))

    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        moe = config.moe
        self.layer_index = layer_index
        self.num_experts = moe.num_experts
        self.aux_loss_coef = moe.aux_loss_coef
        self.z_loss_coef = moe.z_loss_coef
        self.router = build_router(config, layer_index)
        self.experts = StackedExperts(moe.num_experts, config.ffn.kind, config.d_model, config.ffn_hidden, config.bias)
        self.shared_expert = (
            build_ffn(config.ffn, config.d_model, config.ffn_hidden, config.bias, 0.0) if moe.shared_expert else None
        )
        self.metrics: dict[str, torch.Tensor] = {}

    def _exchange(self, context: StepContext | None) -> ExpertExchange:
        exchange = None if context is None else context.experts
        if exchange is not None:
            return exchange
        if self.experts.num_experts != self.num_experts:
            raise RuntimeError(
                f"MoE layer {self.layer_index} holds {self.experts.num_experts} of its {self.num_experts} experts "
                "(expert parallelism): run it with the expert-parallel exchange in its context, as the parallel "
                "model's forward does (xscale.parallel.expert.expert_parallel_context)")
        return LOCAL_EXPERTS

    def forward(self, x: torch.Tensor, context: StepContext | None = None) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        exchange = self._exchange(context)
        if exchange is LOCAL_EXPERTS and self.experts.static_rows_apply(tokens):
            exchange = STATIC_LOCAL_EXPERTS
        routing = self.router(x, exchange, context)
        if routing.row_ends is not None:  # every assignment a row, group ends on the device: no host sync
            output = self.experts.static_rows(tokens, routing.token_index, routing.gate, routing.row_ends,
                                              routing.expert_index)
        elif routing.one_per_token and exchange.experts_local:  # dispatch and combine in the experts' pass
            output = self.experts(tokens, routing.local_tokens_per_expert.tolist(), routing.token_index, routing.gate,
                                  routing.input_gradient)
        else:
            assignment = assignment_of_token(routing.token_index, tokens.shape[0]) if routing.one_per_token else None
            outputs_by_expert = exchange.dispatch(gather_tokens(tokens, routing.token_index, assignment),
                                                  routing.local_tokens_per_expert, self.experts)
            output = combine_by_gate(outputs_by_expert, routing.gate, routing.token_index, tokens.shape[0],
                                     tokens.dtype, assignment)
        if self.shared_expert is not None:
            output = output + self.shared_expert(tokens)
        self._record(routing, exchange)
        scale = 1.0 if context is None else context.moe_loss_scale
        aux = scale * (self.aux_loss_coef * routing.aux_loss + self.z_loss_coef * routing.z_loss)
        if torch.is_grad_enabled() and aux.requires_grad:
            output = attach_auxiliary_loss(output, aux)
        return output.view_as(x)

    def _record(self, routing, group: ExpertExchange) -> None:
        losses = torch.stack([routing.aux_loss.detach().float(), routing.z_loss.detach().float()])
        aux_loss, z_loss = group.all_reduce(losses)
        self.metrics = {
            "tokens_per_expert": routing.tokens_per_expert.detach(),
            "dropped_fraction": routing.dropped_fraction.detach(),
            "aux_loss": aux_loss,
            "z_loss": z_loss,
        }

    def layer_metrics(self) -> dict[str, float]:
        """The last forward's routing statistics as floats (:func:`routing_summary`)."""
        return routing_summary(self.metrics)


def routing_summary(metrics: dict[str, torch.Tensor]) -> dict[str, float]:
    """Routing statistics as the trainer logs them per layer: ``dropped_fraction``, ``aux_loss``, ``z_loss``,
    ``max_load`` (busiest expert / mean) and ``expert{e}_tokens``."""
    if not metrics:
        return {}
    load = metrics["tokens_per_expert"].float()
    summary = {
        "dropped_fraction": float(metrics["dropped_fraction"]),
        "aux_loss": float(metrics["aux_loss"]),
        "z_loss": float(metrics["z_loss"]),
        "max_load": float(load.max() / load.mean().clamp_min(1e-9)),
    }
    for expert, count in enumerate(load.tolist()):
        summary[f"expert{expert}_tokens"] = count
    return summary


def build_router(config: ModelConfig, layer_index: int) -> nn.Module:
    """The router ``model.moe.router`` names (its options checked: none so far)."""
    ROUTER.options(config.moe.router, "model.moe.router")
    return ROUTER.get(config.moe.router.kind)(config, layer_index)


def check_moe_config(config: ModelConfig, ep: int = 1) -> None:
    """Refuse MoE settings that cannot run, with a ConfigError saying what to change (before any build)."""
    moe = config.moe
    if moe.num_experts <= 0:
        raise ConfigError(f"model.moe.num_experts must be positive for an MoE layer, got {moe.num_experts}")
    if not 1 <= moe.top_k <= moe.num_experts:
        raise ConfigError(f"model.moe.top_k={moe.top_k} must lie in [1, num_experts={moe.num_experts}]")
    if not moe.dropless and (moe.capacity_factor <= 0 or moe.eval_capacity_factor <= 0):
        raise ConfigError(
            f"model.moe.capacity_factor={moe.capacity_factor} and eval_capacity_factor={moe.eval_capacity_factor} "
            "must be positive (1.0-2.0 is usual); set model.moe.dropless=true for no capacity"
        )
    if moe.min_capacity < 0:
        raise ConfigError(f"model.moe.min_capacity must be >= 0, got {moe.min_capacity}")
    if moe.drop_policy not in ("probs", "position"):
        raise ConfigError(f"model.moe.drop_policy='{moe.drop_policy}' is not one of probs, position")
    if moe.router.kind not in ROUTER:
        raise ConfigError(f"model.moe.router='{moe.router.kind}' is not one of {', '.join(ROUTER.names())}")
    if config.ffn.kind in FFN and not hasattr(FFN.get(config.ffn.kind), "activation"):
        raise ConfigError(f"model.moe's experts are copies of model.ffn's MLP, and model.ffn={config.ffn.kind} is "
                          "not an MLP; use an MLP (model.ffn=swiglu, gelu, ...) with model.moe")
    if ep < 1 or moe.num_experts % ep:
        raise ConfigError(
            f"model.moe.num_experts={moe.num_experts} is not divisible by parallel.ep={ep}; pick ep from "
            f"{[p for p in range(1, moe.num_experts + 1) if moe.num_experts % p == 0]}"
        )
    layers = config.total_layers
    with torch.device("meta"):  # the routers check their own options (top_k, causality) when built
        for layer_index in range(layers):
            if moe.is_moe_layer(layer_index):
                build_router(config, layer_index)


def build_moe(config: ModelConfig, layer_index: int) -> nn.Module:
    """The MoE FFN of layer ``layer_index``; refuses settings it cannot honour with a ConfigError."""
    check_moe_config(config)
    return MoELayer(config, layer_index)


def moe_layers(model: nn.Module) -> list[MoELayer]:
    return [module for module in model.modules() if isinstance(module, MoELayer)]


def collect_moe_metrics(model: nn.Module) -> dict[str, float]:
    """Per-layer load of the last forward, keyed ``moe/layer{i}/<name>`` (see :func:`routing_summary`)."""
    return {f"moe/layer{layer.layer_index}/{name}": value
            for layer in moe_layers(model) for name, value in layer.layer_metrics().items()}
