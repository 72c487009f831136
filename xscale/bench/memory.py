"""``xscale bench memory``: each rank's predicted peak memory against the measured one, per layout.

Predicted: :func:`xscale.estimate.measure.rank_memory` (``xscale inspect --measure``): the model state from the ZeRO
formulas, activations from a fake-tensor step, ZeRO-3's gathered weights, the optimizer step's temporaries, tensor
parallelism's vocabulary-parallel loss, the pipeline's receive and send buffers and the last microbatch's backward with the
accumulated gradients (:mod:`xscale.estimate.memory`). Measured, in fresh local processes (one per rank) running ``--steps`` real
training steps (and with ``--checkpoint`` a save, then a resume in a new Trainer and one more step):

- on CPU, the peak resident set minus the process baseline. First the rank sets glibc's malloc to give every
  freed block above 64 KiB back to the kernel (:func:`~xscale.launcher.cpu_allocator.return_freed_memory`: the
  resident set then follows the live tensors) and warms the runtime up (:func:`warm_runtime`: the process group, the
  datasets, one all-reduce and one AdamW step of a tiny layer, so the thread pools, the collectives' and the
  kernels' own buffers exist); then, right before the Trainer builds the model, it resets the kernel's high-water
  mark (``5`` to ``/proc/self/clear_refs``) and reads ``VmRSS`` as the baseline; the peak is ``VmHWM`` after the
  last step;
- on CUDA, ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats`` at the same point.

The model state alone is measured right before each optimizer step (the unique bytes of parameters, gradients and
AdamW moments: :func:`xscale.estimate.memory.measured_state_bytes`) and compared with the formulas; ``largest p``
is the largest parameter this rank holds (under ZeRO-3, half the embedding at dp_shard=2: nothing whole).
"""

from __future__ import annotations

import gc
import sys
import tempfile
from pathlib import Path

import torch

from xscale.commands.parity import PARITY_SETTINGS, run_local, world_size_of
from xscale.commands.parser import CommandParser
from xscale.config.load import load_config_from_cli
from xscale.config.schema import Config, ConfigError
from xscale.data import build_datasets
from xscale.estimate.measure import MeasureError, rank_memory
from xscale.estimate.memory import measured_state_bytes
from xscale.launcher.cpu_allocator import return_freed_memory
from xscale.launcher.env import init_distributed
from xscale.parallel.checks import resolve_layout
from xscale.parallel.data import local_tensor
from xscale.train.optim import build_optimizer
from xscale.train.step import TRAINING_STEP
from xscale.train.trainer import Trainer

DEFAULT_LAYOUTS = ("single", "dp_shard=2,zero_stage=1", "dp_shard=2,zero_stage=3", "tp=2,dp_shard=1",
                   "pp=2,dp_shard=1")
LAYOUT_DEGREES = ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")
LAYOUT_SETTINGS = (*LAYOUT_DEGREES, "zero_stage", "microbatches", "pp_schedule", "pp_stages_per_rank",
                   "pp_vocab_parallel", "sequence_parallel", "activation_checkpointing")
# ~25M parameters (embedding and head 4M each, 4 blocks of 4.2M): the model state (~400 MiB on one process)
# dominates what a process holds besides it
MODEL = ["model.vocab_size=8192", "model.d_model=512", "model.n_layers=4", "model.n_heads=8",
         "model.tie_embeddings=false", "train.global_batch_size=8", "train.seq_len=128", "data.dataset=copy",
         "data.num_samples=256", "data.eval_fraction=0.0"]
QUIET = ("train.loggers=[]", "train.watchdog=false", "train.peak_flops=1.0e12", "checkpoint.async_save=false")


def layout_overrides(layout: str) -> list[str]:
    """``"tp=2,dp_shard=1"`` -> ``["parallel.tp=2", "parallel.dp_shard=1"]``; ``single`` -> []; anything else is a
    ConfigError naming the item and the settings a layout may set."""
    if layout in ("", "single"):
        return []
    overrides = []
    for item in layout.split(","):
        name, _, value = item.partition("=")
        if name.strip() not in LAYOUT_SETTINGS or not value:
            raise ConfigError(f"layout '{layout}': '{item}' is not name=value with name one of "
                              f"{', '.join(LAYOUT_SETTINGS)} (e.g. dp_shard=2,zero_stage=3), or 'single'")
        overrides.append(f"parallel.{name.strip()}={value.strip()}")
    return overrides


def _status(key: str) -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith(key))


def reset_peak_memory(device_type: str) -> int:
    """Reset the peak counter; return the baseline it is measured from (module docstring)."""
    if device_type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")
    return _status("VmRSS")


def peak_memory(device_type: str) -> int:
    """The peak since :func:`reset_peak_memory`: allocated bytes on CUDA, resident bytes (VmHWM) on CPU."""
    return torch.cuda.max_memory_allocated() if device_type == "cuda" else _status("VmHWM")


def warm_runtime(config: Config) -> None:
    """What any run allocates before its model exists (module docstring), so the baseline includes it."""
    init_distributed(config.parallel.backend, verbose=False)
    build_datasets(config)
    layer = torch.nn.Linear(64, 64)
    optimizer = build_optimizer(layer.parameters(), config.train)
    layer(torch.randn(8, 64)).square().mean().backward()
    optimizer.step()
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(torch.ones(1024))


def _steps(trainer: Trainer, steps: int, states: list[dict[str, int]]) -> None:
    """Train ``steps`` steps, recording the model state measured right before each optimizer step."""
    strategy = trainer.model.data_parallel
    step = strategy.optimizer_step

    def measured_step(optimizer: torch.optim.Optimizer) -> None:
        states.append(measured_state_bytes(trainer.model, optimizer))
        step(optimizer)

    strategy.optimizer_step = measured_step  # an instance attribute: this trainer only
    for _ in range(steps):
        trainer.train_step()


def _measure_rank(config: Config, steps: int, checkpoint: bool) -> dict[str, float]:
    """On every rank: peak bytes over the baseline, and the largest model state seen before an optimizer step."""
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if device_type == "cpu":
        return_freed_memory()
    warm_runtime(config)
    baseline = reset_peak_memory(device_type)
    states: list[dict[str, int]] = []
    trainer = Trainer(config)
    largest = max(local_tensor(param).numel() * param.element_size() for param in trainer.model.parameters())
    _steps(trainer, steps, states)
    if checkpoint:  # save, then resume in a new Trainer (the old one gone) and train one more step
        trainer.save()
        trainer.checkpointer.wait()
        trainer.prefetcher.close()
        trainer.lock.release()
        del trainer
        gc.collect()
        config.checkpoint.resume = "auto"
        trainer = Trainer(config)
        assert trainer.resume(), "the checkpoint just saved was not found"
        _steps(trainer, 1, states)
    state = max(states, key=lambda entry: sum(entry.values()))
    return {"peak": float(peak_memory(device_type) - baseline), "state": float(sum(state.values())),
            "largest_parameter": float(largest), **state}


def measure_layouts(config_path: str | None, overrides: list[str], layouts: list[str], steps: int,
                    checkpoint: bool) -> list[dict]:
    """One row per layout and distinct rank: predicted and measured peak and model state."""
    base = [*([] if config_path else MODEL), *PARITY_SETTINGS, *QUIET, *overrides, f"train.steps={steps + 1}"]
    plans = [(layout, layout_overrides(layout)) for layout in layouts]  # every layout checked before any runs
    rows = []
    with tempfile.TemporaryDirectory(prefix="xscale-bench-memory-") as scratch:
        for index, (layout, settings) in enumerate(plans):
            config = load_config_from_cli(config_path, [*base, *settings,
                                                        f"train.output_dir={Path(scratch) / str(index)}"])
            world_size = world_size_of(config)
            dims, config = resolve_layout(config, world_size)
            predicted = rank_memory(config, world_size, TRAINING_STEP)
            ranks = run_local(_measure_rank, world_size, config, steps, checkpoint)
            for rank, measured in enumerate(ranks):
                pp_rank = rank // (world_size // dims.pp)  # pp is the outermost mesh dimension
                rows.append({"layout": layout, "rank": rank, "predicted": predicted[pp_rank].peak,
                             "predicted_state": predicted[pp_rank].terms.model_state,
                             "terms": predicted[pp_rank].terms, **measured})
    return rows


def _mib(value: float) -> str:
    return f"{value / 2**20:,.1f}"


def report(rows: list[dict]) -> None:
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU, peak RSS over the baseline"
    print(f"memory per rank, MiB ({device}); predicted / measured")
    print(f"{'layout':<28} {'rank':>4} {'pred peak':>10} {'meas peak':>10} {'ratio':>6} {'pred state':>10} "
          f"{'meas state':>10} {'ratio':>6} {'largest p':>9}  predicted terms: activations, all-gather, step temporaries, vocab-parallel loss, "
          "pipeline buffers, last microbatch's backward, ZeRO-1/2 gather late in forward / at its start")
    for row in rows:
        terms = row["terms"]
        print(f"{row['layout']:<28} {row['rank']:>4} {_mib(row['predicted']):>10} {_mib(row['peak']):>10} "
              f"{row['predicted'] / row['peak']:>6.3f} {_mib(row['predicted_state']):>10} {_mib(row['state']):>10} "
              f"{row['predicted_state'] / row['state']:>6.3f} {_mib(row['largest_parameter']):>9}  {_mib(terms.activations)}, {_mib(terms.all_gather)}, "
              f"{_mib(terms.step_temporaries)}, {_mib(terms.vocab_parallel_loss)}, {_mib(terms.pipeline_buffers)}, "
              f"{_mib(terms.accumulated_backward)}, {_mib(terms.gather_in_forward)} / {_mib(terms.forward_start)}")


def main(argv: list[str] | None = None) -> int:
    parser = CommandParser(prog="xscale bench memory", description=__doc__.split("\n\n")[0])
    parser.add_argument("config", nargs="?", help="YAML config (default: a ~25M-parameter 4-layer decoder)")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--layouts", nargs="+", default=list(DEFAULT_LAYOUTS),
                        help="e.g. single dp_shard=2,zero_stage=3 tp=2,dp_shard=1")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--checkpoint", action="store_true",
                        help="after the steps: save, resume in a new Trainer and train one more step")
    args = parser.parse_args(argv)
    if args.config and "=" in args.config:  # overrides only: the default model
        args.config, args.overrides = None, [args.config, *args.overrides]
    if args.steps < 1:
        print(f"xscale bench memory: --steps {args.steps} must be at least 1", file=sys.stderr)
        return 2
    try:
        rows = measure_layouts(args.config, args.overrides, args.layouts, args.steps, args.checkpoint)
    except (ConfigError, MeasureError) as error:
        print(f"xscale bench memory: {error}", file=sys.stderr)
        return 2
    report(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
