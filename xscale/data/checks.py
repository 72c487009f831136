"""The data layer's checks of a config, registered with :mod:`xscale.config.check` when :mod:`xscale.data` is
imported: the objective and its options, padding under classification, and span corruption's lengths under context
parallelism."""

from __future__ import annotations

from xscale.config.check import closest, register_check
from xscale.config.schema import Config, ConfigError, resolve_objective
from xscale.data.lra import PAD_AS_CONTENT
from xscale.data.objectives import OBJECTIVES, objective_options, span_corruption_lengths
from xscale.data.objectives.checks import check_bart_config, check_bert_objectives
from xscale.data.sources import SOURCES
from xscale.models.registry import REGISTRIES


def check_dataset(config: Config) -> None:
    """data.dataset names a registered source (:mod:`xscale.data.sources`) that serves the task: labelled examples
    for train.task=classify, and only those; data.sources (blended corpora) only for a text dataset."""
    dataset = config.data.dataset.kind
    if dataset not in SOURCES:
        raise ConfigError(f"data.dataset='{dataset}' is not one of {', '.join(SOURCES.names())}"
                          f"{closest(dataset, SOURCES.names())}")
    source = SOURCES.get(dataset)
    labelled = [name for name in SOURCES.names() if SOURCES.get(name).labelled]
    if config.train.task == "classify" and not source.labelled:
        raise ConfigError(f"train.task=classify reads labelled examples: set data.dataset=labeled and data.path to a "
                          f".jsonl or .tsv file, or data.dataset={'|'.join(n for n in labelled if n != 'labeled')} "
                          f"(got data.dataset={dataset})")
    if config.train.task != "classify" and source.labelled:
        raise ConfigError(f"data.dataset={dataset} holds labelled examples for train.task=classify; "
                          "set train.task=classify (or pick a text dataset)")
    if config.data.sources and not source.text:
        raise ConfigError(f"data.sources holds text corpora but data.dataset='{dataset}' is not a text dataset; set "
                          "data.dataset=text (or leave data.sources out)")


def check_objective(config: Config) -> None:
    """train.objective names a registered objective (naming the closest and every one) that trains model.family,
    with options its ``Options`` dataclass reads (``auto``: those of the family's kind), and options only where
    windows of text are masked (the synthetic tasks lay their examples out without them); an option its
    ``options_elsewhere`` places in another component is refused with the key to set."""
    kind, objective = config.train.objective.kind, resolve_objective(config)
    if kind not in OBJECTIVES:
        raise ConfigError(f"train.objective='{kind}' is not a known objective{closest(kind, OBJECTIVES.names())}; "
                          f"available: {', '.join(OBJECTIVES.names())}")
    family = OBJECTIVES.get(objective).family
    if config.model.family != family:
        raise ConfigError(f"train.objective={objective} needs model.family={family}, got {config.model.family}; "
                          "set train.objective=auto to pick the family's objective")
    for option in config.train.objective.options:
        if option in OBJECTIVES.get(objective).options_elsewhere:
            raise ConfigError(f"train.objective.options.{option} is not an option of train.objective={objective}; "
                              f"set {OBJECTIVES.get(objective).options_elsewhere[option]}")
    objective_options(config)
    source = config.data.dataset.kind
    if config.train.objective.options and source in SOURCES and not SOURCES.get(source).text:
        raise ConfigError(f"train.objective.options apply to windows of text, but data.dataset={source} lays its "
                          f"examples out without them; remove train.objective.options")


def check_padding_masks(config: Config) -> None:
    """train.task=classify pads variable-length examples: every attention kind must take a key-padding mask
    (unless a generated task reads its pads as content: ``data.dataset.options.pad_as_content``)."""
    if config.train.task != "classify":
        return
    if config.data.dataset.kind.startswith("lra_") and config.data.dataset.options.get(PAD_AS_CONTENT) is True:
        return
    attention = REGISTRIES["attention"]
    able = [name for name in attention.names() if attention.get(name).takes_padding_mask]
    for kind in dict.fromkeys(config.model.attention.per_layer or [config.model.attention.kind]):
        if kind in attention and not attention.get(kind).takes_padding_mask:
            raise ConfigError(f"attention '{kind}' takes no key-padding mask, so it would attend to the padding of "
                              f"train.task=classify's variable-length examples; use one that does: {', '.join(able)} (or, for "
                              f"the generated lra_* tasks, data.dataset.options.{PAD_AS_CONTENT}=true)")


def check_context_parallel_lengths(config: Config) -> None:
    """Context parallelism cuts each stack's sequences into cp (2cp) chunks: span corruption of text windows gives
    an encoder-decoder shorter encoder inputs and decoder targets than train.seq_len, and both must split."""
    parallel = config.parallel
    if parallel.cp <= 1 or config.model.family != "encoder_decoder" or not SOURCES.get(config.data.dataset.kind).text \
            or resolve_objective(config) != "span":
        return
    chunks = 2 * parallel.cp if parallel.cp_load_balance else parallel.cp
    options = objective_options(config)
    density, mean_span = options.noise_density, options.mean_span_length

    def split(seq_len: int) -> bool:
        lengths = (seq_len, *span_corruption_lengths(seq_len, density, mean_span))
        return all(length % chunks == 0 for length in lengths)

    if split(config.train.seq_len):
        return
    encoder, decoder = span_corruption_lengths(config.train.seq_len, density, mean_span)
    nearby = [n for n in range(max(chunks, config.train.seq_len - 32 * chunks), config.train.seq_len + 32 * chunks)
              if split(n)]
    nearest = sorted(nearby, key=lambda n: (n > config.model.max_seq_len, abs(n - config.train.seq_len), n))[:3]
    hint = f"use train.seq_len={' or '.join(map(str, nearest))}" if nearest else "change train.objective.options.noise_density"
    raise ConfigError(f"parallel.cp={parallel.cp} cuts every sequence into {chunks} chunks, but span corruption of "
                      f"train.seq_len={config.train.seq_len} windows gives {encoder} encoder and {decoder} decoder "
                      f"tokens: {hint}")


register_check("xscale.data", check_dataset)
register_check("xscale.data", check_objective)
register_check("xscale.data", check_padding_masks)
register_check("xscale.data", check_bart_config)
register_check("xscale.data", check_bert_objectives)
register_check("xscale.data", check_context_parallel_lengths)
