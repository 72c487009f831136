"""Funnel-Transformer (xscale/models/stacks/funnel.py): pooling and up-sampling against loops written here, pooled queries
over unpooled keys and the decoder blocks against the equations run by hand, the decoder blocks counted, padding
that changes no class logit, full-length MLM logits, a tiny classifier that learns, the options refused, and (slow)
ZeRO-3 data parallelism at one-process parity."""

import pytest
import torch
import torch.nn.functional as F

from xscale.config.load import load_config_from_cli
from xscale.config.schema import Component, Config, ConfigError, ModelConfig
from xscale.models import build_model
from xscale.models.parameters import count_parameters
from xscale.models.stacks.funnel import pool_sequence, upsample
from xscale.parallel.checks import resolve_dims

VOCAB = 40
FUNNEL = ["model.family=encoder", "model.position=learned", "model.n_layers=3", "model.stack=funnel",
          "model.stack.options.groups=[1,1,1]"]


def _funnel(groups: tuple, decoder_layers: int = 2) -> Component:
    return Component("funnel", {"groups": list(groups), "decoder_layers": decoder_layers})


def _model(num_classes: int = 3, pooling: str = "mean", funnel: tuple = (1, 1, 1), decoder_layers: int = 2,
           **options) -> torch.nn.Module:
    config = ModelConfig(family="encoder", vocab_size=VOCAB, d_model=16, n_layers=sum(funnel), n_heads=2,
                         max_seq_len=16, position="learned", num_classes=num_classes, pooling=pooling,
                         stack=_funnel(funnel, decoder_layers), **options)
    return build_model(config, seed=0).eval()


def _reference_pool(hidden: torch.Tensor, mask: torch.Tensor, keep_first: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Window by window: the mean of the real rows of [2j, 2j + 2) (after an unpooled first row when kept)."""
    rows, masks = [], []
    for b in range(hidden.shape[0]):
        start = 1 if keep_first else 0
        out, real = [hidden[b, 0]] if keep_first else [], [bool(mask[b, 0])] if keep_first else []
        for j in range(start, hidden.shape[1], 2):
            window = [i for i in (j, j + 1) if i < hidden.shape[1] and mask[b, i]]
            out.append(sum(hidden[b, i] for i in window) / len(window) if window else torch.zeros(hidden.shape[2]))
            real.append(bool(window))
        rows.append(torch.stack(out))
        masks.append(torch.tensor(real))
    return torch.stack(rows), torch.stack(masks)


@pytest.mark.parametrize("keep_first", [False, True])
@pytest.mark.parametrize("length", [7, 8])
def test_pooling_matches_the_windowed_mean_of_the_real_rows(keep_first, length):
    hidden = torch.randn(3, length, 4, generator=torch.Generator().manual_seed(0))
    mask = torch.ones(3, length, dtype=torch.bool)
    mask[1, 4:] = False
    mask[2, 3:] = False  # a window half real, half padding
    got, got_mask = pool_sequence(hidden, mask, keep_first)
    expected, expected_mask = _reference_pool(hidden, mask, keep_first)
    torch.testing.assert_close(got, expected)
    assert torch.equal(got_mask, expected_mask)


def test_upsampling_repeats_each_pooled_row():
    pooled = torch.arange(2 * 3 * 1, dtype=torch.float32).view(2, 3, 1)
    got = upsample(pooled, 10, 4, keep_first=False)
    expected = torch.stack([pooled[:, i // 4] for i in range(10)], dim=1)
    torch.testing.assert_close(got, expected)
    kept = upsample(pooled, 5, 2, keep_first=True)  # row 0 stays, rows 1, 2 each twice
    torch.testing.assert_close(kept, pooled[:, [0, 1, 1, 2, 2]])


def _attention_by_hand(attention: torch.nn.Module, queries: torch.Tensor, keys: torch.Tensor,
                       mask: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(Q K^T / sqrt(d_h)) V over 2 heads of 8, then W_o; ``mask`` (B, T_k): no padded key."""
    batch, heads = queries.shape[0], 2
    q = attention.wq(queries).view(batch, -1, heads, 8).transpose(1, 2)
    k = attention.wk(keys).view(batch, -1, heads, 8).transpose(1, 2)
    v = attention.wv(keys).view(batch, -1, heads, 8).transpose(1, 2)
    scores = q @ k.transpose(-1, -2) / 8**0.5
    if mask is not None:
        scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    heads_out = F.softmax(scores, dim=-1) @ v
    return attention.wo(heads_out.transpose(1, 2).reshape(batch, -1, 16))


def _layer_norm(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, (16,), norm.weight, norm.bias, norm.eps)


def _post_norm_block_by_hand(block: torch.nn.Module, x: torch.Tensor, keys: torch.Tensor,
                             mask: torch.Tensor | None = None) -> torch.Tensor:
    """LayerNorm(x + Attn(Q = x, KV = keys)), then LayerNorm(. + W_out gelu(W_in .)) (post-norm, gelu FFN)."""
    attended = _layer_norm(block.attention.norm, x + _attention_by_hand(block.attention.sublayer, x, keys, mask))
    ffn = block.feed_forward.sublayer
    return _layer_norm(block.feed_forward.norm, attended + ffn.w_out(F.gelu(ffn.w_in(attended))))


@pytest.mark.parametrize("decoder_layers", [0, 2])
def test_the_funnel_forward_matches_the_papers_equations_written_out(decoder_layers):
    """Two groups of one post-norm block (the paper's placement): h = block_1(x); h' = Pool(h);
    h'' = FFN(LayerNorm(h' + Attn(Q = h', KV = h))); g = h + Up(h''); then the decoder blocks on g, full length
    (sec. 2.3), which the MLM head reads; the padded keys taken by none of the attentions."""
    model = _model(num_classes=0, funnel=(1, 1), norm_placement="post", norm="layernorm", ffn="gelu",
                   decoder_layers=decoder_layers)
    tokens = torch.randint(1, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 8, dtype=torch.bool)
    mask[1, 5:] = False  # a window half real, half padding: Pool reads row 4 alone
    blocks = list(model.stack.layers.values())
    assert len(blocks) == 2 + decoder_layers
    with torch.no_grad():
        x = model.embedding(tokens) + model.stack.position.weight[:8]
        h = _post_norm_block_by_hand(blocks[0], x, x, mask)
        weights = mask.float().view(2, 4, 2, 1)
        pooled = (h.view(2, 4, 2, 16) * weights).sum(dim=2) / weights.sum(dim=2).clamp_min(1)
        top = _post_norm_block_by_hand(blocks[1], pooled, h, mask)
        expected = h + top.repeat_interleave(2, dim=1)
        for block in blocks[2:]:
            expected = _post_norm_block_by_hand(block, expected, expected, mask)
        got = model(tokens, project=False, padding_mask=mask)
    torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1, :5], expected[1, :5], rtol=1e-5, atol=1e-5)  # the real tokens


def test_decoder_blocks_are_extra_to_n_layers_and_only_for_token_level_outputs():
    """funnel [1, 1] with 2 decoder blocks: n_layers stays 2 (the pooled groups'), the stack holds 4 blocks for
    MLM, 2 for a classifier (it reads the pooled states); the parameter count holds the decoder's blocks."""
    def count(num_classes: int = 0, decoder_layers: int = 2) -> int:
        config = Config(model=ModelConfig(family="encoder", vocab_size=VOCAB, d_model=16, n_layers=2, n_heads=2,
                                          max_seq_len=16, position="learned", num_classes=num_classes,
                                          stack=_funnel((1, 1), decoder_layers)))
        return count_parameters(config).total

    assert len(_model(num_classes=0, funnel=(1, 1)).stack.layers) == 4
    assert len(_model(num_classes=0, funnel=(1, 1), decoder_layers=0).stack.layers) == 2
    assert len(_model(num_classes=3, funnel=(1, 1)).stack.layers) == 2
    block = sum(p.numel() for p in _model(num_classes=0, funnel=(1, 1)).stack.layers["2"].parameters())
    assert count() - count(decoder_layers=0) == 2 * block
    assert count(num_classes=3, decoder_layers=2) == count(num_classes=3, decoder_layers=0)


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_padding_changes_no_class_logit(pooling):
    model = _model(pooling=pooling)
    tokens = torch.randint(1, VOCAB, (3, 5), generator=torch.Generator().manual_seed(0))
    junk = torch.randint(1, VOCAB, (3, 6), generator=torch.Generator().manual_seed(1))
    padded = torch.cat([tokens, junk], dim=1)
    mask = torch.cat([torch.ones(3, 5, dtype=torch.bool), torch.zeros(3, 6, dtype=torch.bool)], dim=1)
    with torch.no_grad():
        expected = model(tokens, padding_mask=torch.ones(3, 5, dtype=torch.bool))
        got = model(padded, padding_mask=mask)
        unmasked = model(padded)
    assert expected.shape == (3, 3)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(unmasked, expected, atol=1e-3), "the junk must matter when the mask is ignored"


def test_mlm_logits_are_full_length_with_the_first_groups_residual():
    model = _model(num_classes=0, funnel=(1, 1, 1))
    tokens = torch.randint(1, VOCAB, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(tokens)
        assert logits.shape == (2, 11, VOCAB)
        # Without the residual from the first group, positions sharing a pooled row would share their logits.
        assert not torch.allclose(logits[:, 0], logits[:, 1], atol=1e-4)


def test_a_tiny_funnel_classifier_learns(tiny_classifier):
    """Class = the first token's parity; 6 AdamW steps on one batch bring the loss well down."""
    losses = tiny_classifier.train(tiny_classifier.model(_funnel((1, 1))), tiny_classifier.parity_batch(), 6, 16)
    assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.parametrize("overrides,message", [
    (["model.stack.options.groups=[1,1]"], "holds 2 blocks but model.n_layers=3"),
    (["model.stack.options.groups=[3]"], "at least two block counts"),
    (["model.stack.options.decoder_layers=-1"], r"model.stack.options.decoder_layers must be in \[0, 64\]"),
    (["model.share_layers=true"], "model.stack=funnel and model.share_layers=true do not combine"),
    (["model.position=rope"], "model.position=rope is refused"),
    (["model.attention.kind=linformer"], "attention 'linformer' cannot"),
    (["model.family=decoder"], "set model.family=encoder"),
])
def test_options_a_funnel_cannot_run_with_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config_from_cli(None, [*FUNNEL, *overrides])


@pytest.mark.parametrize("layout,message", [
    (["parallel.pp=2"], "parallel.pp=2 is refused with model.stack=funnel: the up-sampling"),
    (["parallel.tp=2"], "parallel.tp=2 is refused with model.stack=funnel"),
    (["parallel.cp=2", "parallel.cp_load_balance=true", "train.seq_len=24", "model.max_seq_len=24"],
     r"divides the sequence by 4.*4 context-parallel chunks.*train.seq_len=24 a multiple of 16"),
    (["parallel.tp=2", "parallel.sequence_parallel=true"], "is refused with model.stack=funnel"),
])
def test_model_and_sequence_parallel_layouts_are_refused(layout, message):
    config = load_config_from_cli(None, [*FUNNEL, "train.seq_len=16", "model.max_seq_len=16", *layout])
    with pytest.raises(ConfigError, match=message):
        resolve_dims(config, 2)


def test_context_parallel_takes_a_funnel_whose_halvings_keep_the_chunks_whole():
    resolve_dims(load_config_from_cli(None, [*FUNNEL, "train.seq_len=16", "model.max_seq_len=16", "parallel.cp=2",
                                             "parallel.cp_load_balance=true"]), 2)
