"""``xscale plan CONFIG --cluster FILE --devices N``: the fastest layouts that fit, before anything is launched.

Searches tp, pp (schedule, microbatches, interleaving), dp with its ZeRO stage, ep, cp and recomputation
(:mod:`xscale.estimate.search`), predicts each layout's step time and per-rank memory with the cost model
(:mod:`xscale.estimate.step_time`, docs/planning.md) and prints the best ones: memory per rank, the step split into
compute, exposed communication, pipeline bubble and optimizer, MFU, tokens/s and days to ``--tokens``. ``--emit OUT``
writes the first one as a config that ``xscale train OUT`` and ``xscale submit OUT`` run.

``xscale plan --calibrate OUT.yaml [--processes N] [--quick]`` measures this machine instead (GEMM rates, memory
bandwidth, gloo collectives over 2..N processes, the runtime's memory per process: :mod:`xscale.bench.calibrate`)
and writes it as a cluster file for ``--cluster``. With ``--device DEVICE --base CLUSTER.yaml`` it measures one
device instead (a GPU; the CPU for tests): GEMM rates, memory bandwidth and memory on the device
(:mod:`xscale.bench.device_calibration`), every other figure (links, devices per node, ...) taken from the base.
"""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import xscale.commands.registrations  # noqa: F401  (every layer's config checks and adapters)
from xscale.bench.calibrate import write_calibration
from xscale.bench.device_calibration import write_device_calibration
from xscale.commands.parser import CommandParser
from xscale.config.load import config_to_yaml, load_config_from_cli
from xscale.config.schema import Config, ConfigError
from xscale.data import with_resolved_vocab
from xscale.estimate.cluster import Cluster, load_cluster
from xscale.estimate.model_shape import model_shape
from xscale.estimate.search import Plan, search

SUFFIXES = {"": 1.0, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}


def parse_tokens(text: str) -> float:
    """``2e12``, ``300B``, ``1.4T`` -> tokens."""
    match = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([KMBGT]?)\s*", text, flags=re.IGNORECASE)
    if not match:
        raise ValueError(f"--tokens {text!r} is not a count of tokens (e.g. 2e12, 300B, 1.4T)")
    return float(match.group(1)) * SUFFIXES[match.group(2).upper()]


def _gib(value: float) -> str:
    return f"{value / 2**30:.1f} GiB"


def _format_count(tokens: float) -> str:
    for suffix, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6)):
        if tokens >= scale:
            return f"{tokens / scale:g}{suffix}"
    return f"{tokens:g}"


def plan_table(config_path: str, config: Config, cluster: Cluster, devices: int, plans: list[Plan],
               tokens: float) -> list[str]:
    """The header and one row per plan (what the command prints)."""
    width = max(len(plan.layout.describe()) for plan in plans)
    lines = [
        f"plan: {config_path} on {devices} x {cluster.name} ({cluster.devices_per_node} per node, "
        f"{_gib(cluster.memory_bytes)}, {cluster.peak_flops['bf16'] / 1e12:g} TFLOP/s bf16)",
        f"global batch {config.train.global_batch_size} x {config.train.seq_len} tokens; days to "
        f"{_format_count(tokens)} tokens",
        f"  #  {'layout':<{width}}  {'mem/rank':>9}  {'step s':>7}  {'compute':>7}  {'comm':>6}  {'bubble':>6}  "
        f"{'optim':>6}  {'MFU':>5}  {'tokens/s':>11}  {'days':>7}",
    ]
    for index, plan in enumerate(plans, 1):
        step = plan.step
        days = tokens / plan.tokens_per_s / 86400
        lines.append(
            f"  {index:>1}  {plan.layout.describe():<{width}}  {_gib(plan.peak_bytes):>9}  {step.total:>7.3f}  "
            f"{step.compute:>7.3f}  {step.exposed_communication:>6.3f}  {step.bubble:>6.3f}  {step.optimizer:>6.3f}  "
            f"{plan.mfu:>5.1%}  {plan.tokens_per_s:>11,.0f}  {days:>7.1f}")
    best = plans[0]
    exposed = ", ".join(f"{name} {seconds * 1e3:.1f} ms" for name, seconds in best.step.communication.items()
                        if seconds > 0)
    lines.append(f"first choice's exposed communication: {exposed or 'none'}")
    if devices > config.train.global_batch_size:
        lines.append(f"note: the global batch of {config.train.global_batch_size} sequences leaves at most that many "
                     f"data-parallel ranks, so model parallelism takes the rest of the {devices} devices; a larger "
                     f"train.global_batch_size uses them better")
    lines.append("run it: " + " ".join(f"{key}={_yaml_value(value)}" for key, value in best.overrides.items()))
    return lines


def _yaml_value(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def emitted_config(config: Config, cluster: Cluster, devices: int, plan: Plan) -> Config:
    """``config`` with the plan's layout and a launch section for ``devices`` devices of ``cluster``."""
    chosen = plan.layout.apply(config)
    per_node = min(devices, cluster.devices_per_node)
    chosen.launch.nodes = math.ceil(devices / per_node)
    chosen.launch.gpus_per_node = per_node if cluster.device == "gpu" else 0
    chosen.launch.nproc_per_node = per_node
    return chosen


def main(argv: list[str] | None = None) -> int:
    parser = CommandParser(prog="xscale plan", description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", help="YAML config of the model and the run (configs/*.yaml)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.global_batch_size=1024")
    parser.add_argument("--cluster", help="cluster file (configs/clusters/*.yaml)")
    parser.add_argument("--devices", type=int, help="devices to plan for")
    parser.add_argument("--tokens", default=None,
                        help="tokens to train on, for days (e.g. 2e12, 300B; default: the config's steps x batch)")
    parser.add_argument("--top", type=int, default=5, help="layouts to print (default 5)")
    parser.add_argument("--emit", default=None, metavar="OUT",
                        help="write the first layout as a config for xscale train / xscale submit")
    parser.add_argument("--calibrate", default=None, metavar="OUT",
                        help="measure this machine and write it as a cluster file (no config needed)")
    parser.add_argument("--processes", type=int, default=None,
                        help="--calibrate: collectives over 2..N processes (default 2)")
    parser.add_argument("--quick", action="store_true", help="--calibrate: fewer shapes, sizes and repeats")
    parser.add_argument("--device", default=None,
                        help="--calibrate: measure this torch device (cuda, cuda:1, cpu, ...) instead of the CPU "
                             "machine's processes; needs --base")
    parser.add_argument("--base", default=None, metavar="CLUSTER",
                        help="--calibrate --device: the cluster file whose other figures (links, ...) are kept")
    args = parser.parse_args(argv)
    if args.calibrate and (args.device is not None or args.base is not None):
        if args.processes is not None:
            print("xscale plan: --processes counts the CPU machine's processes; --calibrate --device measures one "
                  "device (its links come from --base): drop --processes", file=sys.stderr)
            return 2
        return _calibrate_device(args.calibrate, args.device, args.base, args.quick)
    if args.calibrate:
        return _calibrate(args.calibrate, 2 if args.processes is None else args.processes, args.quick)
    missing = [name for name, value in (("CONFIG", args.config), ("--cluster", args.cluster),
                                        ("--devices", args.devices)) if value is None]
    if missing:
        print(f"xscale plan: {', '.join(missing)} missing: xscale plan CONFIG --cluster FILE --devices N "
              f"(or xscale plan --calibrate OUT.yaml)", file=sys.stderr)
        return 2
    try:
        if args.top < 1:
            raise ValueError(f"--top must be at least 1, got {args.top}")
        cluster = load_cluster(args.cluster)
        config = with_resolved_vocab(load_config_from_cli(args.config, args.overrides))
        tokens = (parse_tokens(args.tokens) if args.tokens is not None
                  else float(config.train.steps * config.train.global_batch_size * config.train.seq_len))
        plans = search(model_shape(config), cluster, args.devices, args.top)
    except (ConfigError, ValueError) as error:
        print(f"xscale plan: {error}", file=sys.stderr)
        return 2
    print("\n".join(plan_table(args.config, config, cluster, args.devices, plans, tokens)))
    if args.emit:
        Path(args.emit).write_text(f"# xscale plan {args.config} --cluster {args.cluster} --devices {args.devices}\n"
                                   + config_to_yaml(emitted_config(config, cluster, args.devices, plans[0])))
        print(f"wrote {args.emit}: xscale train {args.emit} | xscale submit {args.emit}")
    return 0


def _calibrate(path: str, processes: int, quick: bool) -> int:
    try:
        data = write_calibration(path, processes, quick)
        load_cluster(path)  # what was written reads back
    except (ConfigError, ValueError, OSError) as error:
        print(f"xscale plan --calibrate: {error}", file=sys.stderr)
        return 2
    links = data["links"]["intra_node"]
    print(f"wrote {path}: {data['devices_per_node']} processes, {data['concurrent_devices']} cores; peak "
          f"{data['peak_tflops']['fp32'] * 1e3:.1f} GFLOP/s fp32, {data['peak_tflops']['bf16'] * 1e3:.1f} bf16; "
          f"memory {data['memory_bandwidth_gbs']:.1f} GB/s; runtime {data['runtime_memory_mib']:.1f} MiB per process")
    for name, figures in links.items():
        print(f"  {name:<15} latency {figures['latency_us']:9.1f} us per step, bus bandwidth "
              f"{figures['bandwidth_gbs']:.3f} GB/s")
    for name, figures in data.get("tensor_parallel", {}).items():
        print(f"  tp {name:<12} latency {figures['latency_us']:9.1f} us per step, bus bandwidth "
              f"{figures['bandwidth_gbs']:.3f} GB/s (DTensor's redistribution)")
    if "elementwise_bandwidth_gbs" in data:
        print(f"  framework: elementwise {data['elementwise_bandwidth_gbs']:.2f} GB/s, loss "
              f"{data['loss_ns_per_logit']:.2f} ns per logit, dispatch {data['block_overhead_us']:.0f} us per block "
              f"and {data['step_overhead_ms']:.2f} ms per step")
    if "attention_efficiency" in data:
        fractions = [fraction for _, _, fraction in data["attention_efficiency"]]
        print(f"  attention core (SDPA, causal): {min(fractions):.0%}-{max(fractions):.0%} of the fp32 peak over "
              f"head dims {sorted({dim for dim, _, _ in data['attention_efficiency']})}")
    return 0


def _calibrate_device(path: str, device: str | None, base: str | None, quick: bool) -> int:
    if device is None or base is None:
        print(f"xscale plan --calibrate: {'--device' if device is None else '--base'} missing: "
              "xscale plan --calibrate OUT.yaml --device DEVICE --base CLUSTER.yaml "
              "(e.g. --device cuda --base configs/clusters/h200-ib.yaml)", file=sys.stderr)
        return 2
    try:
        data, header = write_device_calibration(path, device, base, quick)
        load_cluster(path)  # what was written reads back
    except (ConfigError, ValueError, OSError) as error:
        print(f"xscale plan --calibrate: {error}", file=sys.stderr)
        return 2
    print(f"wrote {path}: {data['measured_on']}; peak {data['peak_tflops']['bf16']:.4g} TFLOP/s bf16, "
          f"{data['peak_tflops']['fp32']:.4g} fp32; memory {data['memory_gib']:.1f} GiB at "
          f"{data['memory_bandwidth_gbs']:.1f} GB/s; links and the rest from {base}")
    print("\n".join("  " + line.removeprefix("# ") for line in header.splitlines()))
    return 0
