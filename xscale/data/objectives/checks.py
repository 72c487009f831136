"""The objectives' checks of a config beyond their options (registered by :mod:`xscale.data.checks`): BART and the
BERT-style objectives read windows of text, and the extra heads the latter train cannot run under every layout."""

from __future__ import annotations

from xscale.config.schema import Config, ConfigError, resolve_objective
from xscale.data.objectives.registry import OBJECTIVES

TEXT_DATASETS = ("stdlib_text", "text", "indexed")
# Why each layout cannot run an objective's extra head (model.objective_head).
HEAD_REFUSALS = {
    "pp": "the head reads the last stage's states together with the batch's boundary positions or pair labels, "
          "which pipeline stages do not carry",
    "tp": "the head is not in the tensor-parallel plan",
    "cp": "a span's boundary tokens, a pair's first token or the generator's sequence may sit on another rank's part",
}


def check_bart_config(config: Config) -> None:
    """train.objective=bart corrupts windows of text (not the synthetic tasks' examples)."""
    data = config.data
    if config.train.objective.kind != "bart" or data.dataset.kind in TEXT_DATASETS or data.sources:
        return
    raise ConfigError(f"train.objective=bart corrupts windows of text: set data.dataset=stdlib_text, text or "
                      f"indexed (or data.sources), not data.dataset={data.dataset}")


def check_bert_objectives(config: Config) -> None:
    """train.objective=spanbert, nsp, sop or electra (a registered kind: :func:`xscale.data.checks.check_objective`
    runs first): windows of text, the matching model.objective_head, and the layouts the heads cannot run under
    refused by name."""
    objective, head = resolve_objective(config), config.model.objective_head.kind
    wanted = OBJECTIVES.get(objective).head
    if head != wanted:
        trainers = [name for name in OBJECTIVES.names() if OBJECTIVES.get(name).head == head]
        fix = f"set model.objective_head={wanted}" if wanted != "none" else \
            f"set train.objective to {' or '.join(trainers)}"
        raise ConfigError(f"train.objective={objective} trains model.objective_head={wanted}, not {head}; {fix}")
    if wanted == "none":
        return
    data = config.data
    if config.train.task != "lm":
        raise ConfigError(f"train.objective={objective} pre-trains with token losses: set train.task=lm, not "
                          f"{config.train.task}")
    if data.dataset.kind not in TEXT_DATASETS and not data.sources:
        raise ConfigError(f"train.objective={objective} masks windows of text: set data.dataset=stdlib_text, text or "
                          f"indexed (or data.sources), not data.dataset={data.dataset}")
    if objective == "nsp" and data.sources:
        raise ConfigError("train.objective=nsp draws random second segments from one corpus: set data.dataset and "
                          "data.path instead of data.sources (or use train.objective=sop)")
    if config.model.lm_head_transform:
        raise ConfigError(f"train.objective={objective}: the {wanted} head reads the encoder's final states, which "
                          "model.lm_head_transform would hand the loss transformed; set model.lm_head_transform=false")
    for dimension, reason in HEAD_REFUSALS.items():
        if getattr(config.parallel, dimension) > 1:
            raise ConfigError(f"train.objective={objective} cannot run under parallel.{dimension}="
                              f"{getattr(config.parallel, dimension)}: {reason}; use dp and ZeRO (parallel.zero_stage)")
    if objective in ("nsp", "sop") and config.train.seq_len < 5:
        raise ConfigError(f"train.objective={objective} lays out [CLS] A [SEP] B [SEP]: train.seq_len must be at least "
                          f"5, got {config.train.seq_len}")
