"""``xscale plan --calibrate OUT.yaml``: measure this machine and write it as a cluster file (:mod:`xscale.estimate.
cluster`'s format; the fits are :mod:`xscale.estimate.calibration`'s).

Measured in one run, every process with one thread (the planner's device is one process), every time on dedicated
cores (wall time less the run-queue wait, :mod:`xscale.bench.contention`: a shared machine's other jobs drop out):

* GEMM rates: ``torch.matmul`` of (rows x s) by (s x s), s the smallest dimension, in fp32 and bf16, best of
  several repeats per shape: the peak and the efficiency curve;
* memory bandwidth: ``Tensor.copy_`` of 64 MiB (bytes read + written), best of several;
* collectives over gloo, for 2..N local processes and several message sizes, the median of several rounds (a
  barrier before each call): ``all_reduce``, xscale's flat all-gather and reduce-scatter
  (:mod:`xscale.parallel.collectives`, what ZeRO uses), ``all_to_all_single`` and a send/recv between two ranks;
* the runtime's memory per process: the peak resident set, over the resident set after the imports, of a process
  that trains two steps of a model of a few thousand parameters with xscale's trainer (data-parallel over the run's
  processes: the process group, the data loader, the buckets' machinery), less that model's state;
* the concurrent devices: the CPU cores this process may run on (``os.sched_getaffinity``); the memory per device:
  the RAM over N processes.
"""

from __future__ import annotations

import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import yaml

from xscale.bench.contention import dedicated_seconds
from xscale.bench.memory import QUIET, peak_memory, reset_peak_memory
from xscale.commands.parity import PARITY_SETTINGS, run_local
from xscale.config.load import load_config_from_cli
from xscale.config.schema import Config
from xscale.estimate.calibration import CollectiveSample, calibrated_cluster
from xscale.estimate.measure import device_memory_bytes
from xscale.launcher.cpu_allocator import return_freed_memory
from xscale.models.parameters import count_parameters
from xscale.parallel.collectives import all_gather_flat, reduce_scatter_flat
from xscale.train.trainer import Trainer

GEMM_ROWS = 2048
GEMM_SIZES = (16, 32, 64, 128, 256, 512, 1024)
QUICK_GEMM_SIZES = (32, 128, 512)
MESSAGE_BYTES = (4096, 65536, 2**20, 8 * 2**20)
QUICK_MESSAGE_BYTES = (4096, 2**20)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# The runtime's memory: xscale's trainer on a model of a few thousand parameters (its tensors, 16 bytes per
# parameter with AdamW in fp32, taken off; the rest is the runtime's)
RUNTIME_MODEL = ["model.vocab_size=64", "model.d_model=16", "model.n_layers=1", "model.n_heads=2",
                 "train.seq_len=16", "data.dataset=copy", "data.num_samples=64",
                 "data.eval_fraction=0.0"]
RUNTIME_MODEL_BYTES_PER_PARAMETER = 16


def gemm_rate(size: int, dtype: torch.dtype, repeats: int) -> float:
    """Best FLOP/s of (GEMM_ROWS x size) @ (size x size) over ``repeats`` timed calls (after one warm-up)."""
    left, right = torch.randn(GEMM_ROWS, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    calls = max(1, int(2e8 // (2 * GEMM_ROWS * size * size)))  # ~0.2 GFLOP per timing: above the timer's noise
    torch.matmul(left, right)
    best = float("inf")
    for _ in range(repeats):
        _, seconds = dedicated_seconds(lambda: [torch.matmul(left, right) for _ in range(calls)])
        best = min(best, seconds / calls)
    return 2 * GEMM_ROWS * size * size / best


def memory_bandwidth(repeats: int) -> float:
    """Best bytes/s (read + written) of copying 64 MiB."""
    source, target = torch.randn(16 * 2**20), torch.empty(16 * 2**20)
    target.copy_(source)
    best = float("inf")
    for _ in range(repeats):
        best = min(best, dedicated_seconds(lambda: target.copy_(source))[1])
    return 2 * source.numel() * 4 / best


def _collective_calls(size_bytes: int, world: int, rank: int) -> dict[str, object]:
    """Each collective's call with the byte count the cost model takes (:class:`CollectiveSample`)."""
    elements = max(world, size_bytes // 4 // world * world)
    full, chunk, gathered = torch.randn(elements), torch.empty(elements // world), torch.empty(elements)
    send, receive = torch.randn(elements), torch.empty(elements)
    message = torch.randn(max(1, size_bytes // 4))

    def send_recv() -> None:
        if rank == 0:
            dist.send(message, 1)
        elif rank == 1:
            dist.recv(message, 0)

    calls = {"all_reduce": lambda: dist.all_reduce(full),
             "all_gather": lambda: all_gather_flat(gathered, chunk),
             "reduce_scatter": lambda: reduce_scatter_flat(chunk, full),
             "all_to_all": lambda: dist.all_to_all_single(receive, send)}
    if world == 2:
        calls["send_recv"] = send_recv
    return calls


def _rank_collectives(config: Config, sizes: list[int], rounds: int) -> dict:
    """On every rank of a local run: the runtime's memory (module docstring), then each collective's seconds
    per size, the median round (rank 0's figures are the ones kept)."""
    torch.set_num_threads(1)
    return_freed_memory()
    baseline = reset_peak_memory("cpu")
    trainer = Trainer(config)  # starts the process group
    for _ in range(2):
        trainer.train_step()
    runtime = peak_memory("cpu") - baseline - RUNTIME_MODEL_BYTES_PER_PARAMETER * count_parameters(config).total
    del trainer
    world, rank = dist.get_world_size(), dist.get_rank()
    samples = []
    for size in sizes:
        calls = _collective_calls(size, world, rank)
        for name, call in calls.items():
            seconds = []
            for index in range(rounds + 1):  # the first round warms up
                dist.barrier()
                _, elapsed = dedicated_seconds(call)
                if index:
                    seconds.append(elapsed)
            samples.append([name, world, float(size), statistics.median(seconds)])
    dist.barrier()
    dist.destroy_process_group()
    return {"runtime_memory": float(runtime), "samples": samples}


def measure_machine(processes: int, quick: bool) -> dict:
    """The cluster file's mapping of this machine at ``processes`` devices (module docstring)."""
    if processes < 2:
        raise ValueError(f"--processes must be at least 2 (collectives need two ranks), got {processes}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    repeats = 3 if quick else 5
    try:
        rates = {name: {size: gemm_rate(size, dtype, repeats) for size in (QUICK_GEMM_SIZES if quick else GEMM_SIZES)}
                 for name, dtype in DTYPES.items()}
        bandwidth = memory_bandwidth(repeats)
    finally:
        torch.set_num_threads(threads)
    sizes = list(QUICK_MESSAGE_BYTES if quick else MESSAGE_BYTES)
    samples, runtime = [], []
    for world in range(2, processes + 1):
        with tempfile.TemporaryDirectory(prefix="xscale-calibrate-") as scratch:
            config = load_config_from_cli(None, [*RUNTIME_MODEL, *PARITY_SETTINGS, *QUIET, "train.steps=3",
                                                 f"train.global_batch_size={2 * world}", f"train.output_dir={scratch}"])
            ranks = run_local(_rank_collectives, world, config, sizes, 3 if quick else 7)
        samples += [CollectiveSample(name, ranks_, size, seconds) for name, ranks_, size, seconds
                    in ranks[0]["samples"]]
        runtime += [rank["runtime_memory"] for rank in ranks]
    concurrent = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    memory, _ = device_memory_bytes(processes)
    source = f"{cpu_name()}, {concurrent} cores, torch {torch.__version__}"
    return calibrated_cluster(f"calibrated-{processes}proc", processes, concurrent, memory, bandwidth, rates, samples,
                              statistics.median(runtime), source)


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else the machine type."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next(line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


def write_calibration(path: str | Path, processes: int, quick: bool) -> dict:
    """Measure (:func:`measure_machine`) and write the cluster file with a header saying how; returns the mapping."""
    data = measure_machine(processes, quick)
    header = (f"# Written by xscale plan --calibrate --processes {processes}{' --quick' if quick else ''} "
              f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}); how each figure is measured: "
              "xscale/bench/calibrate.py, fitted by xscale/estimate/calibration.py.\n")
    Path(path).write_text(header + yaml.safe_dump(data, sort_keys=False, default_flow_style=None))
    return data
