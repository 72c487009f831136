"""DeLighT blocks (Mehta et al. 2021): the GLT against a loop over groups, the block against a hand-written
transformation (shuffle and mixing feature by feature), single-head attention and light-weight FFN, block-wise
scaling against eq. 4, causality, and the settings it refuses."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from xscale.cli import main
from xscale.config.check import validate
from xscale.config.load import load_config_from_cli
from xscale.config.schema import Component, ConfigError, ModelConfig
from xscale.models import build_model
from xscale.models.blocks.delight import DelightOptions, GroupLinear, block_scaling

OPTIONS = {"min_depth": 3, "max_depth": 5, "max_groups": 4}


def _model(n_layers: int = 3, **options):
    config = ModelConfig(vocab_size=32, d_model=32, n_layers=n_layers, n_heads=4, max_seq_len=8, position="learned",
                         norm="layernorm", ffn="relu", bias=True, block=Component("delight", OPTIONS | options))
    return build_model(config, seed=0)


def _glt_by_hand(glt: GroupLinear, z: torch.Tensor) -> torch.Tensor:
    """Group k's features times W_k, the groups concatenated, plus the bias."""
    groups, width_in, width_out = glt.weight.shape
    pieces = [z[..., k * width_in:(k + 1) * width_in] @ glt.weight[k] for k in range(groups)]
    return torch.cat(pieces, dim=-1) + glt.bias


def _transformation_by_hand(transformation, x: torch.Tensor) -> torch.Tensor:
    """Eq. 1-2 feature by feature: S(Y)[c g + k] = Y[k m + c] (m = width / g), H(X, Y) group k = [X_k ; S(Y)_k]."""
    y = _glt_by_hand(transformation.layers[0], x)
    for layer in range(1, len(transformation.layers)):
        y = F.gelu(y)
        before, groups = transformation.groups[layer - 1], transformation.groups[layer]
        per_group = y.shape[-1] // before
        shuffled = torch.stack([y[..., k * per_group + c] for c in range(per_group) for k in range(before)], dim=-1)
        x_part, y_part = x.shape[-1] // groups, shuffled.shape[-1] // groups
        mixed = torch.cat([piece for k in range(groups) for piece in
                           (x[..., k * x_part:(k + 1) * x_part], shuffled[..., k * y_part:(k + 1) * y_part])], dim=-1)
        y = _glt_by_hand(transformation.layers[layer], mixed)
    return y


def _block_by_hand(block, x: torch.Tensor) -> torch.Tensor:
    """Pre-norm: x + W_O softmax(Q K^T / sqrt(d_o) + causal) V on the transformation of norm(x), then the
    light-weight FFN d_m -> d_m / 4 -> d_m."""
    sublayer = block.attention.sublayer
    attention, h = sublayer.attention, _transformation_by_hand(sublayer.transformation, block.attention.norm(x))
    q, k, v = attention.wq(h), attention.wk(h), attention.wv(h)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    future = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).triu(1)
    x = x + attention.wo(scores.masked_fill(future, float("-inf")).softmax(-1) @ v)
    ffn = block.feed_forward.sublayer
    return x + ffn.w_out(torch.relu(ffn.w_in(block.feed_forward.norm(x))))


def test_group_linear_matches_a_loop_over_groups_outputs_and_gradients() -> None:
    torch.manual_seed(0)
    glt = GroupLinear(12, 8, groups=4, bias=True)
    with torch.no_grad():
        glt.bias.normal_()
    z = torch.randn(2, 5, 12, requires_grad=True)
    reference_z = z.detach().clone().requires_grad_(True)
    out = glt(z)
    torch.testing.assert_close(out, _glt_by_hand(glt, reference_z))
    out.pow(2).sum().backward()
    grads = {name: p.grad.clone() for name, p in glt.named_parameters()}
    glt.zero_grad()
    _glt_by_hand(glt, reference_z).pow(2).sum().backward()
    torch.testing.assert_close(z.grad, reference_z.grad)
    for name, p in glt.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, msg=name)


@pytest.mark.parametrize("layer", [0, 2])
def test_block_matches_the_hand_written_reference_outputs_and_gradients(layer) -> None:
    model = _model()
    block, position = model.stack.layers[str(layer)], model.stack.position
    with torch.no_grad():
        for name, p in block.named_parameters():
            if name.endswith("bias"):
                p.normal_(std=0.1)  # not the zero start, so a misplaced bias shows
    assert len(block.attention.sublayer.transformation.groups) == 3 + layer  # N^b from 3 to 5 over the 3 blocks
    x = torch.randn(2, 6, 32, requires_grad=True)
    reference_x = x.detach().clone().requires_grad_(True)
    out = block(x, position)
    torch.testing.assert_close(out, _block_by_hand(block, reference_x))
    out.pow(2).sum().backward()
    grads = {name: p.grad.clone() for name, p in block.named_parameters()}
    block.zero_grad()
    _block_by_hand(block, reference_x).pow(2).sum().backward()
    torch.testing.assert_close(x.grad, reference_x.grad)
    for name, p in block.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, msg=name)


def test_block_wise_scaling_follows_eq_4() -> None:
    """N^b = N_min + (N_max - N_min) b / (B - 1), w^b = w_m + (N_max - N_min) b / (N_min (B - 1)); 5 blocks."""
    options = DelightOptions(min_depth=4, max_depth=8, width_multiplier=2.0)
    assert [block_scaling(options, b, 5) for b in range(5)] == [(4, 2.0), (5, 2.25), (6, 2.5), (7, 2.75), (8, 3.0)]
    model = _model(n_layers=2, min_depth=2, max_depth=4, width_multiplier=2.0, max_groups=8)
    first, last = (model.stack.layers[str(b)].attention.sublayer.transformation for b in (0, 1))
    assert (first.groups, last.groups) == ([1, 1], [1, 2, 2, 1])
    widest = [max(layer.weight.shape[0] * layer.weight.shape[2] for layer in t.layers) for t in (first, last)]
    assert widest == [2 * 32, 3 * 32]  # w^0 d_m and w^1 d_m = (2 + 2 / 2) d_m
    assert [layer.weight.shape[0] * layer.weight.shape[2] for layer in last.layers][-1] == 16  # d_o = d_m / 2


def test_a_delight_decoder_reads_no_future_token() -> None:
    model = _model()
    tokens = torch.randint(0, 32, (1, 8))
    changed = tokens.clone()
    changed[0, 5:] = (changed[0, 5:] + 1) % 32
    torch.testing.assert_close(model(tokens)[:, :5], model(changed)[:, :5])


TINY = ["model.vocab_size=48", "model.d_model=32", "model.n_layers=2", "model.n_heads=4", "train.seq_len=16",
        "data.dataset=copy", "model.position=learned", "model.max_seq_len=16", "model.block=delight",
        "model.block.options.max_groups=4"]


@pytest.mark.parametrize("overrides,message", [
    (["parallel.tp=2"], r"model.block=delight does not take parallel.tp > 1: DeLighT's attention is a single head"),
    (["model.position=rope"], r"model.position=rope's per-head terms .* use learned, sinusoidal"),
    (["model.d_model=36"], r"model.d_model=36 must be a multiple of 2 x max_groups=8"),
    (["model.attention.kind=local"], r"the paper's attention is one dense head"),
    (["model.moe.num_experts=4"], r"light-weight FFN in every block; set model.moe.num_experts=0"),
    (["model.share_layers=true"], r"does not take model.share_layers=true: block-wise scaling"),
    (["model.family=encoder_decoder"], r"does not take model.family=encoder_decoder"),
    (["model.block.options.max_groups=3"], r"max_groups=3 must be a power of two"),
])
def test_refused_with_the_reason_and_the_fix(overrides, message) -> None:
    with pytest.raises(ConfigError, match=message):
        validate(load_config_from_cli(None, [*TINY, *overrides]))


def test_taken_settings_pass() -> None:
    validate(load_config_from_cli(None, [*TINY, "parallel.zero_stage=3", "parallel.activation_checkpointing=full"]))


def test_inspect_lists_the_kind_with_its_options(capsys) -> None:
    assert main(["inspect", "--components"]) == 0
    out = capsys.readouterr().out
    assert "model.block: delight" in out and "min_depth=4 (N_min" in out and "ffn_reduction=4" in out
