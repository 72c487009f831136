"""Layout-independent dropout: a mask is a function of (seed, site, step, global sample, coordinates), so any
slice a rank holds draws that slice of the whole tensor's mask; without a position it acts like nn.Dropout."""

from __future__ import annotations

import pytest
import torch

from xscale.config.schema import ModelConfig, MoEConfig
from xscale.models import build_model
from xscale.models.dropout import Dropout, uniform_draws
from xscale.runtime import StepContext

SHAPE = (8, 32, 64)
POSITION = StepContext(seed=1, step=3)


def mask(p: float = 0.1, shape=SHAPE, position=POSITION, shard_index: int = 0,
         site: int = 7) -> torch.Tensor:
    dropout = Dropout(p)
    dropout.site = site  # shard_index: this rank's slice of the tokens under sequence parallelism (of 2)
    context = position.with_tensor_parallel(shard_index, 2, sequence_parallel=True) if shard_index else position
    return dropout.keep_mask(torch.Size(shape), torch.device("cpu"), context)


@pytest.mark.parametrize("p", [0.01, 0.1, 0.5, 0.9])
def test_drops_a_fraction_p(p):
    dropped = 1.0 - mask(p, shape=(64, 128, 128)).float().mean().item()
    assert abs(dropped - p) < 5 * (p * (1 - p) / 64 / 128 / 128) ** 0.5 + 1e-4


def test_neighbours_are_uncorrelated():
    dropped = (~mask(0.5, shape=(16, 64, 128))).float()
    for a, b in [(dropped[..., 1:], dropped[..., :-1]), (dropped[:, 1:], dropped[:, :-1]),
                 (dropped[1:], dropped[:-1])]:
        assert abs(torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1]) < 0.02


def test_slices_draw_the_slices_of_the_whole_mask():
    whole = mask()
    half = SHAPE[1] // 2
    for rank in range(2):  # sequence (or head) shards on dim 1
        shard = mask(shape=(SHAPE[0], half, SHAPE[2]), shard_index=rank)
        assert torch.equal(shard, whole[:, rank * half:(rank + 1) * half])
    rows = mask(shape=(3, *SHAPE[1:]), position=StepContext(seed=1, step=3, first_sample=5))
    assert torch.equal(rows, whole[5:8])  # a data-parallel rank's (or microbatch's) rows


@pytest.mark.parametrize("load_balance", [False, True])
def test_sequence_parallel_slices_of_a_context_parallel_slice_draw_their_tokens(load_balance):
    """cp=2 x tp=2 with sequence parallelism: tp rank t holds slice t of its cp rank's tokens, which may be two
    chunks of the sequence (load balanced); each draws exactly those tokens' rows of the whole mask."""
    from xscale.parallel.context import SequenceSlice

    whole = mask()
    for cp_rank in range(2):
        layout = SequenceSlice(2, cp_rank, load_balance)
        tokens = layout.coordinates(SHAPE[1] // 2, torch.device("cpu"))
        for tp_rank in range(2):
            dropout = Dropout(0.1)
            dropout.site = 7
            context = POSITION.with_sequence(layout).with_tensor_parallel(tp_rank, 2, sequence_parallel=True)
            shard = dropout.keep_mask(torch.Size((SHAPE[0], SHAPE[1] // 4, SHAPE[2])), torch.device("cpu"), context)
            held = tokens[tp_rank * SHAPE[1] // 4:(tp_rank + 1) * SHAPE[1] // 4]
            assert torch.equal(shard, whole[:, held]), (cp_rank, tp_rank)


def test_masks_at_flat_positions_are_the_whole_masks_elements():
    """keep_at(index) is keep_mask at those row-major positions (block-sparse attention's gathered blocks)."""
    whole = mask()
    dropout = Dropout(0.1)
    dropout.site = 7
    index = torch.randint(0, SHAPE[1] * SHAPE[2], (5, 6))
    picked = dropout.keep_at(SHAPE[0], index, POSITION)
    assert torch.equal(picked, whole.flatten(1)[:, index])


@pytest.mark.parametrize("change", ["seed", "step", "site"])
def test_seed_step_and_site_change_the_mask(change):
    position = StepContext(seed=2 if change == "seed" else 1, step=4 if change == "step" else 3)
    other = mask(position=position, site=8 if change == "site" else 7)
    agreement = (other == mask()).float().mean().item()
    assert agreement < 0.85  # independent masks at p=0.1 agree on 0.9^2 + 0.1^2 = 0.82 of elements


def test_forward_scales_kept_elements_and_backward_uses_the_same_mask():
    dropout = Dropout(0.25).train()
    x = torch.randn(SHAPE, requires_grad=True)
    context = StepContext(seed=0, step=0)
    out = dropout(x, context)
    keep = dropout.keep_mask(x.shape, x.device, context)
    torch.testing.assert_close(out, x.detach() * keep / 0.75)
    out.backward(torch.ones_like(out))
    torch.testing.assert_close(x.grad, keep / 0.75)
    assert dropout.eval()(x) is x


def test_without_a_position_it_draws_from_torchs_generator():
    dropout = Dropout(0.5).train()
    x = torch.ones(SHAPE)
    torch.manual_seed(0)
    first, second = dropout(x), dropout(x)
    torch.manual_seed(0)
    assert torch.equal(dropout(x), first) and not torch.equal(first, second)


def test_every_dropout_of_a_model_has_its_own_site():
    model = build_model(ModelConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2, dropout=0.1,
                                    attention_dropout=0.1), seed=0)
    sites = [module.site for module in model.modules() if isinstance(module, Dropout)]
    assert len(sites) == 2 * 4 + 1 and len(set(sites)) == len(sites)  # per block: 2 residual, FFN, attention


def test_uniform_draws_are_uniform_and_follow_the_global_rows():
    whole_position = StepContext(seed=1, step=3)
    whole = uniform_draws(77, torch.Size((8, 16, 32)), torch.device("cpu"), whole_position)
    assert whole.dtype == torch.float32 and 0.0 <= whole.min() and whole.max() < 1.0
    assert abs(whole.mean().item() - 0.5) < 0.01 and abs(whole.var().item() - 1 / 12) < 0.005
    assert torch.corrcoef(torch.stack([whole[:, :, :-1].reshape(-1), whole[:, :, 1:].reshape(-1)]))[0, 1].abs() < 0.02
    rows = StepContext(seed=1, step=3, first_sample=5)
    assert torch.equal(uniform_draws(77, torch.Size((3, 16, 32)), torch.device("cpu"), rows), whole[5:8])
    assert not torch.equal(uniform_draws(78, torch.Size((8, 16, 32)), torch.device("cpu"), whole_position), whole)


def test_routers_draw_at_their_own_site():
    model = build_model(ModelConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2, dropout=0.1,
                                    moe=MoEConfig(num_experts=4, jitter=0.1, every=1)), seed=0)
    sites = [module.site for module in model.modules() if hasattr(module, "site")]
    routers = [layer.sublayer.router for layer in (block.feed_forward for block in model.stack.layers.values())]
    assert all(router.site != 0 for router in routers) and len(set(sites)) == len(sites)


def test_a_shared_block_draws_its_own_masks_at_every_depth():
    """ALBERT's one block at every depth: one site per dropout, but each depth draws its own masks (as nn.Dropout
    would), and a stack that starts at depth k (a pipeline stage) draws depth k's."""
    config = ModelConfig(vocab_size=64, d_model=32, n_layers=3, n_heads=4, max_seq_len=16, dropout=0.5,
                         share_layers=True)
    model = build_model(config, seed=1).train()
    dropout = model.stack.layers["0"].feed_forward.dropout
    masks = []
    original = dropout.keep_mask
    dropout.keep_mask = lambda shape, device, context: masks.append(original(shape, device, context)) or masks[-1]
    tokens = torch.randint(0, 64, (2, 16))
    context = StepContext(seed=0, step=0)
    model(tokens, context=context)
    assert len(masks) == 3
    assert not torch.equal(masks[0], masks[1]) and not torch.equal(masks[1], masks[2])
    hidden = model.embedding_dropout(model.embedding(tokens), context)
    model.stack.keep(range(1, 3))  # the blocks of depths 1 and 2 alone (a later pipeline stage)
    model(hidden, context=context)
    assert torch.equal(masks[3], masks[1]) and torch.equal(masks[4], masks[2])
