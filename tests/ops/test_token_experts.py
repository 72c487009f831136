"""token_experts: dispatch, expert FFN and gated combine in one pass per expert equal the unfused path
(gather_tokens, grouped_mlp, combine_by_gate), outputs and every gradient, dropped tokens included."""

import pytest
import torch

from xscale.ops.grouped_mlp import ExpertWeights, grouped_mlp
from xscale.ops.moe_permute import assignment_of_token, combine_by_gate, gather_tokens
from xscale.ops.token_experts import token_experts

EXPERT_OF_TOKEN = [2, 0, 2, -1, 1, 4, 2, 0, -1, 4, 4, 2]  # -1: dropped; expert 3 gets nothing


def _routing():
    expert = torch.tensor(EXPERT_OF_TOKEN)
    kept = (expert >= 0).nonzero().squeeze(1)
    order = torch.argsort(expert[kept], stable=True)
    token_index = kept[order]
    counts = torch.bincount(expert[token_index], minlength=5).tolist()
    return token_index, counts


def _leaves(gated: bool, bias: bool, dtype=torch.float64):
    torch.manual_seed(0)
    experts, d, hidden = 5, 6, 7

    def make(*shape):
        return torch.randn(*shape, dtype=dtype, requires_grad=True)

    return {"tokens": make(len(EXPERT_OF_TOKEN), d), "gate": make(int((torch.tensor(EXPERT_OF_TOKEN) >= 0).sum())),
            "w1": make(experts, hidden, d), "b1": make(experts, hidden) if bias else None,
            "w_up": make(experts, hidden, d) if gated else None, "b_up": make(experts, hidden) if gated and bias else None,
            "w2": make(experts, d, hidden), "b2": make(experts, d) if bias else None}


def _unfused(leaves, token_index, counts):
    assignment = assignment_of_token(token_index, leaves["tokens"].shape[0])
    rows = gather_tokens(leaves["tokens"], token_index, assignment)
    out = grouped_mlp(rows, counts, "gelu", leaves["w1"], leaves["b1"], leaves["w2"], leaves["b2"], leaves["w_up"],
                      leaves["b_up"])
    return combine_by_gate(out, leaves["gate"], token_index, leaves["tokens"].shape[0], rows.dtype, assignment)


def _fused(leaves, token_index, counts):
    weights = ExpertWeights(leaves["w1"], leaves.get("b1"), leaves.get("w_up"), leaves.get("b_up"), leaves["w2"],
                            leaves.get("b2"), "gelu")
    return token_experts(leaves["tokens"], token_index, leaves["gate"], counts, weights)


@pytest.mark.parametrize("gated", [False, True], ids=["mlp", "gated"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("serial", [False, True], ids=["threads", "serial"])
def test_equals_gather_grouped_mlp_and_combine(gated, bias, serial):
    token_index, counts = _routing()
    leaves = {name: t for name, t in _leaves(gated, bias).items() if t is not None}
    upstream = torch.randn(len(EXPERT_OF_TOKEN), 6, dtype=torch.float64)
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if serial else 2)
    try:
        got = _fused(leaves, token_index, counts)
        got_grads = torch.autograd.grad((got * upstream).sum(), list(leaves.values()))
    finally:
        torch.set_num_threads(threads)
    full = {"b1": None, "w_up": None, "b_up": None, "b2": None} | leaves
    expected = _unfused(full, token_index, counts)
    expected_grads = torch.autograd.grad((expected * upstream).sum(), list(leaves.values()))
    torch.testing.assert_close(got, expected)
    assert torch.count_nonzero(got[[3, 8]]) == 0, "a dropped token's output must be zero"
    for name, mine, theirs in zip(leaves, got_grads, expected_grads):
        torch.testing.assert_close(mine, theirs, msg=name)


def test_autocast_runs_the_experts_in_bf16_and_returns_the_tokens_dtype():
    token_index, counts = _routing()
    leaves = _leaves(False, False, torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _fused(leaves, token_index, counts)
        expected = _unfused({**leaves, "tokens": leaves["tokens"].to(torch.bfloat16)}, token_index, counts)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected.float(), rtol=2e-2, atol=2e-2)


def test_counts_and_shapes_are_checked():
    token_index, counts = _routing()
    leaves = _leaves(False, False)
    with pytest.raises(ValueError, match="one entry per kept assignment"):
        token_experts(leaves["tokens"], token_index, leaves["gate"][:-1], counts,
                      ExpertWeights(leaves["w1"], None, None, None, leaves["w2"], None, "gelu"))
