"""ScaleNorm's gain g (Nguyen & Salazar 2019) is a [1] tensor, so ZeRO-3 (FSDP2) shards it; the 0-d gain of
earlier versions loads through load_state_dict, and their checkpoints are refused with a message that says why."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from xscale.checkpoint.checkpointer import CheckpointError, check_fingerprint
from xscale.commands.parity import run_local
from xscale.config.schema import ModelConfig
from xscale.models import build_model
from xscale.models.norm import ScaleNorm


def _fully_shard_scalenorm_model() -> list[float]:
    """One process: a ScaleNorm model under FSDP2's fully_shard trains a step (the gains receive gradients)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (1,))
    model = build_model(ModelConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2, norm="scalenorm"), seed=0)
    for block in model.stack.blocks():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model(torch.randint(0, 32, (2, 8))).float().pow(2).mean().backward()
    return [float(module.scale.grad.full_tensor().abs().sum()) for module in model.modules()
            if isinstance(module, ScaleNorm)]


def test_scalenorm_gain_is_sharded_by_fully_shard():
    (gains,) = run_local(_fully_shard_scalenorm_model, 1)
    assert len(gains) >= 4 and all(g > 0 for g in gains), gains


def test_scalenorm_loads_the_0d_gain_of_earlier_versions():
    norm = ScaleNorm(8)
    assert norm.scale.shape == (1,)
    norm.load_state_dict({"scale": torch.tensor(1.5)})
    x = torch.randn(3, 8)
    torch.testing.assert_close(norm(x), 1.5 * x / x.norm(dim=-1, keepdim=True))


def test_checkpoint_with_the_0d_gain_is_refused_with_the_reason():
    with pytest.raises(CheckpointError, match="ScaleNorm's gain"):
        check_fingerprint({"stack.layers.0.norm1.scale": []}, {"stack.layers.0.norm1.scale": [1]}, Path("ckpt"))
