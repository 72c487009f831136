"""Parameter counts of a model config, from a model built on the meta device (no memory)."""

from __future__ import annotations

from dataclasses import dataclass

from xscale.config.schema import Config, MoEConfig
from xscale.models import build_model


def experts_per_token(moe: MoEConfig) -> float:
    """Experts a token passes through on average: top_k under token choice (switch, gshard), one under hash
    routing, capacity_factor under expert choice (each expert takes c * n / E of n tokens; Zhou et al. 2022)."""
    if moe.router.kind == "expert_choice":
        return moe.capacity_factor
    if moe.router.kind == "hash":
        return 1.0
    return float(moe.top_k)


@dataclass
class ModelCount:
    total: int
    embedding: int
    per_component: dict[str, int]
    expert: int = 0  # MoE expert weights (sharded by expert parallelism)
    active_expert: float = 0.0  # the expert weights one token uses: expert * experts_per_token / num_experts
    tied_head: int = 0  # the vocabulary projection's weights when they are the embedding's (counted once, in it)

    @property
    def non_embedding(self) -> int:
        return self.total - self.embedding

    @property
    def active_non_embedding(self) -> float:
        """The non-embedding parameters one token multiplies by: every dense weight, only its experts' share of the
        expert weights (the N of 6N for a MoE model)."""
        return self.non_embedding - self.expert + self.active_expert

    @property
    def matmul_per_token(self) -> float:
        """The weights one token multiplies by, the N of 6N: :attr:`active_non_embedding` and the LM head's. An
        untied head is a non-embedding weight already; a head tied to the embedding is counted here too, since the
        embedding's lookup is no matmul but the head's projection is (as Megatron-LM's logit-layer term 6Vh and
        PaLM's N with its shared embedding count it)."""
        return self.active_non_embedding + self.tied_head


def count_parameters(config: Config) -> ModelCount:
    model = build_model(config.model, materialize=False)
    per_component: dict[str, int] = {}
    total = expert = 0
    for name, param in model.named_parameters():  # tied weights are counted once
        total += param.numel()
        expert += param.numel() if ".experts." in name else 0
        parts = name.split(".")
        key = parts[0] if parts[0] not in ("stack", "decoder") else ".".join(p for p in parts[:5] if not p.isdigit())
        per_component[key] = per_component.get(key, 0) + param.numel()
    # The token table (a patch-embedding classifier's: its projection and class token, model.input=patches).
    embedding = (config.model.vocab_size * config.model.d_model if config.model.input == "tokens"
                 else per_component["embedding"])
    moe = config.model.moe
    active_expert = expert * experts_per_token(moe) / moe.num_experts if moe.num_experts else 0.0
    output = getattr(model, "output", None)
    tied = output is not None and output.weight is getattr(getattr(model, "embedding", None), "weight", None)
    tied_head = output.weight.numel() if tied else 0
    return ModelCount(total, embedding, per_component, expert, active_expert, tied_head)
