"""skip_meta_init: a module built on the meta device runs no weight initialisation (torch 2.13's meta ``normal_``
imported torch._dynamo), and real tensors are initialised inside it as ever."""

import subprocess
import sys

import torch
from torch import nn

from xscale.runtime.meta_init import skip_meta_init


def test_real_tensors_are_still_initialised_inside():
    torch.manual_seed(0)
    with skip_meta_init():
        by_init, by_method, layer = nn.init.normal_(torch.zeros(4, 4)), torch.zeros(4, 4).normal_(), nn.Linear(4, 4)
    assert by_init.abs().sum() > 0 and by_method.abs().sum() > 0 and layer.weight.abs().sum() > 0


def test_meta_tensors_keep_their_shape():
    with torch.device("meta"), skip_meta_init():
        embedding = nn.Embedding(10, 4)
        tensor = torch.empty(3, 2).normal_()
    assert embedding.weight.is_meta and embedding.weight.shape == (10, 4) and tensor.shape == (3, 2)


def test_building_on_meta_imports_no_dynamo():
    code = ("import sys, torch\nfrom torch import nn\nfrom xscale.runtime.meta_init import skip_meta_init\n"
            "with torch.device('meta'), skip_meta_init():\n"
            "    nn.Embedding(10, 4); nn.init.normal_(torch.empty(2)); torch.empty(2).normal_(); nn.Linear(4, 4)\n"
            "print('torch._dynamo' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
