"""model.vocab_size=0 (the default): the tokenizer's vocabulary, padded to 128 x tp; a given one below it refused."""

from __future__ import annotations

import pytest
import torch
import yaml

from tests.data.conftest import lines
from xscale.commands.train import main as train_main
from xscale.config.load import load_config
from xscale.config.schema import ConfigError
from xscale.data import build_datasets, with_resolved_vocab
from xscale.data.load_tokenizer import load_tokenizer
from xscale.data.vocab_size import VOCAB_MULTIPLE, padded_vocab_size
from xscale.train.trainer import Trainer

SMALL = ["model.d_model=32", "model.n_layers=1", "model.n_heads=4", "train.global_batch_size=4", "train.seq_len=16",
         "train.steps=1", "train.plot=false", "train.progress=false", "train.peak_flops=1e12", "train.loggers=[]",
         "data.eval_fraction=0.0"]


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(lines(200)))
    return path


def test_padding_rounds_up_to_the_multiple():
    assert [padded_vocab_size(n, 128) for n in (0, 1, 19, 128, 129, 4000)] == [128, 128, 128, 128, 256, 4096]


def test_the_tokenizer_sets_the_vocabulary_padded_to_128_times_tp(tmp_path, corpus, hf_tokenizer, capsys):
    vocabulary = load_tokenizer(hf_tokenizer).vocab_size
    for tp in (1, 2):
        config = load_config(None, [*SMALL, "data.dataset=text", f"data.path={corpus}", f"data.tokenizer={hf_tokenizer}",
                                    f"parallel.tp={tp}", f"train.output_dir={tmp_path / str(tp)}"])
        assert config.model.vocab_size == 0
        build_datasets(config)
        assert config.model.vocab_size == padded_vocab_size(vocabulary, VOCAB_MULTIPLE * tp) == 128 * tp
        assert f"the data's {vocabulary} tokens padded to a multiple of {128 * tp}" in capsys.readouterr().out


def test_print_config_shows_the_resolved_vocabulary(tmp_path, capsys):
    """The default run trains a data.tokenizer_vocab_size-token tokenizer: --print-config says what the model gets."""
    assert train_main(["--print-config", f"train.output_dir={tmp_path}"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["model"]["vocab_size"] == padded_vocab_size(printed["data"]["tokenizer_vocab_size"], 128)


def test_a_run_takes_the_tokenizers_vocabulary(tmp_path, corpus, hf_tokenizer):
    config = load_config(None, [*SMALL, "data.dataset=text", f"data.path={corpus}", f"data.tokenizer={hf_tokenizer}",
                                f"train.output_dir={tmp_path}"])
    trainer = Trainer(config)
    assert trainer.model.model.embedding.num_embeddings == 128
    trainer.fit()
    assert trainer.config.model.vocab_size == 128  # what the checkpoint's meta.json records


def test_a_given_vocabulary_below_the_tokenizers_is_refused(tmp_path, corpus, hf_tokenizer):
    config = load_config(None, [*SMALL, "data.dataset=text", f"data.path={corpus}", f"data.tokenizer={hf_tokenizer}",
                                "model.vocab_size=16", f"train.output_dir={tmp_path}"])
    with pytest.raises(ConfigError, match=r"model.vocab_size=16 is smaller than the vocabulary of the data \(\d+ "
                                          r"tokens\); set model.vocab_size=128"):
        build_datasets(config)
    resolved = with_resolved_vocab(load_config(None, [f"data.tokenizer={hf_tokenizer}", "parallel.tp=2"]))
    assert resolved.model.vocab_size == 256  # the tokenizer's, before any data is built (inspect, plan)


def test_a_dataset_of_your_own_needs_a_vocab_size(tmp_path):
    class Tokens(torch.utils.data.Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, index):
            return {"input_ids": torch.zeros(16, dtype=torch.long), "labels": torch.zeros(16, dtype=torch.long)}

    config = load_config(None, [*SMALL, f"train.output_dir={tmp_path}"])
    with pytest.raises(ConfigError, match="with a Dataset of your own .* set model.vocab_size"):
        Trainer(config, train_dataset=Tokens())
