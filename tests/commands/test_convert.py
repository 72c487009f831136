"""``xscale convert`` and ``xscale export --format hf`` as a user runs them (subprocesses): HF folder -> xscale
checkpoint -> HF folder that ``from_pretrained`` loads with the same logits; bad input is one line and exit 2."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from xscale.commands.convert import main as convert
from xscale.commands.export import resolve_checkpoint
from xscale.interop.hf.save import export_hf

transformers = pytest.importorskip("transformers", reason="transformers is a dev dependency (pip install -e .[dev])")
sys.path.insert(0, str(Path(__file__).parents[1] / "interop" / "hf"))
from hf_models import save, tokens  # noqa: E402


def _xscale(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "xscale", *args], capture_output=True, text=True, env=os.environ,
                          timeout=120)


def test_convert_then_export_hf_from_the_command_line(tmp_path):
    hf = save("gpt2", tmp_path / "hf")
    converted = _xscale("convert", "hf-to-xscale", str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    assert converted.returncode == 0, converted.stderr
    assert (tmp_path / "ckpt" / "step_00000000" / "meta.json").is_file()
    exported = _xscale("export", str(tmp_path / "ckpt"), str(tmp_path / "out"), "--format", "hf")
    assert exported.returncode == 0, exported.stderr
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    batch = tokens()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(batch).logits, hf(batch).logits, atol=1e-5, rtol=1e-5)


def test_unsupported_input_is_one_line_and_exit_2(tmp_path, capsys):
    save("llama", tmp_path / "hf")
    # An xscale variant converts (and trains) fine ...
    assert convert(["hf-to-xscale", str(tmp_path / "hf"), str(tmp_path / "ckpt"), "model.position=alibi"]) == 0
    exported = _xscale("export", str(tmp_path / "ckpt"), str(tmp_path / "out"), "--format", "hf")
    assert exported.returncode == 2  # ... but has no HF equivalent
    assert exported.stderr.count("\n") == 1 and "model.position='alibi'" in exported.stderr, exported.stderr
    assert "Traceback" not in exported.stderr
    capsys.readouterr()
    assert convert(["hf-to-xscale", str(tmp_path / "nowhere"), str(tmp_path / "other")]) == 2
    assert "config.json is missing" in capsys.readouterr().err
    assert convert(["hf-to-xscale", str(tmp_path / "hf"), str(tmp_path / "other"), "train.steps=3"]) == 2
    assert "only model.* settings" in capsys.readouterr().err


def test_hf_export_carries_the_tokenizer_the_checkpoint_holds(trained_run, tmp_path):
    """A trained run's checkpoint holds its SentencePiece model; the HF folder gets it as tokenizer.model."""
    step_dir = resolve_checkpoint(trained_run)
    export_hf(step_dir, tmp_path / "hf")
    carried = step_dir / "tokenizer" / "text-400.model"
    assert (tmp_path / "hf" / "tokenizer.model").read_bytes() == carried.read_bytes()
