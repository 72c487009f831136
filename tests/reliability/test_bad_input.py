"""Bad input through the real CLI: one line naming the key or file and what to do, exit code 2, never a traceback.

Most cases call the CLI's ``main`` in-process (the same code path, without the interpreter start-up); a few run
``python -m xscale`` to prove the exit code and a clean stderr end to end.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from xscale.cli import main
from xscale.commands import submit
from xscale.data.indexed import write_indexed
from xscale.data.sentencepiece_tokenizer import SentencePieceTokenizer

TINY = ["model.vocab_size=512", "model.d_model=32", "model.n_layers=1", "model.n_heads=4", "train.steps=2",
        "train.global_batch_size=2", "train.seq_len=16", "train.tensorboard=false", "train.plot=false",
        "train.progress=false", "train.peak_flops=1e12", "data.tokenizer_vocab_size=400"]
ROOT = Path(__file__).resolve().parents[2]
# The subprocesses import this checkout's xscale, wherever they run.
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "kernels"), os.environ.get("PYTHONPATH", "")])}
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """A tokenizer, a valid .bin/.idx pair made with it, and bad files of every kind."""
    root = tmp_path_factory.mktemp("inputs")
    lines = [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(12)) for i in range(200)]
    tokenizer = SentencePieceTokenizer.train(lines, 400)
    model = tokenizer.save(root / "tok.model")
    prefix = write_indexed(root / "tokens", ([tokenizer.eos_id, *tokenizer.encode(line)] for line in lines),
                           tokenizer.vocab_size)
    (root / "ids.txt").write_bytes(bytes(range(1, 100)) * 40 + b"\0\1")  # valid UTF-8, but binary
    (root / "empty.txt").write_text("")
    (root / "blank").mkdir()
    (root / "blank" / "a.txt").write_text("  \n\n")
    (root / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE", "vocab": {}}}')
    (root / "random.model").write_bytes(os.urandom(3000))
    return {"root": root, "tokenizer": model, "prefix": Path(prefix)}


def corrupt_pair(files: dict[str, Path], name: str, change) -> Path:
    """A copy of the valid pair as ``name``.bin/.idx, passed through ``change(bin_path, idx_path)``."""
    prefix = files["root"] / name
    for suffix in (".bin", ".idx"):
        Path(f"{prefix}{suffix}").write_bytes(Path(f"{files['prefix']}{suffix}").read_bytes())
    change(Path(f"{prefix}.bin"), Path(f"{prefix}.idx"))
    return prefix


def truncate(path: Path, keep: int) -> None:
    path.write_bytes(path.read_bytes()[:keep])


def train_error(capsys, tmp_path, *overrides: str) -> str:
    """Run ``xscale train`` in-process; it must exit 2 with exactly one stderr line, which is returned."""
    code = main(["train", *TINY, f"train.output_dir={tmp_path / 'run'}", *overrides])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    return lines[0]


CASES = {
    "missing text file": (lambda f: ["data.dataset=text", f"data.path={f['root']}/missing.txt"],
                          ["data.path", "missing.txt does not exist"]),
    "token file as text": (lambda f: ["data.dataset=text", f"data.path={f['prefix']}.bin"],
                           ["data.path", "tokens.bin is not UTF-8 text", "data.dataset=indexed"]),
    "NUL bytes as text": (lambda f: ["data.dataset=text", f"data.path={f['root']}/ids.txt"],
                          ["data.path", "ids.txt is not UTF-8 text (a NUL byte at offset 3960)"]),
    "empty corpus": (lambda f: ["data.dataset=text", f"data.path={f['root']}/empty.txt"],
                     ["data.path=", "empty.txt holds no text"]),
    "blank folder": (lambda f: ["data.dataset=text", f"data.path={f['root']}/blank"],
                     ["data.path=", "blank holds no text"]),
    "missing tokenizer": (lambda f: [f"data.tokenizer={f['root']}/nope.model"],
                          ["data.tokenizer", "nope.model does not exist", "xscale data tokenizer"]),
    "tokenizer.json": (lambda f: [f"data.tokenizer={f['root']}/tokenizer.json"],
                       ["data.tokenizer", "tokenizer.json is not a Hugging Face tokenizer.json"]),
    "random tokenizer": (lambda f: [f"data.tokenizer={f['root']}/random.model"],
                         ["data.tokenizer", "random.model is not a SentencePiece .model file"]),
    "missing token files": (lambda f: ["data.dataset=indexed", f"data.path={f['root']}/nothing"],
                            ["data.path", "nothing.idx does not exist", "xscale data preprocess"]),
    "truncated idx": (lambda f: ["data.dataset=indexed", "data.path=" + str(corrupt_pair(
                          f, "short_idx", lambda b, i: truncate(i, i.stat().st_size - 9)))],
                      ["data.path", "short_idx.idx is truncated or corrupt"]),
    "short header": (lambda f: ["data.dataset=indexed", "data.path=" + str(corrupt_pair(
                         f, "header", lambda b, i: truncate(i, 5)))],
                     ["data.path", "header.idx is not a Megatron index"]),
    "bin shorter than idx": (lambda f: ["data.dataset=indexed", "data.path=" + str(corrupt_pair(
                                 f, "short_bin", lambda b, i: truncate(b, b.stat().st_size - 2)))],
                             ["data.path", "short_bin.bin holds", "truncated or mismatched"]),
    "random bin, tokenizer": (lambda f: ["data.dataset=indexed", f"data.tokenizer={f['tokenizer']}",
                                         "data.path=" + str(corrupt_pair(
                                             f, "noise", lambda b, i: b.write_bytes(os.urandom(b.stat().st_size))))],
                              ["data.path", "noise.bin holds token id", "outside the tokenizer's"]),
    "random bin, no tokenizer": (lambda f: ["data.dataset=indexed", "data.path=" + str(corrupt_pair(
                                     f, "noise2", lambda b, i: b.write_bytes(os.urandom(b.stat().st_size))))],
                                 ["model.vocab_size=512 is smaller than the vocabulary of the data"]),
    "missing source": (lambda f: ["data.dataset=text", f"data.tokenizer={f['tokenizer']}",
                                  f"data.sources=[{{path: {f['prefix']}}}, {{path: {f['root']}/nope.txt}}]"],
                       ["data.sources[1].path=", "nope.txt does not exist"]),
    "zero source weight": (lambda f: ["data.dataset=text", f"data.sources=[{{path: {f['prefix']}, weight: 0}}]"],
                           ["data.sources[0].weight must be a positive number, got 0"]),
    "unknown source kind": (lambda f: ["data.dataset=text", f"data.sources=[{{path: {f['prefix']}, kind: csv}}]"],
                            ["data.sources[0].kind='csv' is not one of auto, text, jsonl, indexed"]),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_data_is_one_line_naming_the_key(case, files, capsys, tmp_path):
    overrides, expected = CASES[case]
    line = train_error(capsys, tmp_path, *overrides(files))
    assert line.startswith("xscale train: ")
    for text in expected:
        assert text in line, line


def test_the_valid_files_train(files, capsys, tmp_path):
    """The control: the same pair and tokenizer are accepted (so each refusal above is about the damage)."""
    assert main(["train", *TINY, f"train.output_dir={tmp_path}", "data.dataset=indexed",
                 f"data.path={files['prefix']}", f"data.tokenizer={files['tokenizer']}"]) == 0


@pytest.mark.parametrize("case", ["missing text file", "tokenizer.json", "truncated idx", "zero source weight"])
def test_the_command_exits_2_without_a_traceback(case, files, tmp_path):
    overrides, expected = CASES[case]
    result = subprocess.run([sys.executable, "-m", "xscale", "train", *TINY, f"train.output_dir={tmp_path}",
                             *overrides(files)], capture_output=True, text=True, timeout=300, env=ENV)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and expected[0] in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_a_job_name_cannot_write_outside_the_log_directory(tmp_path, monkeypatch, capsys):
    config = tmp_path / "work" / "c.yaml"
    config.parent.mkdir()
    config.write_text("model:\n  d_model: 32\n  n_layers: 1\n  n_heads: 2\n  vocab_size: 64\n")
    monkeypatch.chdir(config.parent)
    before = sorted(tmp_path.rglob("*"))
    for name in ("../../../x", "a/b", ".hidden", "x y"):
        code = submit.main([str(config), "--job-name", name, "--partition", "cpu"], partitions=lambda: (["cpu"], "cpu"),
                           run=lambda *a, **k: pytest.fail("sbatch must not run"))
        err = capsys.readouterr().err
        assert code == 2 and "--job-name / launch.job_name" in err and "not a plain name" in err, err
    assert sorted(tmp_path.rglob("*")) == before, "a refused job wrote files"
    result = subprocess.run([sys.executable, "-m", "xscale", "submit", str(config), "launch.job_name=../../x",
                             "--dry-run"], capture_output=True, text=True, timeout=300, cwd=config.parent,
                            env=ENV)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "'../../x' is not a plain name" in result.stderr
