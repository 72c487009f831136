"""The KV cache: a prefix fed in pieces through the cache gives the logits of one forward over the whole prefix."""

import pytest
import torch

from xscale.config.load import from_dict
from xscale.config.schema import ModelConfig
from xscale.models import build_model
from xscale.models.kv_cache import KVCache, cached_forward, can_cache
from xscale.models.registry import ATTENTION


def _model(**fields):
    config = from_dict(ModelConfig, {"family": "decoder", "vocab_size": 61, "d_model": 32, "n_layers": 2,
                                     "n_heads": 4, "max_seq_len": 32, **fields})
    return build_model(config, "cpu", seed=3).eval()


@pytest.mark.parametrize("fields", [
    {"position": "rope", "n_kv_heads": 2},
    {"position": "learned"},
    {"position": "alibi", "n_kv_heads": 1},
    {"position": "sinusoidal"},
    {"position": "t5_bias"},
    {"position": "shaw", "n_kv_heads": 2},
    {"position": "xl", "n_kv_heads": 1},
    {"position": "rope", "share_layers": True},
    {"position": "rope", "share_layers": True, "stack": "act"},
    {"position": "rope", "stack": "reversible"},
], ids=["rope-gqa", "learned", "alibi-mqa", "sinusoidal", "t5_bias", "shaw-gqa", "xl-mqa", "rope-shared-layers", "act",
        "reversible"])
def test_pieces_through_the_cache_equal_one_forward(fields):
    model = _model(**fields)
    tokens = torch.randint(0, 61, (2, 13), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        whole = model(tokens)
        cache = KVCache()
        pieces = [cached_forward(model, tokens[:, start:stop], cache)
                  for start, stop in ((0, 5), (5, 6), (6, 10), (10, 13))]
    assert cache.length == 13
    torch.testing.assert_close(torch.cat(pieces, dim=1), whole, atol=1e-5, rtol=1e-5)


def test_extend_keeps_the_prefix_and_grows():
    cache = KVCache(capacity=2)
    k1, v1 = torch.randn(1, 2, 2, 4), torch.randn(1, 2, 2, 4)
    keys, values = cache.extend("layer", k1, v1)
    assert torch.equal(keys, k1) and torch.equal(values, v1)
    cache.advance(2)
    assert cache.global_size(3) == 5 and cache.coordinates(3, torch.device("cpu")).tolist() == [2, 3, 4]
    k2, v2 = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)
    keys, values = cache.extend("layer", k2, v2)  # past the capacity: the buffer grows, the prefix stays
    assert torch.equal(keys, torch.cat([k1, k2], dim=2)) and torch.equal(values, torch.cat([v1, v2], dim=2))


def test_a_layer_written_twice_in_one_forward_is_refused():
    cache = KVCache()
    cache.extend("layer", torch.randn(1, 1, 2, 4), torch.randn(1, 1, 2, 4))
    with pytest.raises(ValueError, match="once per forward"):
        cache.extend("layer", torch.randn(1, 1, 1, 4), torch.randn(1, 1, 1, 4))


def test_only_cores_exact_over_a_gathered_prefix_can_cache():
    assert can_cache(ATTENTION.get("dense")) and can_cache(ATTENTION.get("gqa"))
    for kind in ("local", "linear", "performer", "realformer", "lsh"):
        assert not can_cache(ATTENTION.get(kind)), kind
    model = _model(attention={"kind": "local", "options": {"window": 4, "block_size": 4}})
    with pytest.raises(ValueError, match="cannot decode from a KV cache"):
        cached_forward(model, torch.zeros(1, 3, dtype=torch.long), KVCache())
