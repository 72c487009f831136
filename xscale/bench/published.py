"""``xscale bench published``: the planner's predictions for published large-scale training runs against the
figures their papers report (docs/planning.md, "Against published runs").

Nothing here is fitted to these figures: the hardware is the datasheet preset (``configs/clusters/a100-ib.yaml``),
the model its published shape, the batch its published one. Two kinds of figure:

* Megatron-LM's Table 1 (Narayanan et al. 2021, SC21), TFLOP/s per GPU counted their way (sec. 5.1, with full
  recomputation): F = 96 B s l h^2 (1 + s / (6 h) + V / (16 l h)) per iteration. The prediction: the fastest layout
  the planner finds with the paper's tp and pp and its schedules (1F1B, interleaved 1F1B), no ZeRO, full
  recomputation, no sequence parallelism (later work);
  F over its predicted step time and the GPUs.
* Tokens/s per GPU: LLaMA-65B (Touvron et al. 2023a, sec. 2.4: "around 380 tokens/sec/GPU on 2048 A100 GPU with
  80GB of RAM"), and Llama 2's 7B and 70B (Touvron et al. 2023b, Table 2: 184,320 and 1,720,320 GPU hours for
  2.0T tokens, so the average over the whole run, restarts included). The prediction: the planner's first choice
  on the same GPU count (Llama 2 does not give one: 2048 assumed, LLaMA-65B's).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from xscale.commands.parser import CommandParser
from xscale.config.load import load_config
from xscale.estimate.cluster import load_cluster
from xscale.estimate.layout import Layout
from xscale.estimate.model_shape import model_shape
from xscale.estimate.search import Planner, candidate_layouts, search

A100 = "configs/clusters/a100-ib.yaml"
GPT = "configs/gpt3-175b.yaml"
LLAMA = "configs/llama2-7b.yaml"
PUBLISHED_SCHEDULES = ("1f1b", "interleaved_1f1b")  # the pipeline schedules of Narayanan et al. 2021


@dataclass(frozen=True)
class PublishedRun:
    """One published run: its model (a config and overrides), GPUs, the published tp/pp (None: the planner's
    choice), the reported figure and what it measures (``tflops``: Megatron's count per GPU, ``tokens``: tokens/s
    per GPU), and the source."""

    name: str
    config: str
    overrides: tuple[str, ...]
    gpus: int
    reported: float
    kind: str
    source: str
    tp: int | None = None
    pp: int | None = None


def _gpt(heads: int, hidden: int, layers: int, batch: int) -> tuple[str, ...]:
    return (f"model.n_heads={heads}", f"model.d_model={hidden}", f"model.n_layers={layers}",
            f"train.global_batch_size={batch}")


def _llama(heads: int, kv_heads: int, hidden: int, layers: int, ffn: int, seq: int, batch: int) -> tuple[str, ...]:
    return (f"model.n_heads={heads}", f"model.n_kv_heads={kv_heads}", f"model.d_model={hidden}",
            f"model.n_layers={layers}", f"model.d_ff={ffn}", f"model.max_seq_len={seq}", f"train.seq_len={seq}",
            f"train.global_batch_size={batch}")


MEGATRON = "Narayanan et al. 2021, Table 1"
RUNS = (
    PublishedRun("GPT 1.7B (Megatron-LM)", GPT, _gpt(24, 2304, 24, 512), 32, 137, "tflops", MEGATRON, 1, 1),
    PublishedRun("GPT 18.4B (Megatron-LM)", GPT, _gpt(48, 6144, 40, 1024), 256, 135, "tflops", MEGATRON, 8, 1),
    PublishedRun("GPT 39.1B (Megatron-LM)", GPT, _gpt(64, 8192, 48, 1536), 512, 138, "tflops", MEGATRON, 8, 2),
    PublishedRun("GPT 145.6B (Megatron-LM)", GPT, _gpt(96, 12288, 80, 2304), 1536, 148, "tflops", MEGATRON, 8, 8),
    PublishedRun("GPT 1T (Megatron-LM)", GPT, _gpt(160, 25600, 128, 3072), 3072, 163, "tflops", MEGATRON, 8, 64),
    PublishedRun("LLaMA-65B", LLAMA, _llama(64, 64, 8192, 80, 22016, 2048, 2048), 2048, 380, "tokens",
                 "Touvron et al. 2023a, sec. 2.4"),
    PublishedRun("Llama 2 7B", LLAMA, _llama(32, 32, 4096, 32, 11008, 4096, 1024), 2048,
                 2.0e12 / (184_320 * 3600), "tokens", "Touvron et al. 2023b, Table 2 (GPU hours)"),
    PublishedRun("Llama 2 70B", LLAMA, _llama(64, 8, 8192, 80, 28672, 4096, 1024), 2048,
                 2.0e12 / (1_720_320 * 3600), "tokens", "Touvron et al. 2023b, Table 2 (GPU hours)"),
)


def megatron_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """FLOPs of one iteration as Narayanan et al. 2021 count them (sec. 5.1, with recomputation)."""
    return 96 * batch * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))


def predict(run: PublishedRun, cluster_path: str = A100) -> dict:
    """The planner's prediction of ``run`` in the run's own unit, with the layout it took (module docstring)."""
    cluster = load_cluster(cluster_path)
    config = load_config(run.config, list(run.overrides))
    shape = model_shape(config)
    if run.tp is None:
        plan = search(shape, cluster, run.gpus, top=1)[0]
    else:
        planner = Planner(shape, cluster, run.gpus)
        plans = [planner.predict(Layout(**{**layout.__dict__, "zero_stage": 0, "sequence_parallel": False,
                                           "checkpointing": "full"}))
                 for layout in candidate_layouts(shape, cluster, run.gpus)
                 if layout.tp == run.tp and layout.pp == run.pp and layout.cp == 1 and layout.zero_stage == 0
                 and layout.schedule in PUBLISHED_SCHEDULES]
        plan = max(plans, key=lambda plan: plan.tokens_per_s)
    if run.kind == "tflops":
        model = config.model
        predicted = megatron_flops(config.train.global_batch_size, config.train.seq_len, model.n_layers,
                                   model.d_model, model.vocab_size) / plan.step.total / run.gpus / 1e12
    else:
        predicted = plan.tokens_per_s / run.gpus
    return {"run": run, "predicted": predicted, "error": predicted / run.reported - 1, "plan": plan}


def main(argv: list[str] | None = None) -> int:
    parser = CommandParser(prog="xscale bench published", description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", default=A100, help=f"cluster file (default {A100})")
    args = parser.parse_args(argv)
    print(f"{'run':<26} {'GPUs':>5} {'unit':<17} {'reported':>9} {'predicted':>9} {'error':>6}  layout (predicted MFU)"
          f"  source")
    for run in RUNS:
        row = predict(run, args.cluster)
        unit = "TFLOP/s/GPU (Meg.)" if run.kind == "tflops" else "tokens/s/GPU"
        plan = row["plan"]
        print(f"{run.name:<26} {run.gpus:>5} {unit:<17} {run.reported:>9,.0f} {row['predicted']:>9,.0f} "
              f"{row['error']:>+6.0%}  {plan.layout.describe()} ({plan.mfu:.0%})  {run.source}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
