"""``xscale data tokenizer`` and ``xscale data preprocess`` run as a user runs them, from a subprocess."""

from __future__ import annotations

import subprocess
import sys

from xscale.data.indexed import IndexedTokens


def _xscale(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "xscale", *args], capture_output=True, text=True, timeout=300)


def test_tokenizer_then_preprocess_write_a_model_and_indexed_tokens(tmp_path):
    corpus = tmp_path / "corpus.txt"
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "theta", "kappa", "lambda", "sigma"]
    corpus.write_text("\n".join(" ".join(words[(i + j) % 10] for j in range(12)) for i in range(200)) + "\n")
    made = _xscale("data", "tokenizer", "--input", str(corpus), "--vocab-size", "280", "--sentinels", "0", "--output", str(tmp_path / "sp"))
    assert made.returncode == 0, made.stderr
    assert (tmp_path / "sp.model").is_file()
    done = _xscale("data", "preprocess", "--input", str(corpus), "--tokenizer", str(tmp_path / "sp.model"),
                   "--output", str(tmp_path / "tokens"))
    assert done.returncode == 0, done.stderr
    tokens = IndexedTokens(str(tmp_path / "tokens"))
    assert len(tokens) > 2000 and 0 <= tokens.max_token() < 280  # 200 lines of 12 words, every id in the vocab


def test_an_unknown_data_tool_exits_2_naming_the_tools():
    result = _xscale("data", "tokenise")
    assert result.returncode == 2
    assert "unknown tool 'tokenise'" in result.stderr and "preprocess" in result.stderr
