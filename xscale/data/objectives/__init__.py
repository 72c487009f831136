"""Pre-training objectives (``train.objective``), each a registered kind that maps a token window to a model batch,
its settings in an ``Options`` dataclass beside it: causal LM (GPT), masked LM with BERT's 80/10/10 rule (Devlin et
al. 2019, sec. 3.1), T5 span corruption (Raffel et al. 2020, sec. 3.1.4), BART denoising (Lewis et al. 2020, sec.
2.2), SpanBERT's geometric span masking (Joshi et al. 2020), the sentence pairs of BERT's next-sentence and ALBERT's
sentence-order prediction (Lan et al. 2020), and ELECTRA's masking for replaced-token detection (Clark et al. 2020).

Every module of the package is imported here, so the registry read through it is complete. Adding an objective is
one module here plus its test.
"""

from xscale.data.objectives.bart import (
    BartOptions,
    bart_denoising,
    infilling_spans,
    sentence_end_ids,
    sentence_permutation,
    text_infilling,
)
from xscale.data.objectives.causal import causal_lm
from xscale.data.objectives.electra import electra_masking
from xscale.data.objectives.masked import MaskingOptions, masked_lm
from xscale.data.objectives.registry import (
    IGNORE_INDEX,
    OBJECTIVES,
    Sample,
    TextObjective,
    TokenStream,
    build_objective,
    objective_component,
    objective_options,
)
from xscale.data.objectives.sentence_pair import sentence_pair
from xscale.data.objectives.span_corruption import (
    SpanCorruptionOptions,
    span_corruption,
    span_corruption_lengths,
)
from xscale.data.objectives.spanbert import (
    SpanBertOptions,
    geometric_span_lengths,
    geometric_span_masking,
    truncated_geometric_mean,
    word_start_table,
)

__all__ = ["IGNORE_INDEX", "OBJECTIVES", "BartOptions", "MaskingOptions", "Sample",
           "SpanBertOptions", "SpanCorruptionOptions", "TextObjective", "TokenStream", "bart_denoising",
           "build_objective", "causal_lm", "electra_masking", "geometric_span_lengths", "geometric_span_masking",
           "infilling_spans", "masked_lm", "objective_component", "objective_options",
           "sentence_end_ids", "sentence_pair", "sentence_permutation", "span_corruption", "span_corruption_lengths",
           "text_infilling", "truncated_geometric_mean", "word_start_table"]
