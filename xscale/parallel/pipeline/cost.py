"""A cost model of pipeline stages, and the split of the blocks that balances it (``parallel.pp_split`` unset).

A stage's step is as slow as its slowest stage (Narayanan et al. 2021, sec. 2.2): an even count of blocks leaves the
first ranks idle while the last one runs the output projection and the loss as well. The cost of a stage, in
training FLOPs per token of the step:

* each block: 3x its forward FLOPs (backward is twice the forward; Kaplan et al. 2020): 2 per parameter a token
  uses (a MoE layer's experts per token, not all) plus 4*T*d for attention scores and values (and as much again for
  a decoder block's cross-attention);
* the last stage: the final norm, the head transform, the output projection (2*d*V) and the softmax cross-entropy
  (``LOSS_FLOPS_PER_LOGIT`` per logit);
* every parameter a stage holds costs its optimizer update and gradient, memory-bound: ``BYTES_PER_PARAMETER``
  (fp32 weight, gradient and two AdamW moments) at ``FLOPS_PER_BYTE`` each, spread over the step's tokens. This is
  how the first stage pays for its embedding table, which costs almost no FLOPs.

``xscale bench parallel`` measures each rank's idle share (bubble) as the check of the model.
"""

from __future__ import annotations

from dataclasses import dataclass

from xscale.config.schema import Config
from xscale.models import build_model
from xscale.models.parameters import experts_per_token
from xscale.parallel.pipeline.stages import pipeline_layers, split_layers
from xscale.parallel.pipeline.vocabulary import vocabulary_stage_count

LOSS_FLOPS_PER_LOGIT = 10.0  # max, subtract, exp, sum, log and their backward
BYTES_PER_PARAMETER = 16.0
FLOPS_PER_BYTE = 10.0


@dataclass
class PipelineCosts:
    """Training FLOPs per token of each block (pipeline order: encoder, then decoder), and of what the first and
    last stage add (embedding; final norm, head and loss). ``transform``: the part of ``head`` before the output
    projection (final norms, head transform), which stays on the last block stage under vocabulary parallelism."""

    blocks: list[float]
    embedding: float
    head: float
    transform: float = 0.0

    def vocabulary_stage(self, stages: int) -> float:
        """The cost of one of ``stages`` vocabulary stages: its share of the projection, the loss and the
        projection's update (:mod:`~xscale.parallel.pipeline.vocabulary`)."""
        return (self.head - self.transform) / stages

    def block_stages(self) -> PipelineCosts:
        """The costs the block stages see under vocabulary parallelism: the head is the transform alone."""
        return PipelineCosts(self.blocks, self.embedding, self.transform, self.transform)

    def stage_costs(self, layers: list[list[int]], vocabulary_stages: int = 0) -> list[float]:
        """The cost of each stage holding ``layers[stage]`` blocks; the last ``vocabulary_stages`` stages hold a
        vocabulary shard each instead."""
        costs = [sum(self.blocks[index] for index in held) for held in layers]
        costs[0] += self.embedding
        if vocabulary_stages:
            costs[-vocabulary_stages - 1] += self.transform
            for stage in range(len(costs) - vocabulary_stages, len(costs)):
                costs[stage] += self.vocabulary_stage(vocabulary_stages)
        else:
            costs[-1] += self.head
        return costs


def _block_parameters(config: Config) -> tuple[list[tuple[float, int]], int]:
    """(parameters a token uses, parameters held) of each block by pipeline index (a shared block counts at each
    depth), and the parameters outside the blocks and the embedding table (final norms, head transform)."""
    model_config = config.model
    model = build_model(model_config, materialize=False)
    moe = model_config.moe
    expert_share = experts_per_token(moe) / moe.num_experts if moe.num_experts else 1.0
    used: dict[int, float] = {}
    held: dict[int, int] = {}
    outside = 0
    for name, param in model.named_parameters():
        parts = name.split(".")
        if len(parts) > 2 and parts[0] in ("stack", "decoder") and parts[1] == "layers":
            index = int(parts[2]) + (model_config.n_layers if parts[0] == "decoder" else 0)
            used[index] = used.get(index, 0.0) + param.numel() * (expert_share if ".experts." in name else 1.0)
            held[index] = held.get(index, 0) + param.numel()
        elif name != "embedding.weight" and not name.startswith("output.") and ".position." not in name:
            outside += param.numel()  # final norms, head transform (position tables are lookups, held at stage 0)
    blocks = []
    for index in range(pipeline_layers(model_config)):  # share_layers: one block, run at every depth
        source = index if index in used else (0 if index < model_config.n_layers else model_config.n_layers)
        blocks.append((used.get(source, 0.0), held.get(source, 0)))
    return blocks, outside


def pipeline_costs(config: Config) -> PipelineCosts:
    """The cost model of ``config``'s blocks, embedding and output side (module docstring)."""
    model = config.model
    seq, d, vocab = config.train.seq_len, model.d_model, model.vocab_size
    tokens_per_step = config.train.global_batch_size * seq
    parameter_cost = BYTES_PER_PARAMETER * FLOPS_PER_BYTE / tokens_per_step
    block_params, outside = _block_parameters(config)
    blocks = []
    for index, (used, held) in enumerate(block_params):
        attention = 4.0 * seq * d * (2 if index >= model.n_layers else 1)  # decoder blocks: + cross-attention
        blocks.append(3.0 * (2.0 * used + attention) + parameter_cost * held)
    table = vocab * d
    head_forward = 2.0 * (outside + table) + LOSS_FLOPS_PER_LOGIT * vocab
    head = 3.0 * head_forward + parameter_cost * (outside + table)  # the output projection or the tied copy
    transform = 3.0 * 2.0 * outside + parameter_cost * outside
    return PipelineCosts(blocks, parameter_cost * table, head, transform)


def balanced_split(costs: PipelineCosts, num_stages: int) -> list[int]:
    """Blocks per stage (contiguous, at least one each) minimizing the largest stage cost (of equal maxima, the first
    found). Dynamic programming over (blocks placed, stages used)."""
    blocks = costs.blocks
    n = len(blocks)
    prefix = [0.0]
    for cost in blocks:
        prefix.append(prefix[-1] + cost)

    def stage_cost(first: int, end: int, stage: int) -> float:
        extra = (costs.embedding if stage == 0 else 0.0) + (costs.head if stage == num_stages - 1 else 0.0)
        return prefix[end] - prefix[first] + extra

    # best[s][i]: the smallest largest cost of the first s stages holding blocks 0..i-1; cut[s][i]: the last cut.
    infinity = float("inf")
    best = [[infinity] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for stage in range(1, num_stages + 1):
        for end in range(stage, n - (num_stages - stage) + 1):
            for first in range(end - 1, stage - 2, -1):
                value = max(best[stage - 1][first], stage_cost(first, end, stage - 1))
                if value < best[stage][end] - 1e-9 * abs(value):
                    best[stage][end], cut[stage][end] = value, first
    sizes, end = [], n
    for stage in range(num_stages, 0, -1):
        first = cut[stage][end]
        sizes.append(end - first)
        end = first
    return sizes[::-1]


def stage_layers(config: Config, num_stages: int) -> list[list[int]]:
    """The block indices of each stage: ``parallel.pp_split`` when given, else the cost-balanced split. Under
    vocabulary parallelism the last pp stages hold no blocks (``pp_split`` counts the block stages)."""
    count, pp_split = pipeline_layers(config.model), config.parallel.pp_split
    vocabulary = vocabulary_stage_count(config.parallel)
    block_stages = num_stages - vocabulary
    if pp_split is None and count >= block_stages:
        costs = pipeline_costs(config)
        pp_split = balanced_split(costs.block_stages() if vocabulary else costs, block_stages)
    return split_layers(count, block_stages, pp_split) + [[] for _ in range(vocabulary)]
