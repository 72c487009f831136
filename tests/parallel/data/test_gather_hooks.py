"""The modules that wait for ZeRO-1/2's parameter all-gather in the next forward, and what each waits for."""

from __future__ import annotations

import torch
from torch import nn

from xscale.parallel.data.gather_hooks import install_gather_waits, waiting_modules


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(4)
        self.up = nn.Linear(4, 4)
        self.stacked = nn.Module()  # weights read by the block, never called (as stacked experts are)
        self.stacked.weight = nn.Parameter(torch.ones(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(self.norm(x)) @ self.stacked.weight


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({"0": Block(), "1": Block()})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers.values():
            x = block(x)
        return x


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))  # the root's own parameter
        self.embedding = nn.Embedding(8, 4)
        self.stack = Stack()
        self.head = nn.Linear(4, 8)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.stack(self.embedding(tokens) * self.scale))


def test_containers_wait_for_their_own_parameters_and_branches_for_all_beneath():
    model = Model()
    blocks = list(model.stack.layers.values())
    waiting = {module: recurse for module, recurse in waiting_modules([model], blocks)}
    assert waiting == {model: False, model.embedding: True, model.stack: False, model.stack.layers: False,
                       blocks[0]: True, blocks[1]: True, model.head: True}
    assert waiting_modules([model], []) == [(model, True)]  # no blocks known: the part waits for everything


def test_forward_waits_bucket_by_bucket_and_state_dicts_wait_for_all():
    model = Model()
    params = list(model.parameters())
    bucket_of = {id(param): index for index, param in enumerate(params)}  # a bucket per parameter, in order
    waits, finishes = [], []
    install_gather_waits([model], list(model.stack.layers.values()), bucket_of, waits.append,
                         lambda: finishes.append(True))
    model(torch.tensor([[1, 2]]))
    last = {name: bucket_of[id(param)] for name, param in model.named_parameters()}
    block0 = max(last[f"stack.layers.0.{name}"] for name in ("norm.weight", "norm.bias", "up.weight", "up.bias",
                                                             "stacked.weight"))
    block1 = max(value for name, value in last.items() if name.startswith("stack.layers.1."))
    assert waits == [last["scale"], last["embedding.weight"], block0, block1, last["head.bias"]]
    assert waits == sorted(waits)  # forward order is bucket order here: each wait overlaps the later transfers
    assert not finishes
    state = model.state_dict()
    assert finishes
    finishes.clear()
    model.load_state_dict(state)
    assert finishes
