"""alpha-entmax attention (Correia et al. 2019): the sort-based 1.5-entmax and the bisection agree with a row-by-row
reference that finds tau by scanning the support sizes, the rows are sparse, the gradient is the closed form, and a
tiny model trains."""

from __future__ import annotations

import pytest
import torch

from tests.models.attention.conftest import assert_loss_falls, make_core, random_qkv
from xscale.config.schema import ConfigError
from xscale.models.attention.entmax import entmax


def entmax_by_support_scan(z: torch.Tensor, alpha: float) -> torch.Tensor:
    """One row at a time: for each support size k (the k largest of (alpha - 1) z), solve
    sum_{j<=k} ((alpha - 1) z_j - tau)^(1 / (alpha - 1)) = 1 for tau by a scalar bisection, and keep the k whose tau
    lies between the k-th and (k+1)-th values (Peters et al. 2019, eq. 2 and its optimality conditions)."""
    z = z.detach()
    out = torch.zeros_like(z)
    power = 1 / (alpha - 1)
    for index in torch.cartesian_prod(*[torch.arange(n) for n in z.shape[:-1]]).reshape(-1, z.dim() - 1):
        row = z[tuple(index)] * (alpha - 1)
        finite = row[row > float("-inf")]
        ordered = finite.sort(descending=True).values
        for size in range(1, len(ordered) + 1):
            low, high = float(ordered[0]) - 1.0, float(ordered[size - 1])
            for _ in range(200):
                tau = (low + high) / 2
                if float(((ordered[:size] - tau).clamp_min(0) ** power).sum()) >= 1:
                    low = tau
                else:
                    high = tau
            if size == len(ordered) or float(ordered[size]) <= low:
                out[tuple(index)] = (row - low).clamp_min(0) ** power
                break
    return out


@pytest.mark.parametrize("alpha", [1.5, 1.25, 2.0])
def test_entmax_matches_the_support_scan(alpha: float) -> None:
    z = torch.randn(2, 3, 7, dtype=torch.float64) * 3
    z[..., 5] = float("-inf")  # a masked key
    out = entmax(z, alpha, iterations=60)
    ref = entmax_by_support_scan(z, alpha)
    torch.testing.assert_close(out, ref, atol=1e-7, rtol=1e-7)
    assert (out == 0).any(), "entmax rows should be sparse for these scores"
    torch.testing.assert_close(out.sum(-1), torch.ones(2, 3, dtype=torch.float64))


@pytest.mark.parametrize("alpha", [1.5, 1.75])
def test_entmax_gradient_is_the_derivative(alpha: float) -> None:
    z = (torch.randn(2, 6, dtype=torch.float64) * 2).requires_grad_()
    assert torch.autograd.gradcheck(lambda x: entmax(x, alpha, iterations=80), (z,), atol=1e-5)


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_core_matches_the_quadratic_formula(causal: bool) -> None:
    core = make_core("entmax", causal, {"alpha": 1.5})
    q, k, v = random_qkv(2, 4, 12, 16, scale=2.0, kv_heads=2)
    out = core(q, k, v, causal=causal)
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    scores = q @ kk.transpose(-1, -2) / 4
    if causal:
        scores = scores.masked_fill(~torch.ones(12, 12, dtype=torch.bool).tril(), float("-inf"))
    ref = entmax_by_support_scan(scores, 1.5) @ vv
    torch.testing.assert_close(out, ref, atol=1e-7, rtol=1e-7)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(entmax(scores, 1.5) @ vv, (q, k, v), grad)  # through the exact sort above
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-7, rtol=1e-7)


def test_refuses_alpha_outside_one_to_two() -> None:
    with pytest.raises(ConfigError, match="alpha must be in"):
        make_core("entmax", False, {"alpha": 1.0})


@pytest.mark.parametrize("alpha", [1.5, 2.0])
def test_trains(alpha: float) -> None:
    assert_loss_falls("entmax", {"alpha": alpha})


def test_a_row_without_finite_scores_gives_nan_not_an_error() -> None:
    """A pipeline's shape pass may run the core on uninitialised (NaN) activations."""
    assert torch.isnan(entmax(torch.full((2, 5), float("nan")))).all()
