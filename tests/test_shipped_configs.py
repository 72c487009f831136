"""Every shipped config loads, and the real-size ones have their published parameter counts."""

from pathlib import Path

import pytest

from xscale.config.load import load_config
from xscale.models.parameters import count_parameters

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))

# Published counts of the reference implementations (HF GPT2LMHeadModel, BertForMaskedLM without its two
# token-type rows, which xscale folds into the position table, T5Model/T5ForConditionalGeneration, TinyLlama).
PUBLISHED = {
    "gpt2-small.yaml": 124_439_808,
    "bert-base.yaml": 109_514_298 - 2 * 768,
    "t5-base.yaml": 222_903_552,
    "tinyllama-1.1b.yaml": 1_100_048_384,
}


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_config_loads(path):
    config = load_config(path)
    assert count_parameters(config).total > 0


@pytest.mark.parametrize("name,expected", list(PUBLISHED.items()))
def test_published_parameter_counts(name, expected):
    config = load_config(Path(__file__).parent.parent / "configs" / name)
    assert count_parameters(config).total == expected
