"""The weighted blend: realised shares track the weights, sample i is fixed (any seed replay, any data-parallel
layout), and the per-source token counts are logged and survive a checkpoint resume."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.data.conftest import lines
from xscale.config.load import load_config
from xscale.data import GlobalSampler, build_datasets
from xscale.data.blend import BlendedDataset, SourceTokenCounter, blending_indices
from xscale.train.trainer import Trainer

TINY = ["model.vocab_size=96", "model.d_model=16", "model.n_layers=1", "model.n_heads=2",
        "train.global_batch_size=4", "train.seq_len=8", "train.warmup_steps=1", "train.log_every=100",
        "train.tensorboard=false", "train.plot=false", "train.progress=false", "train.peak_flops=1e12",
        "data.dataset=text"]


class Labelled(torch.utils.data.Dataset):
    """Sample j of source s is the tensor [s, j]."""

    def __init__(self, source: int, size: int) -> None:
        self.source, self.size = source, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.tensor([self.source, index])}


@pytest.mark.parametrize("weights", [[0.7, 0.3], [1.0, 2.0, 5.0], [0.05, 0.95]])
def test_each_source_share_tracks_its_weight(weights):
    sources, _ = blending_indices(weights, 10_000)
    shares = np.bincount(sources, minlength=len(weights)) / len(sources)
    target = np.asarray(weights) / sum(weights)
    assert np.abs(shares - target).max() < 1e-3
    for prefix in (10, 100, 1000):  # every prefix already tracks the weights, not only the whole blend
        assert np.abs(np.bincount(sources[:prefix], minlength=len(weights)) / prefix - target).max() <= 1.5 / prefix


def test_sample_i_is_a_pure_function_of_i_and_wraps_short_sources():
    def blend():
        return BlendedDataset([Labelled(0, 5), Labelled(1, 1000)], [3.0, 1.0], ["small", "big"], 400)

    first, second = blend(), blend()
    samples = [first[i]["input_ids"].tolist() for i in range(len(first))]
    assert samples == [second[i]["input_ids"].tolist() for i in range(len(second))]
    small = [index for source, index in samples if source == 0]
    assert len(small) == 300 and set(small) == set(range(5))  # a 5-sample source upsampled to its 75 %
    assert sorted(index for source, index in samples if source == 1) == list(range(100))


def test_a_global_batch_reads_the_same_samples_under_any_data_parallel_layout():
    blend = BlendedDataset([Labelled(0, 50), Labelled(1, 50)], [1.0, 1.0], ["a", "b"], 100)
    sampler = GlobalSampler(len(blend), global_batch_size=8, seed=3)
    for step in range(5):
        batch = sampler.batch_indices(step)
        for dp in (1, 2, 4):
            pieces = [GlobalSampler.shard(batch, rank, dp) for rank in range(dp)]
            assert sorted(i for piece in pieces for i in piece) == sorted(batch)
        assert GlobalSampler(len(blend), 8, seed=3).batch_indices(step) == batch  # same seed, same samples
    assert GlobalSampler(len(blend), 8, seed=4).batch_indices(0) != sampler.batch_indices(0)


def test_token_counter_adds_a_global_batch_per_source_and_reloads():
    counter = SourceTokenCounter(["web", "code"], tokens_per_sample=8)
    counter.count(np.array([0, 1, 1, 0, 1]))
    assert counter.scalars() == {"data/tokens/web": 16.0, "data/tokens/code": 24.0}
    again = SourceTokenCounter(["web", "code", "new"], tokens_per_sample=8)
    again.load_state_dict(counter.state_dict())
    assert again.tokens == {"web": 16, "code": 24, "new": 0}


def _sources_config(tmp_path, hf_tokenizer, *extra):
    (tmp_path / "web.txt").write_text("\n".join(lines(40)))
    (tmp_path / "code.txt").write_text("\n".join(lines(40, shift=2)))
    return load_config(None, [*TINY, f"train.output_dir={tmp_path / 'run'}", f"data.tokenizer={hf_tokenizer}",
                              f"data.sources=[{{path: {tmp_path / 'web.txt'}, weight: 3}}, "
                              f"{{path: {tmp_path / 'code.txt'}, weight: 1}}]", *extra])


def test_blended_sources_build_from_a_config(tmp_path, hf_tokenizer):
    train, evaluation, vocab = build_datasets(_sources_config(tmp_path, hf_tokenizer))
    assert train.source_names == ["web", "code"] and evaluation.source_names == ["web", "code"]
    assert vocab <= 96 and len(list((tmp_path / "run" / "data_cache").glob("*.idx"))) == 2
    shares = np.bincount(train.source_index) / len(train)
    assert abs(shares[0] - 0.75) < 0.01


def test_tokens_per_source_are_logged_and_survive_a_resume(tmp_path, hf_tokenizer):
    Trainer(_sources_config(tmp_path, hf_tokenizer, "train.steps=3")).fit()
    resumed = Trainer(_sources_config(tmp_path, hf_tokenizer, "train.steps=5"))
    resumed.fit()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    sampler = GlobalSampler(len(resumed.train_dataset), 4, seed=resumed.config.train.seed)
    sources = resumed.train_dataset.sources_of([i for step in range(5) for i in sampler.batch_indices(step)])
    expected = {"web": int((sources == 0).sum()) * 8, "code": int((sources == 1).sum()) * 8}
    assert records[-1]["step"] == 5 and sum(expected.values()) == 5 * 4 * 8  # 5 steps of 4 samples of 8 tokens
    assert {name: records[-1][f"data/tokens/{name}"] for name in expected} == expected
    meta = json.loads((tmp_path / "run" / "checkpoints" / "step_00000005" / "meta.json").read_text())
    assert meta["data_tokens"] == expected
