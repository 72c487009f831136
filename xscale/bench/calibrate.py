"""``xscale plan --calibrate OUT.yaml``: measure this machine and write it as a cluster file (:mod:`xscale.estimate.
cluster`'s format; the fits are :mod:`xscale.estimate.calibration`'s).

Measured in one run, every process with one thread (the planner's device is one process), every time on dedicated
cores (wall time less the run-queue wait, :mod:`xscale.bench.contention`: a shared machine's other jobs drop out):

* GEMM rates: ``torch.matmul`` of (rows x s) by (s x s), s the smallest dimension, in fp32 and bf16, best of
  several repeats per shape: the peak and the efficiency curve;
* the attention core: ``scaled_dot_product_attention`` (causal, forward + backward) in fp32 over a grid of head
  dimensions and sequence lengths T (4096 tokens, 8 heads), best of several repeats, at the FLOPs the cost model
  counts (3 x 4 t keys d, keys = (T + 1) / 2): its share of the fp32 peak (``attention_efficiency``);
* memory bandwidth: ``Tensor.copy_`` of 64 MiB (bytes read + written), best of several;
* collectives over gloo, for 2..N local processes and several message sizes, the median of several rounds (a
  barrier before each call): ``all_reduce``, xscale's flat all-gather and reduce-scatter
  (:mod:`xscale.parallel.collectives`, what ZeRO uses), ``all_to_all_single`` and a send/recv between two ranks;
* the runtime's memory per process: the peak resident set, over the resident set after the imports, of a process
  that trains two steps of a model of a few thousand parameters with xscale's trainer (data-parallel over the run's
  processes: the process group, the data loader, the buckets' machinery), less that model's state;
* the concurrent devices: the CPU cores this process may run on (``os.sched_getaffinity``); the memory per device:
  the RAM over N processes;
* the framework's own costs (:mod:`xscale.estimate.overheads`, fitted by :mod:`xscale.estimate.calibration`):
  forward + backward of a chain of eager RMSNorm, SiLU gate, residual add and softmax over (rows x 512) fp32
  activations for several row counts, with the bytes autograd saves for backward (the elementwise bandwidth);
  xscale's fused linear cross-entropy over 2048 tokens x 4096 logits of width 16 (per logit, its three GEMMs timed
  alone on the same shapes taken off); the trainer's step of a model whose tensors are a few KiB at 1 and 3 blocks, one process
  (dispatch per block and per step); and tensor parallelism's redistributions (DTensor Partial -> Replicate,
  Shard -> Replicate, Partial -> Shard over all the run's ranks, the collectives' sizes) beside the collectives;
* the collectives' working buffers: the peak resident set that a first all-reduce, all-gather and reduce-scatter
  of a 4 MiB message (the default gradient bucket) adds on each rank, per byte of the message (the median over
  ranks and process counts; :mod:`xscale.estimate.collective_memory`).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from xscale.bench.contention import dedicated_seconds
from xscale.bench.memory import QUIET, peak_memory, reset_peak_memory
from xscale.commands.parity import PARITY_SETTINGS, run_local
from xscale.config.load import load_config_from_cli
from xscale.config.schema import Config
from xscale.estimate.calibration import (
    CollectiveSample,
    FrameworkCosts,
    calibrated_cluster,
    fit_dispatch,
    fit_elementwise_bandwidth,
    loss_seconds_per_logit,
)
from xscale.estimate.cluster import TENSOR_PARALLEL_COLLECTIVES
from xscale.estimate.measure import device_memory_bytes
from xscale.launcher.cpu_allocator import return_freed_memory
from xscale.models.parameters import count_parameters
from xscale.ops.functional import linear_cross_entropy_sum
from xscale.parallel.collectives import all_gather_flat, reduce_scatter_flat
from xscale.train.peak_flops import cpu_model
from xscale.train.trainer import Trainer

GEMM_ROWS = 2048
GEMM_SIZES = (16, 32, 64, 128, 256, 512, 1024)
QUICK_GEMM_SIZES = (32, 128, 512)
ATTENTION_HEAD_DIMS, ATTENTION_LENGTHS = (16, 32, 64, 128), (128, 256, 512, 1024)
QUICK_ATTENTION_HEAD_DIMS, QUICK_ATTENTION_LENGTHS = (32, 128), (128, 1024)
ATTENTION_TOKENS, ATTENTION_HEADS = 4096, 8
MESSAGE_BYTES = (4096, 65536, 2**20, 8 * 2**20)
QUICK_MESSAGE_BYTES = (4096, 2**20)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# The runtime's memory: xscale's trainer on a model of a few thousand parameters (its tensors, 16 bytes per
# parameter with AdamW in fp32, taken off; the rest is the runtime's)
RUNTIME_MODEL = ["model.vocab_size=64", "model.d_model=16", "model.n_layers=1", "model.n_heads=2",
                 "train.seq_len=16", "data.dataset=copy", "data.num_samples=64",
                 "data.eval_fraction=0.0"]
RUNTIME_MODEL_BYTES_PER_PARAMETER = 16
ELEMENTWISE_WIDTH = 512
ELEMENTWISE_ROWS = (256, 1024, 4096)
QUICK_ELEMENTWISE_ROWS = (256, 2048)
LOSS_TOKENS, LOSS_VOCAB, LOSS_WIDTH = 2048, 4096, 16
DISPATCH_DEPTHS = (1, 3)
DISPATCH_STEPS = 7
BUFFER_PROBE_BYTES = 4 * 2**20
TENSOR_PARALLEL_WIDTH = 256  # the redistributed activations are (1, rows, width): Shard(1) splits the rows


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


def attention_flops(tokens: int, length: int, width: int) -> float:
    """The cost model's FLOPs of a causal attention core's forward + backward over ``tokens`` in sequences of
    ``length`` and ``width`` = heads x head dim (:mod:`~xscale.estimate.step_time`): 3 x 4 t keys d."""
    return 3 * 4 * tokens * (length + 1) / 2 * width


def attention_step(head_dim: int, length: int, tokens: int = ATTENTION_TOKENS, heads: int = ATTENTION_HEADS,
                   device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> tuple[object, float]:
    """(a call running causal SDPA forward + backward on (tokens / T, heads, T, head_dim), its
    :func:`attention_flops`)."""
    shape = (max(1, tokens // length), heads, length, head_dim)
    query, key, value = (torch.randn(shape, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    upstream = torch.randn(shape, device=device, dtype=dtype)

    def step() -> None:  # gradients returned, not accumulated into .grad (an add a training step does not pay)
        torch.autograd.grad(F.scaled_dot_product_attention(query, key, value, is_causal=True), (query, key, value),
                            upstream)

    return step, attention_flops(shape[0] * length, length, heads * head_dim)


def attention_rate(head_dim: int, length: int, repeats: int) -> float:
    """Best FLOP/s (:func:`attention_flops`) of causal SDPA forward + backward, fp32, (4096 / T, 8, T, head_dim)."""
    step, flops = attention_step(head_dim, length)
    step()
    return flops / min(dedicated_seconds(step)[1] for _ in range(repeats))


def memory_bandwidth(repeats: int) -> float:
    """Best bytes/s (read + written) of copying 64 MiB."""
    source, target = torch.randn(16 * 2**20), torch.empty(16 * 2**20)
    target.copy_(source)
    best = float("inf")
    for _ in range(repeats):
        best = min(best, dedicated_seconds(lambda: target.copy_(source))[1])
    return 2 * source.numel() * 4 / best


def _elementwise_chain(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A block's memory-bound ops in a row: RMSNorm, a SiLU gate, a residual add, a softmax."""
    normed = F.rms_norm(x, (x.shape[-1],), weight)
    return torch.softmax(x + F.silu(normed) * normed, dim=-1)


def elementwise_sample(rows: int, repeats: int) -> tuple[float, float]:
    """(bytes autograd saves, best forward + backward seconds) of :func:`_elementwise_chain` on (rows x 512)."""
    x = torch.randn(rows, ELEMENTWISE_WIDTH, requires_grad=True)
    weight = torch.ones(ELEMENTWISE_WIDTH, requires_grad=True)
    upstream = torch.randn(rows, ELEMENTWISE_WIDTH)
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        _elementwise_chain(x, weight).backward(upstream)
    best = min(dedicated_seconds(lambda: _elementwise_chain(x, weight).backward(upstream))[1] for _ in range(repeats))
    return float(sum(saved.values())), best


def loss_sample(repeats: int) -> tuple[float, float]:
    """Best forward + backward seconds of the fused linear cross-entropy over LOSS_TOKENS x LOSS_VOCAB logits, and
    of its three GEMMs alone (logits, gradient of the hidden states, gradient of the weight)."""
    hidden = torch.randn(LOSS_TOKENS, LOSS_WIDTH, requires_grad=True)
    weight = torch.randn(LOSS_VOCAB, LOSS_WIDTH, requires_grad=True)
    labels = torch.randint(0, LOSS_VOCAB, (LOSS_TOKENS,))
    gradient = torch.randn(LOSS_TOKENS, LOSS_VOCAB)

    def gemms() -> None:
        with torch.no_grad():
            hidden @ weight.t(), gradient @ weight, gradient.t() @ hidden

    linear_cross_entropy_sum(hidden, weight, labels).backward()
    gemms()
    loss = min(dedicated_seconds(lambda: linear_cross_entropy_sum(hidden, weight, labels).backward())[1]
               for _ in range(repeats))
    return loss, min(dedicated_seconds(gemms)[1] for _ in range(repeats))


def _rank_dispatch(config: Config, steps: int) -> float:
    """The median step seconds (dedicated cores) of the trainer on ``config``, one thread."""
    torch.set_num_threads(1)
    trainer = Trainer(config)
    for _ in range(2):
        trainer.train_step()
    return statistics.median(dedicated_seconds(trainer.train_step)[1] for _ in range(steps))


def dispatch_samples(steps: int) -> dict[int, float]:
    """The tiny model's step seconds at each of DISPATCH_DEPTHS blocks, one process each."""
    seconds = {}
    for depth in DISPATCH_DEPTHS:
        with tempfile.TemporaryDirectory(prefix="xscale-calibrate-") as scratch:
            config = load_config_from_cli(None, [*RUNTIME_MODEL, *PARITY_SETTINGS, *QUIET, f"model.n_layers={depth}",
                                                 f"train.steps={steps + 3}", "train.global_batch_size=2",
                                                 f"train.output_dir={scratch}"])
            seconds[depth] = run_local(_rank_dispatch, 1, config, steps)[0]
    return seconds


def _tensor_parallel_calls(size_bytes: int, world: int) -> tuple[int, dict[str, object]]:
    """(the bytes, each redistribution) of tensor parallelism over all ``world`` ranks (module docstring)."""
    mesh = init_device_mesh("cpu", (world,))
    rows = max(world, size_bytes // 4 // TENSOR_PARALLEL_WIDTH // world * world)
    full = torch.randn(1, rows, TENSOR_PARALLEL_WIDTH)
    partial = DTensor.from_local(full, mesh, [Partial()])
    shard = DTensor.from_local(full[:, : rows // world].clone(), mesh, [Shard(1)])
    return full.numel() * 4, {"all_reduce": lambda: partial.redistribute(mesh, [Replicate()]).to_local(),
                              "all_gather": lambda: shard.redistribute(mesh, [Replicate()]).to_local(),
                              "reduce_scatter": lambda: partial.redistribute(mesh, [Shard(1)]).to_local()}


def _median_call(call: object, rounds: int) -> float:
    """The median dedicated seconds of ``rounds`` calls (a barrier before each; one more first, to warm up)."""
    seconds = []
    for index in range(rounds + 1):
        dist.barrier()
        _, elapsed = dedicated_seconds(call)
        if index:
            seconds.append(elapsed)
    return statistics.median(seconds)


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
    buffers = {}
    for name, call in _collective_calls(BUFFER_PROBE_BYTES, world, rank).items():
        if name in TENSOR_PARALLEL_COLLECTIVES:  # a first call of its size: the buffers it allocates
            dist.barrier()
            return_freed_memory()
            before = reset_peak_memory("cpu")
            call()
            buffers[name] = (peak_memory("cpu") - before) / BUFFER_PROBE_BYTES
    samples, tensor_parallel = [], []
    for size in sizes:
        for name, call in _collective_calls(size, world, rank).items():
            samples.append([name, world, float(size), _median_call(call, rounds)])
        moved, calls = _tensor_parallel_calls(size, world)
        for name, call in calls.items():
            tensor_parallel.append([name, world, float(moved), _median_call(call, rounds)])
    dist.barrier()
    dist.destroy_process_group()
    return {"runtime_memory": float(runtime), "samples": samples, "tensor_parallel": tensor_parallel,
            "buffers": buffers}


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
        attention = [(head_dim, (length + 1) / 2, attention_rate(head_dim, length, repeats))
                     for head_dim in (QUICK_ATTENTION_HEAD_DIMS if quick else ATTENTION_HEAD_DIMS)
                     for length in (QUICK_ATTENTION_LENGTHS if quick else ATTENTION_LENGTHS)]
        bandwidth = memory_bandwidth(repeats)
        elementwise = [elementwise_sample(rows, repeats)
                       for rows in (QUICK_ELEMENTWISE_ROWS if quick else ELEMENTWISE_ROWS)]
        loss_seconds, loss_gemm_seconds = loss_sample(repeats)
    finally:
        torch.set_num_threads(threads)
    dispatch = dispatch_samples(3 if quick else DISPATCH_STEPS)
    sizes = list(QUICK_MESSAGE_BYTES if quick else MESSAGE_BYTES)
    samples, runtime, tensor_parallel, buffers = [], [], [], []
    for world in range(2, processes + 1):
        with tempfile.TemporaryDirectory(prefix="xscale-calibrate-") as scratch:
            config = load_config_from_cli(None, [*RUNTIME_MODEL, *PARITY_SETTINGS, *QUIET, "train.steps=3",
                                                 f"train.global_batch_size={2 * world}", f"train.output_dir={scratch}"])
            ranks = run_local(_rank_collectives, world, config, sizes, 3 if quick else 7)
        samples += [CollectiveSample(name, ranks_, size, seconds) for name, ranks_, size, seconds
                    in ranks[0]["samples"]]
        tensor_parallel += [CollectiveSample(name, ranks_, size, seconds) for name, ranks_, size, seconds
                            in ranks[0]["tensor_parallel"]]
        runtime += [rank["runtime_memory"] for rank in ranks]
        buffers += [rank["buffers"] for rank in ranks]
    concurrent = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    memory, _ = device_memory_bytes(processes)
    source = f"{cpu_name()}, {concurrent} cores, torch {torch.__version__}"
    framework = FrameworkCosts(fit_elementwise_bandwidth(elementwise)[1],
                               loss_seconds_per_logit(loss_seconds, loss_gemm_seconds, LOSS_TOKENS * LOSS_VOCAB),
                               *fit_dispatch(dispatch), tuple(tensor_parallel))
    collective_buffers = {name: round(max(0.0, statistics.median(rank[name] for rank in buffers)), 4)
                          for name in TENSOR_PARALLEL_COLLECTIVES}
    return calibrated_cluster(f"calibrated-{processes}proc", processes, concurrent, memory, bandwidth, rates, samples,
                              statistics.median(runtime), source, framework, collective_buffers, attention)


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else the machine type (:func:`xscale.train.peak_flops.cpu_model`)."""
    return cpu_model()


def write_calibration(path: str | Path, processes: int, quick: bool) -> dict:
    """Measure (:func:`measure_machine`) and write the cluster file with a header saying how; returns the mapping."""
    data = measure_machine(processes, quick)
    header = (f"# Written by xscale plan --calibrate --processes {processes}{' --quick' if quick else ''} "
              f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}); how each figure is measured: "
              "xscale/bench/calibrate.py, fitted by xscale/estimate/calibration.py.\n")
    Path(path).write_text(header + yaml.safe_dump(data, sort_keys=False, default_flow_style=None))
    return data
