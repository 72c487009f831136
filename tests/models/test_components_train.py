"""Every foundation component trains: the loss of a tiny model falls on a learnable synthetic task."""

import pytest
import torch

from xscale.config.schema import AttentionConfig, Component, ModelConfig, MoEConfig
from xscale.models import build_model
from xscale.models.registry import FFN, NORM, POSITION, ROUTER
from xscale.parallel.model import ParallelModel
from xscale.train.step import forward_backward_step

VOCAB, LENGTH, BATCH = 32, 16, 8


def _batch(family: str, step: int) -> dict[str, torch.Tensor]:
    """Eight fixed periodic sequences (period 4): learnable in a few dozen steps; masks vary by step."""
    period = torch.randint(3, VOCAB, (BATCH, 4), generator=torch.Generator().manual_seed(0))
    generator = torch.Generator().manual_seed(step)
    tokens = period.repeat(1, LENGTH // 4 + 1)[:, : LENGTH + 1]
    if family == "decoder":
        return {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}
    if family == "encoder":
        inputs, labels = tokens[:, :-1].clone(), torch.full((BATCH, LENGTH), -100)
        masked = torch.rand(BATCH, LENGTH, generator=generator) < 0.2
        labels[masked] = inputs[masked]
        inputs[masked] = 2  # the mask token
        return {"input_ids": inputs, "labels": labels}
    decoder_inputs = torch.cat([torch.ones(BATCH, 1, dtype=torch.long), tokens[:, : LENGTH - 1]], dim=1)
    return {"input_ids": tokens[:, :-1], "decoder_input_ids": decoder_inputs, "labels": tokens[:, :-1]}


CASES = {
    "rope": dict(position="rope"),
    "no-position": dict(position="none"),
    "sinusoidal": dict(position="sinusoidal"),
    "learned": dict(position="learned"),
    "learned_frequency": dict(position="learned_frequency"),
    "tupe": dict(position="tupe"),
    "deberta": dict(position="deberta"),
    "music": dict(position="music"),
    "alibi": dict(position="alibi"),
    "t5_bias": dict(position="t5_bias"),
    "shaw": dict(position="shaw"),
    "xl": dict(position="xl"),
    "layernorm-post": dict(norm="layernorm", norm_placement="post"),
    "rmsnorm-sandwich": dict(norm="rmsnorm", norm_placement="sandwich"),
    "scalenorm": dict(norm="scalenorm"),
    "rezero": dict(norm_placement="rezero"),
    "deepnorm": dict(norm="layernorm", norm_placement="deepnorm"),
    "deepnorm-encoder-decoder": dict(family="encoder_decoder", norm="layernorm", norm_placement="deepnorm",
                                     n_decoder_layers=2),
    "relu": dict(ffn="relu"),
    "gelu": dict(ffn="gelu"),
    "gelu_tanh": dict(ffn="gelu_tanh"),
    "swiglu": dict(ffn="swiglu"),
    "geglu": dict(ffn="geglu"),
    "reglu": dict(ffn="reglu"),
    "product_key": dict(ffn=Component("product_key", {"sub_keys": 8, "topk": 4, "heads": 2, "key_dim": 16})),
    "mqa": dict(n_kv_heads=1, attention=AttentionConfig(kind="mqa")),
    "gqa": dict(n_kv_heads=2),
    "dropout": dict(dropout=0.1, attention_dropout=0.1),
    "untied-bias": dict(tie_embeddings=False, bias=True),
    "shared-layers": dict(share_layers=True),
    "encoder-mlm": dict(family="encoder", position="learned", norm="layernorm", norm_placement="post",
                        embedding_norm=True, lm_head_transform=True, lm_head_bias=True, ffn="gelu"),
    "encoder-decoder": dict(family="encoder_decoder", position="t5_bias", n_decoder_layers=2),
    # Every router, through the model as the trainer runs it (MoE in every layer; expert choice sees the future,
    # so it runs in an encoder).
    "moe-switch": dict(moe=MoEConfig(num_experts=4, router="switch", top_k=1, every=1)),
    "moe-gshard": dict(moe=MoEConfig(num_experts=4, router="gshard", top_k=2, every=1)),
    "moe-hash": dict(moe=MoEConfig(num_experts=4, router="hash", top_k=1, every=1)),
    "moe-hash-encoder-decoder": dict(family="encoder_decoder", n_decoder_layers=2,
                                     moe=MoEConfig(num_experts=4, router="hash", top_k=1, every=1)),
    "moe-expert_choice": dict(family="encoder", position="learned", ffn="gelu",
                              moe=MoEConfig(num_experts=4, router="expert_choice", every=1)),
    "moe-base": dict(moe=MoEConfig(num_experts=4, router="base", top_k=1, every=1)),
}


@pytest.mark.parametrize("registry,option", [(FFN, "ffn"), (NORM, "norm"), (POSITION, "position"),
                                             (ROUTER, "router")])
def test_every_registered_component_has_a_training_case(registry, option):
    """A component registered without a case here would never be trained end to end by the suite."""
    covered = {str(case["moe"].router if option == "router" else case.get(option, getattr(ModelConfig(), option)))
               for case in CASES.values() if option != "router" or "moe" in case}
    assert set(registry.names()) <= covered, f"{option}s without a case: {set(registry.names()) - covered}"


@pytest.mark.parametrize("name", list(CASES))
def test_component_trains(name):
    torch.manual_seed(0)
    options = dict(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, max_seq_len=LENGTH) | CASES[name]
    config = ModelConfig(**options)
    model = build_model(config, seed=1)
    engine = ParallelModel([model], micro_batch_size=BATCH)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(40):
        losses.append(float(forward_backward_step(engine, _batch(config.family, step))))
        optimizer.step()
        optimizer.zero_grad()
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.6 * first, f"{name}: loss went from {first:.3f} to {last:.3f}"


def test_shared_layers_reuse_one_block():
    config = ModelConfig(vocab_size=VOCAB, d_model=32, n_layers=4, n_heads=4, share_layers=True)
    model = build_model(config)
    assert len(model.stack.layers) == 1 and len(model.stack.blocks()) == 4


def test_gradient_accumulation_equals_one_big_batch():
    config = ModelConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, max_seq_len=LENGTH)
    batch = _batch("decoder", 0)
    grads = []
    for micro in (BATCH, 2):
        model = build_model(config, seed=3)
        loss = forward_backward_step(ParallelModel([model], micro_batch_size=micro), batch)
        grads.append((loss, [p.grad.clone() for p in model.parameters()]))
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=1e-6, atol=1e-6)
    for a, b in zip(grads[0][1], grads[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_weights_depend_only_on_seed_and_name():
    config = ModelConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4)
    a, b = build_model(config, seed=5), build_model(config, seed=5)
    c = build_model(config, seed=6)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if "norm" not in name:
            assert not torch.equal(pa, pc), name


def test_use_kernels_sets_the_backend_of_every_fused_op_caller():
    from xscale.models.ffn import GatedMLP
    from xscale.models.norm import RMSNorm
    from xscale.models.position import RotaryPosition

    model = build_model(ModelConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2, max_seq_len=8), seed=0)
    callers = [m for m in model.modules() if isinstance(m, (RMSNorm, GatedMLP, RotaryPosition))]
    assert callers and all(m.kernels == "auto" for m in callers)
    model.use_kernels("torch")
    assert model.kernels == "torch" and all(m.kernels == "torch" for m in callers)
    with pytest.raises(ValueError, match="not one of auto, triton, apex, torch"):
        model.use_kernels("cuda")
