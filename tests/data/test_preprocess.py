"""Parallel tokenization into .bin/.idx: any number of workers writes the same bytes, in input order."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.data.conftest import lines, write_jsonl
from xscale.data.indexed import IndexedTokens
from xscale.data.load_tokenizer import load_tokenizer
from xscale.data.preprocess import CHUNK_DOCUMENTS, tokenize_to_indexed


def _files(prefix) -> bytes:
    return prefix.with_suffix(".bin").read_bytes() + prefix.with_suffix(".idx").read_bytes()


def test_one_worker_writes_the_documents_in_order_with_eos(tmp_path, hf_tokenizer):
    texts = lines(20)
    counts = tokenize_to_indexed(texts, hf_tokenizer, tmp_path / "one")
    tokenizer = load_tokenizer(hf_tokenizer)
    stream = IndexedTokens(tmp_path / "one")
    expected = [token for text in texts for token in tokenizer.encode(text) + [tokenizer.eos_id]]
    assert stream.read(0, len(stream)).tolist() == expected
    assert counts == {"documents": 20, "tokens": len(expected)}
    assert not list(tmp_path.glob("*.tmp-*"))


@pytest.mark.slow  # starts worker processes
def test_two_workers_write_byte_identical_files(tmp_path, hf_tokenizer):
    # The first chunk of documents is long and slow, the others short: an unordered pool would finish them first.
    texts = [" ".join(lines(800, shift=i)) for i in range(CHUNK_DOCUMENTS)] + lines(300) + lines(300, shift=3)
    tokenize_to_indexed(texts, hf_tokenizer, tmp_path / "one", workers=1)
    tokenize_to_indexed(texts, hf_tokenizer, tmp_path / "two", workers=2, progress_total=1)
    assert _files(tmp_path / "one") == _files(tmp_path / "two")


@pytest.mark.slow  # the CLI in a subprocess, with worker processes
def test_the_cli_reads_a_jsonl_field_with_workers(tmp_path, hf_tokenizer):
    write_jsonl(tmp_path / "docs.jsonl", lines(200), field="content")
    outputs = []
    for workers in ("1", "2"):
        done = subprocess.run([sys.executable, "-m", "xscale", "data", "preprocess", "--input",
                               str(tmp_path / "docs.jsonl"), "--tokenizer", str(hf_tokenizer), "--output",
                               str(tmp_path / f"w{workers}"), "--workers", workers, "--text-field", "content"],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        assert "200 documents" in done.stdout
        outputs.append(_files(tmp_path / f"w{workers}"))
    assert outputs[0] == outputs[1]
