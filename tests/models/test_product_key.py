"""Product-key memory (Lample et al. 2019): the product search equals a brute-force top-k over all n^2 keys
(outputs and gradients), the options are checked, MoE refuses it, tp refuses it by name, and a model trains."""

from __future__ import annotations

import pytest
import torch

from tests.models.attention.conftest import assert_loss_falls
from xscale.config.schema import Component, ConfigError, ModelConfig, MoEConfig
from xscale.models.moe.layer import check_moe_config
from xscale.models.product_key import ProductKeyMemory, ProductKeyOptions
from xscale.parallel.tensor import check_tensor_parallel


def brute_force(memory: ProductKeyMemory, x: torch.Tensor) -> torch.Tensor:
    """Every head scores all n^2 keys [c_i ; c'_j] as full vectors, takes the top k, softmax, reads the values."""
    options = memory.options
    n, half = options.sub_keys, options.key_dim // 2
    queries = memory.query_norm(memory.query(x).unflatten(-1, (options.heads, options.key_dim)))
    out = torch.zeros(*x.shape[:-1], x.shape[-1], dtype=x.dtype)
    for head in range(options.heads):
        keys = torch.stack([torch.cat([memory.sub_keys[head, 0, i], memory.sub_keys[head, 1, j]])
                            for i in range(n) for j in range(n)])  # slot i n + j
        scores = queries[..., head, :] @ keys.T
        top, slots = scores.topk(options.topk, dim=-1)
        out = out + (torch.softmax(top, -1)[..., None] * memory.values.weight[slots]).sum(-2)
        assert keys.shape == (n * n, 2 * half)
    return out


@pytest.mark.parametrize("heads", [1, 3])
def test_product_search_is_the_exact_top_k(heads: int) -> None:
    torch.manual_seed(0)
    memory = ProductKeyMemory(16, 0, options=ProductKeyOptions(sub_keys=6, topk=4, heads=heads, key_dim=8)).double()
    x = torch.randn(2, 5, 16, dtype=torch.float64, requires_grad=True)
    out, ref = memory(x), brute_force(memory, x)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)
    grad = torch.randn_like(out)
    inputs = (x, *memory.parameters())
    for got, want in zip(torch.autograd.grad(out, inputs, grad), torch.autograd.grad(ref, inputs, grad)):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("options,message", [({"key_dim": 7}, "must be even"), ({"topk": 9, "sub_keys": 8}, "<= sub")])
def test_options_are_checked(options: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ProductKeyOptions(**options)


def test_moe_refuses_a_memory_as_its_experts() -> None:
    config = ModelConfig(ffn=Component("product_key"), moe=MoEConfig(num_experts=4, every=1))
    with pytest.raises(ConfigError, match="model.ffn=product_key is not an MLP"):
        check_moe_config(config)


def test_tensor_parallelism_refuses_it_by_name() -> None:
    config = ModelConfig(vocab_size=64, d_model=32, n_heads=4, ffn=Component("product_key"))
    with pytest.raises(ConfigError, match="product_key.*declares no column/row-parallel split"):
        check_tensor_parallel(config, 2)


def test_trains() -> None:
    assert_loss_falls("dense", ffn=Component("product_key", {"sub_keys": 8, "topk": 4, "heads": 2, "key_dim": 16}))
