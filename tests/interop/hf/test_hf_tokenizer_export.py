"""An export HF tools use as it is: ``AutoTokenizer.from_pretrained(export)`` encodes a text to xscale's ids for
each tokenizer kind (SentencePiece, a ``tokenizer.json``, GPT-2's byte-level BPE), ``config.json`` and
``generation_config.json`` name the special ids, and ``xscale convert`` carries the folder's tokenizer so
``xscale generate`` runs on the converted checkpoint."""

import json

import pytest

from tests.data.conftest import lines
from xscale.commands.convert import main as convert_main
from xscale.commands.generate import main as generate_main
from xscale.data.load_tokenizer import load_tokenizer
from xscale.data.sentencepiece_tokenizer import SentencePieceTokenizer
from xscale.interop.hf.save import export_hf

transformers = pytest.importorskip("transformers", reason="transformers is in the [hf] extra (pip install -e .[hf])")
tokenizers = pytest.importorskip("tokenizers", reason="tokenizers is in the [hf] extra (pip install -e .[hf])")


def _llama(folder, vocab_size=512):
    """A tiny Llama folder whose vocabulary holds every tokenizer's here."""
    config = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)

TEXT = "def main(argv):\n    return  42 + x_1  # gamma delta, naïve"
SPECIALS = ["<pad>", "<unk>", "<s>", "</s>", "<mask>"]


def _sentencepiece(folder):
    SentencePieceTokenizer.train(lines(200), 300, num_sentinels=0).save(folder / "tokenizer.model")
    return folder / "tokenizer.model"


def _tokenizer_json(folder, byte_level):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token=None if byte_level else "<unk>"))
    tokenizer.pre_tokenizer = (pre_tokenizers.ByteLevel(add_prefix_space=False) if byte_level
                               else pre_tokenizers.Metaspace())
    tokenizer.decoder = decoders.ByteLevel() if byte_level else decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet() if byte_level else [])
    tokenizer.train_from_iterator(lines(200) + [TEXT], trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


KINDS = {"sentencepiece": _sentencepiece, "tokenizer.json": lambda folder: _tokenizer_json(folder, False),
         "gpt2 byte-level bpe": lambda folder: _tokenizer_json(folder, True)}


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_converted_and_exported_folder_tokenizes_as_xscale_does(tmp_path, kind, capsys):
    hf = tmp_path / "hf"
    _llama(hf)
    ours = load_tokenizer(KINDS[kind](hf))
    assert convert_main(["hf-to-xscale", str(hf), str(tmp_path / "ckpt")]) == 0
    step_dir = tmp_path / "ckpt" / "step_00000000"
    assert json.loads((step_dir / "meta.json").read_text())["tokenizer"].startswith("tokenizer/tokenizer.")

    assert generate_main([str(step_dir), "--prompt", "gamma", "--max-new-tokens", "2"]) == 0  # finds the tokenizer
    capsys.readouterr()

    out = export_hf(step_dir, tmp_path / "out")
    theirs = transformers.AutoTokenizer.from_pretrained(out)
    assert theirs.encode(TEXT) == ours.encode(TEXT), kind
    config = json.loads((out / "config.json").read_text())
    generation = json.loads((out / "generation_config.json").read_text())
    for name, index in (("bos_token_id", ours.bos_id), ("eos_token_id", ours.eos_id), ("pad_token_id", ours.pad_id)):
        assert config[name] == generation[name] == index, name
    assert theirs.eos_token_id == ours.eos_id and theirs.pad_token_id == ours.pad_id
    assert json.loads((out / "special_tokens_map.json").read_text())["eos_token"] == "</s>"


def test_generate_on_a_converted_checkpoint_without_a_tokenizer_names_the_source(tmp_path, capsys):
    _llama(tmp_path / "hf")
    assert convert_main(["hf-to-xscale", str(tmp_path / "hf"), str(tmp_path / "ckpt")]) == 0
    assert "no tokenizer in" in capsys.readouterr().out
    assert generate_main([str(tmp_path / "ckpt"), "--prompt", "x", "--max-new-tokens", "1"]) == 2
    error = capsys.readouterr().err
    assert f"converted from hf:{tmp_path / 'hf'}" in error and "--tokenizer" in error
    assert "runs/default" not in error
