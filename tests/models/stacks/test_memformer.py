"""Memformer (xscale/models/stacks/memformer.py): the memory writer against slot attention written out per slot and
head with the biased normalization (outputs and gradients, tau 1 and 0.5), a slot whose weight stays on itself
keeping its content (the paper's retention: its own value is m_i itself), the segment loop against a loop over
segments with the read and write spelled out (outputs and gradients), no logit moved by a later token while earlier
segments reach later ones through the memory, a tiny language model that learns, decoding by recomputation, the
options and layouts refused (ZeRO-3 parity: the zoo matrix's case ``memformer``)."""

import math

import pytest
import torch
import torch.nn.functional as F
from parity_models import DECODER

from xscale.config.load import load_config_from_cli
from xscale.config.schema import Component, ConfigError, ModelConfig
from xscale.generation.decode import decodes_with_cache, generate
from xscale.models import build_model
from xscale.models.stacks.memformer import MemoryWriter
from xscale.parallel.checks import resolve_dims
from xscale.parallel.loss import model_loss_sum

VOCAB = 40


def write_by_hand(writer: MemoryWriter, memory: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
    """Slot i, head h (sec. 3.2.2-3.2.3): softmax over [m_i ; H] of q_i . k_j / (sqrt(d_h) tau), weighting the values
    [m_i ; H W_V] (the slot's own value is its head's part of m_i itself), the heads side by side, + v_i, normalized."""
    batch, slots, width = memory.shape
    head_dim = width // writer.heads
    out = []
    for b in range(batch):
        tokens = [writer.state_norm(states[b, t]) for t in range(states.shape[1])]
        rows = []
        for i in range(slots):
            slot = writer.memory_norm(memory[b, i])
            query = writer.query(slot)
            heads = []
            for h in range(writer.heads):
                part = slice(h * head_dim, (h + 1) * head_dim)
                sources = [slot, *tokens]  # itself, then the segment; never the other slots
                logits = torch.stack([query[part] @ writer.key(s)[part] / math.sqrt(head_dim) for s in sources])
                values = [memory[b, i, part], *(writer.value(token)[part] for token in tokens)]
                heads.append(sum(w * value for w, value in zip((logits / writer.temperature).softmax(0), values)))
            written = torch.cat(heads) + writer.bias[i]
            rows.append(written / written.norm())
        out.append(torch.stack(rows))
    return torch.stack(out)


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_the_writer_matches_slot_attention_by_hand(temperature) -> None:
    torch.manual_seed(0)
    writer = MemoryWriter(8, 3, 2, temperature).double()
    memory = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)
    states = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    out = writer(memory, states)
    ref = write_by_hand(writer, memory, states)
    torch.testing.assert_close(out, ref)
    grad = torch.randn_like(out)
    wrt = (memory, states, *writer.parameters())
    for got, want in zip(torch.autograd.grad(out, wrt, grad), torch.autograd.grad(ref, wrt, grad)):
        torch.testing.assert_close(got, want)
    torch.testing.assert_close(writer.initial(2, torch.float64)[1], F.normalize(writer.bias, dim=-1))


def test_a_slot_that_keeps_its_weight_on_itself_keeps_its_content() -> None:
    """All of a slot's weight on itself (here: no token to read) leaves m' = m: only the bias moves it (forgetting),
    m_next = (m + v) / ||m + v||."""
    torch.manual_seed(0)
    writer = MemoryWriter(8, 3, 2).double()
    memory = F.normalize(torch.randn(2, 3, 8, dtype=torch.float64), dim=-1)
    torch.testing.assert_close(writer(memory, memory[:, :0]), F.normalize(memory + writer.bias, dim=-1))


def _memformer(position: str = "learned", segment: int = 4) -> torch.nn.Module:
    config = ModelConfig(family="decoder", vocab_size=VOCAB, d_model=16, n_layers=2, n_heads=2, max_seq_len=16,
                         position=position, stack=Component("memformer", {"slots": 3, "segment": segment, "heads": 2}))
    return build_model(config, seed=0)


def segments_by_hand(model: torch.nn.Module, x: torch.Tensor, segment: int) -> torch.Tensor:
    """Segment by segment: every block reads the memory M (its cross-attention's keys), then the writer's slot
    attention over [m_i ; H] and the biased normalization, spelled out, give the next M."""
    stack = model.stack
    memory = F.normalize(stack.writer.bias, dim=-1).expand(x.shape[0], -1, -1)
    outputs = []
    for start in range(0, x.shape[1], segment):
        h = x[:, start:start + segment]
        for name in sorted(stack.layers, key=int):
            h = stack.layers[name](h, stack.position, memory)
        outputs.append(h)
        memory = write_by_hand(stack.writer, memory, h)
    return torch.cat(outputs, dim=1)


@pytest.mark.parametrize("length", [12, 10], ids=["whole-segments", "a-shorter-last-segment"])
def test_the_segment_loop_matches_the_loop_written_out(length) -> None:
    model = _memformer().double().eval()
    x = torch.randn(2, length, 16, dtype=torch.float64, requires_grad=True)
    context = model._context(None, None)
    out, _ = model.stack(x, None, None, context)
    ref = segments_by_hand(model, x, 4)
    torch.testing.assert_close(out, ref)
    grad = torch.randn_like(out)
    wrt = (x, *model.stack.parameters())
    for got, want in zip(torch.autograd.grad(out, wrt, grad, allow_unused=True),
                         torch.autograd.grad(ref, wrt, grad, allow_unused=True)):
        if want is None:
            assert got is None or not got.any()
        else:
            torch.testing.assert_close(got, want)


@pytest.mark.parametrize("position", ["learned", "rope"])
def test_no_later_token_moves_a_logit_and_the_memory_carries_earlier_segments(position) -> None:
    model = _memformer(position).eval()
    tokens = torch.randint(1, VOCAB, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(tokens)
        for changed in (1, 5, 9):
            edited = tokens.clone()
            edited[:, changed] = edited[:, changed] % (VOCAB - 1) + 1
            moved = (model(edited) - logits).abs().amax(dim=(0, 2)) > 1e-6
            # every later position moves: in its own segment by self-attention, in later ones through the memory
            assert moved.tolist() == [t >= changed for t in range(11)], (changed, moved)


def test_a_tiny_memformer_language_model_learns() -> None:
    """Next token = the current one + 1 (mod 39); AdamW steps on one batch bring the loss well down."""
    torch.manual_seed(0)
    model = _memformer().train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    start = torch.randint(1, VOCAB, (16, 1), generator=torch.Generator().manual_seed(0))
    window = (start + torch.arange(13)) % (VOCAB - 1) + 1
    batch = {"input_ids": window[:, :-1], "labels": window[:, 1:]}
    losses = []
    for _ in range(20):
        loss = model_loss_sum(model, batch) / batch["labels"].numel()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.5 * losses[0], losses


def test_decodes_by_recomputing_the_prefix() -> None:
    model = _memformer()
    assert not decodes_with_cache(model)
    prompt = torch.randint(1, VOCAB, (2, 3), generator=torch.Generator().manual_seed(0))
    generated = generate(model, prompt, 4)
    sequence = torch.cat([prompt, generated.tokens], dim=1)
    with torch.no_grad():
        for step in range(4):
            torch.testing.assert_close(generated.logits[:, step], model(sequence[:, :3 + step])[:, -1].float())


MEMFORMER = ["model.position=learned", "model.max_seq_len=16", "model.stack=memformer",
             "model.stack.options={slots: 4, segment: 4}"]


@pytest.mark.parametrize("overrides,message", [
    (["model.family=encoder"], "set model.family=decoder and train.task=lm"),
    (["model.stack.options={segment: 32}"], "segment=32 exceeds train.seq_len=16"),
    (["model.stack.options={heads: 3, segment: 4}"], "heads=3 must divide model.d_model"),
    (["model.stack.options={slots: 0}"], "must be >= 1"),
    (["model.stack.options={temperature: 0}"], r"temperature=0(\.0)? must be > 0"),
    (["model.position=alibi"], "model.position=alibi is refused"),
    (["model.share_layers=true"], "do not combine"),
    (["model.attention.kind=realformer"], "RealFormer"),
    (["model.block=sandwich"], "model.block=sandwich has not"),
])
def test_options_it_cannot_run_with_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config_from_cli(None, [*DECODER, *MEMFORMER, *overrides])


@pytest.mark.parametrize("layout,message", [
    (["parallel.tp=2"], "parallel.tp=2 is refused with model.stack=memformer: its memory writer"),
    (["parallel.pp=2"], "parallel.pp=2 is refused with model.stack=memformer: every segment"),
    (["parallel.cp=2"], "parallel.cp=2 is refused with model.stack=memformer: each segment reads"),
])
def test_model_parallel_layouts_are_refused(layout, message):
    with pytest.raises(ConfigError, match=message):
        resolve_dims(load_config_from_cli(None, [*DECODER, *MEMFORMER, *layout]), 2)
