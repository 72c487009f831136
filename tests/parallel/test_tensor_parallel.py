"""Tensor (and sequence) parallelism, tp=2 over gloo, fp32: losses, every gradient and a few AdamW steps
equal the single-process model built from the same config and seed.

Two worker ranks live for the whole module (starting them costs more than most cases); each test sends
them a case by name. A rank records mismatches and reports them after the case, so a failing comparison
never leaves the other rank waiting in a collective.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import queue
import tempfile
import traceback

import pytest
import torch
import torch.distributed as dist
from spawned import spawn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard

from xscale.config.schema import AttentionConfig, ConfigError, ModelConfig, MoEConfig
from xscale.launcher.local import local_context
from xscale.models import build_model
from xscale.models.init import init_weights
from xscale.models.registry import ATTENTION
from xscale.models.traits import ParallelTraits
from xscale.parallel.loss import model_loss_sum
from xscale.parallel.tensor import apply_tensor_parallel, check_tensor_parallel, tensor_parallel_context
from xscale.runtime import StepContext

WORLD = 2
SEED = 3
BATCH, LENGTH = 2, 16
LOSS_RTOL, GRAD_ATOL = 1e-5, 1e-5
# AdamW divides each update by sqrt(v) + eps: with the default eps=1e-8 an element whose gradient is fp32
# rounding noise (~1e-9 here, with different noise on each side) moves by a different fraction of lr.
# BERT's eps=1e-6 keeps such elements still, so parameters after the steps can be held to 1e-5 too.
LR, ADAM_EPS = 1e-3, 1e-6
PARAM_ATOL = 1e-5
CASE_TIMEOUT_S = 120

SMALL = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=32)
DECODER = dict(SMALL, position="rope", ffn="swiglu", norm="rmsnorm", n_kv_heads=2)
BERT = dict(SMALL, family="encoder", position="learned", norm="layernorm", norm_placement="post",
            embedding_norm=True, ffn="gelu", bias=True, lm_head_transform=True, lm_head_bias=True)
T5 = dict(SMALL, family="encoder_decoder", position="t5_bias", ffn="relu", n_decoder_layers=2)
ATTENTION_OPTIONS = {"block_size": 4, "window": 4, "global_tokens": 2, "random_blocks": 1, "chunk": 4,
                     "features": 16, "buckets": 4, "rounds": 2, "landmarks": 4, "projected_length": 8}
# configs/tiny-switch.yaml's model, narrower and shorter.
SWITCH = dict(SMALL, n_layers=4, position="rope", norm="rmsnorm", ffn="gelu", d_ff=64,
              moe=MoEConfig(num_experts=8, router="switch", top_k=1, every=2, capacity_factor=1.25,
                            eval_capacity_factor=2.0, min_capacity=4, aux_loss_coef=0.01, z_loss_coef=0.001))


def attention_model(kind: str, family: str, **options) -> dict:
    return dict(SMALL, family=family, position="rope" if family == "decoder" else "learned",
                attention=AttentionConfig(kind=kind, options=dict(ATTENTION_OPTIONS, **options)))


# name -> (model config, sequence parallel)
PARITY_CASES = {
    "decoder-gqa-rope-swiglu": (DECODER, False),
    "decoder-gqa-rope-swiglu-sp": (DECODER, True),
    "decoder-untied-sandwich-bias-sp": (dict(DECODER, tie_embeddings=False, norm_placement="sandwich", bias=True,
                                             position="sinusoidal"), True),
    "bert-encoder": (BERT, False),
    "bert-encoder-sp": (BERT, True),
    "alibi": (dict(SMALL, position="alibi"), False),
    "mqa": (dict(SMALL, n_kv_heads=1), False),
    "mqa-sp": (dict(SMALL, n_kv_heads=1), True),
    "t5-encoder-decoder": (T5, False),
    "t5-encoder-decoder-sp": (T5, True),
    "bigbird": (attention_model("bigbird", "decoder"), False),
    "lsh": (attention_model("lsh", "decoder"), False),
    "performer": (attention_model("performer", "encoder", redraw_every=2), False),  # redraws at step 2
    "nystrom": (attention_model("nystrom", "encoder"), False),
    "linformer": (attention_model("linformer", "encoder"), False),
    "switch-moe": (SWITCH, False),
    "switch-moe-sp": (SWITCH, True),
    "shared-layers-sp": (dict(SMALL, share_layers=True), True),
    # Shared per-head networks (compression, sorting net): replicated, gradients summed over the heads' ranks.
    "memory-compressed-causal": (attention_model("memory_compressed", "decoder", compression=3), False),
    "memory-compressed-encoder-sp": (attention_model("compressed", "encoder", compression=3), True),
    "sinkhorn-causal": (attention_model("sinkhorn", "decoder"), False),
    "sinkhorn-encoder-sp": (attention_model("sinkhorn", "encoder"), True),
    # Scores carried block to block: each rank's are its own heads'; ALiBi and T5 biases sliced by head.
    "realformer-alibi": (dict(attention_model("realformer", "decoder"), position="alibi"), False),
    "realformer-encoder-sp": (attention_model("realformer", "encoder"), True),
    "realformer-t5-sp": (dict(T5, attention=AttentionConfig(kind="realformer")), True),
    # Heads mixed: every rank gathers all heads' q and k (xscale/parallel/tensor/talking_heads.py).
    "talking-heads-alibi": (dict(attention_model("talking_heads", "decoder"), position="alibi"), False),
    "talking-heads-gqa-rope-sp": (dict(DECODER, attention=AttentionConfig(kind="talking_heads")), True),
    "talking-heads-mqa-encoder": (dict(attention_model("talking_heads", "encoder"), n_kv_heads=1), False),
    "talking-heads-t5-sp": (dict(T5, attention=AttentionConfig(kind="talking_heads")), True),
    # Per-head state split by head (xscale/parallel/tensor/head_sharded.py); buffers compared too.
    "gaussian": (attention_model("gaussian", "decoder", sigma=3.0), False),
    "gaussian-prior-alibi-sp": (dict(attention_model("gaussian_prior", "encoder"), position="alibi"), True),
    "adaptive-span": (attention_model("adaptive_span", "decoder", max_span=8, ramp=4, span_loss=0.01), False),
    "synthesizer-dense-sp": (attention_model("synthesizer", "decoder", mode="dense"), True),
    "synthesizer-random": (attention_model("synthesizer", "encoder", mode="random"), False),
    "synthesizer-factorized": (attention_model("synthesizer", "decoder", mode="factorized", rank=4), False),
    # No queries are projected: the core's placeholder must count this rank's heads, not the replicated kv head's.
    "synthesizer-random-mqa": (dict(attention_model("synthesizer", "decoder", mode="random"), n_kv_heads=1), False),
    "inducing": (attention_model("inducing", "encoder"), False),
    "isab-sp": (attention_model("isab", "encoder"), True),
    "luna-causal": (attention_model("luna", "decoder", packed_length=4), False),
    "luna-encoder": (attention_model("luna", "encoder", packed_length=4), False),
    # Centroids move at every training forward after the first (decay 0.5); the pending statistics compared too.
    "routing": (attention_model("routing", "decoder", clusters=2, decay=0.5), False),
    "routing-sp": (attention_model("routing", "decoder", clusters=2, decay=0.5), True),
    "gaussian-shared-layers-sp": (dict(attention_model("gaussian", "decoder"), share_layers=True), True),
    # Declared split_heads in its own file (xscale/models/attention/cosformer.py), no edit in xscale/parallel.
    "cosformer-causal-sp": (dict(attention_model("cosformer", "decoder"), max_seq_len=16), True),
    "cosformer-encoder": (dict(attention_model("cosformer", "encoder"), max_seq_len=16), False),
}


# --------------------------------------------------------------------------- the two worker ranks


def worker(rank: int, store: str, tasks, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=CASE_TIMEOUT_S))
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
    try:
        while (task := tasks.get()) is not None:
            check, args = task
            try:
                problems = check(mesh, *args)
            except Exception:
                problems = [traceback.format_exc()]
            results.put((rank, problems))
    finally:
        dist.destroy_process_group()


class Ranks:
    """Two ranks in a gloo group; restarted after a case fails (its collectives may be out of step)."""

    def __init__(self) -> None:
        self.context = local_context()
        self.processes: list = []
        self.scratch = tempfile.TemporaryDirectory(prefix="xscale-tp-ranks-")
        self.starts = 0

    def start(self) -> None:
        self.starts += 1  # a fresh file store per start: a restarted pair never meets the failed pair's store
        store = os.path.join(self.scratch.name, f"store{self.starts}")
        self.tasks = [self.context.Queue() for _ in range(WORLD)]
        self.results = self.context.Queue()
        self.processes = [self.context.Process(target=worker, args=(rank, store, self.tasks[rank], self.results),
                                               daemon=True) for rank in range(WORLD)]
        for process in self.processes:
            process.start()

    def stop(self) -> None:
        for process in self.processes:
            if process.is_alive():
                process.kill()
            process.join()
        self.processes = []

    def run(self, check, *args) -> None:
        if not self.processes:
            self.start()
        for tasks in self.tasks:
            tasks.put((check, args))
        problems = []
        try:
            for _ in range(WORLD):
                rank, found = self.results.get(timeout=CASE_TIMEOUT_S + 60)
                problems += [f"rank {rank}: {problem}" for problem in found]
        except queue.Empty:
            problems.append(f"no answer from every rank within {CASE_TIMEOUT_S + 60} s")
        if problems:
            self.stop()
            pytest.fail("\n".join(problems[:20]), pytrace=False)

    def close(self) -> None:
        if self.processes:
            for tasks in self.tasks:
                tasks.put(None)
            for process in self.processes:
                process.join(timeout=30)
        self.stop()
        self.scratch.cleanup()


@pytest.fixture(scope="module")
def ranks():
    pool = Ranks()
    yield pool
    pool.close()


# --------------------------------------------------------------------------- checks run on every rank


def make_batch(config: ModelConfig) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(11)
    ids = torch.randint(0, config.vocab_size, (BATCH, LENGTH), generator=generator)
    if config.family == "decoder":
        return {"input_ids": ids, "labels": torch.roll(ids, -1, dims=1)}
    if config.family == "encoder":  # MLM: ~30% of positions carry a label
        labels = torch.where(torch.rand(BATCH, LENGTH, generator=generator) < 0.3, ids, -100)
        labels[:, 0] = ids[:, 0]
        return {"input_ids": ids, "labels": labels}
    targets = torch.randint(0, config.vocab_size, (BATCH, LENGTH), generator=generator)
    decoder_ids = torch.cat([torch.zeros(BATCH, 1, dtype=torch.long), targets[:, :-1]], dim=1)
    return {"input_ids": ids, "decoder_input_ids": decoder_ids, "labels": targets}


def tensor_parallel_model(config: ModelConfig, mesh: DeviceMesh, sequence_parallel: bool) -> torch.nn.Module:
    """The lead's order: build on meta, split, materialise, tie, initialise."""
    model = build_model(config, materialize=False)
    apply_tensor_parallel(model, mesh, sequence_parallel=sequence_parallel)
    model.to_empty(device="cpu")
    model.tie_weights()
    init_weights(model, config, SEED)
    return model


def compare_parameters(single: torch.nn.Module, parallel: torch.nn.Module, step: int) -> list[str]:
    expected = dict(single.named_parameters())
    problems = []
    for name, param in parallel.named_parameters():
        error = (param.detach().full_tensor() - expected[name].detach()).abs().max().item()
        if error > PARAM_ATOL:
            problems.append(f"after step {step}: {name}: parameter differs by {error:.2e} (atol {PARAM_ATOL})")
    return problems


def compare_buffers(single: torch.nn.Module, parallel: torch.nn.Module, step: int) -> list[str]:
    """Buffers split by head (routing's centroids) equal one process's once gathered."""
    expected = dict(single.named_buffers())
    problems = []
    for name, buffer in parallel.named_buffers():
        if isinstance(buffer, DTensor):
            error = (buffer.full_tensor().float() - expected[name].float()).abs().max().item()
            if error > PARAM_ATOL:
                problems.append(f"after step {step}: buffer {name} differs by {error:.2e} (atol {PARAM_ATOL})")
    return problems


def compare_gradients(single: torch.nn.Module, parallel: torch.nn.Module, step: int) -> list[str]:
    problems = []
    expected = dict(single.named_parameters())
    names = [name for name, _ in parallel.named_parameters()]
    if sorted(names) != sorted(expected):
        return [f"parameter names differ: {sorted(set(names) ^ set(expected))}"]
    for name, param in parallel.named_parameters():
        if not isinstance(param, DTensor):
            problems.append(f"{name} is not a DTensor")
            continue
        if param.grad is None or expected[name].grad is None:
            if (param.grad is None) != (expected[name].grad is None):
                problems.append(f"step {step}: {name}: gradient present on one side only")
            continue
        if param.grad.placements != param.placements:
            problems.append(f"step {step}: {name}: gradient placements {param.grad.placements} != "
                            f"parameter placements {param.placements}")
        grad = param.grad.full_tensor()
        error = (grad - expected[name].grad).abs().max().item()
        if error > GRAD_ATOL:
            problems.append(f"step {step}: {name}: gradient differs by {error:.2e} (atol {GRAD_ATOL})")
    return problems


def split_context(mesh: DeviceMesh, sequence_parallel: bool) -> StepContext:
    """The context a tensor-parallel forward is run with (the engines build it per microbatch)."""
    return tensor_parallel_context(mesh, sequence_parallel)(StepContext())


def check_parity(mesh: DeviceMesh, config: ModelConfig, sequence_parallel: bool, steps: int = 3) -> list[str]:
    """Loss, gradients and AdamW steps of the tp model against one process; returns the mismatches."""
    torch.manual_seed(0)
    single = build_model(config, seed=SEED)
    parallel = tensor_parallel_model(config, mesh, sequence_parallel)
    batch = make_batch(config)
    tokens = (batch["labels"] != -100).sum()
    optimizers = [torch.optim.AdamW(model.parameters(), lr=LR, eps=ADAM_EPS, weight_decay=0.1) for model in (single, parallel)]
    problems = []
    for step in range(steps):
        expected = model_loss_sum(single, batch) / tokens
        expected.backward()
        loss = model_loss_sum(parallel, batch, split_context(mesh, sequence_parallel)) / tokens
        loss.backward()
        if not torch.isclose(loss.detach(), expected.detach(), rtol=LOSS_RTOL, atol=0):
            problems.append(f"step {step}: loss {loss.item():.8f} != single process {expected.item():.8f}")
        if step in (0, steps - 1):
            problems += compare_gradients(single, parallel, step)
        # The engine's clipping (clip_grad_norm_, foreach) on DTensor gradients: the same global norm.
        norms = [torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True) for model in (single, parallel)]
        parallel_norm = norms[1].full_tensor() if isinstance(norms[1], DTensor) else norms[1]
        if not torch.isclose(parallel_norm, norms[0], rtol=LOSS_RTOL, atol=0):
            problems.append(f"step {step}: gradient norm {parallel_norm.item():.8f} != {norms[0].item():.8f}")
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    return problems + compare_parameters(single, parallel, steps - 1) + compare_buffers(single, parallel, steps - 1)


def check_replicas_agree_under_dropout(mesh: DeviceMesh, config: ModelConfig, sequence_parallel: bool) -> list[str]:
    """With dropout, the copies of replicated parameters get the same gradient on every tp rank."""
    torch.manual_seed(0)  # the trainer seeds every rank alike
    parallel = tensor_parallel_model(config, mesh, sequence_parallel)
    loss = model_loss_sum(parallel, make_batch(config), split_context(mesh, sequence_parallel))
    loss.backward()
    problems = []
    for name, param in parallel.named_parameters():
        if param.grad is None or not all(p.is_replicate() for p in param.placements):
            continue
        local = param.grad.to_local()
        copies = [torch.empty_like(local) for _ in range(WORLD)]
        dist.all_gather(copies, local.contiguous())
        if not torch.equal(copies[0], copies[1]):
            problems.append(f"{name}: replicated gradient differs between tp ranks")
    if not torch.isfinite(loss):
        problems.append(f"loss {loss.item()} is not finite")
    return problems


def check_sequence_parallel_needs_divisible_lengths(mesh: DeviceMesh, config: ModelConfig) -> list[str]:
    parallel = tensor_parallel_model(config, mesh, sequence_parallel=True)
    batch = {key: value[:, :-1] for key, value in make_batch(config).items()}
    try:
        model_loss_sum(parallel, batch, split_context(mesh, True))
    except ValueError as error:
        return [] if "multiple of 2" in str(error) else [f"unexpected message: {error}"]
    return [f"a sequence of {LENGTH - 1} tokens was not refused"]


def check_logits_are_vocab_sharded(mesh: DeviceMesh, config: ModelConfig) -> list[str]:
    """``model(ids)`` gives DTensor logits sharded on the vocabulary, equal to one process's once gathered."""
    single = build_model(config, seed=SEED)
    parallel = tensor_parallel_model(config, mesh, sequence_parallel=False)
    ids = make_batch(config)["input_ids"]
    logits = parallel(ids)
    problems = []
    if logits.to_local().shape[-1] != config.vocab_size // WORLD:
        problems.append(f"local logits hold {logits.to_local().shape[-1]} vocabulary entries")
    error = (logits.full_tensor() - single(ids)).abs().max().item()
    if error > 1e-5:
        problems.append(f"logits differ by {error:.2e}")
    return problems


def check_head_state_is_split(mesh: DeviceMesh, config: ModelConfig) -> list[str]:
    """Each rank stores only its heads' rows of every per-head parameter and buffer (no replicated copy); the
    state dict shows them full-size, as a checkpoint sees them."""
    parallel = tensor_parallel_model(config, mesh, sequence_parallel=False)
    state = parallel.state_dict()
    problems = []
    found = 0
    for prefix, module in parallel.named_modules():
        for name in getattr(type(module), "per_head_state", ()):
            tensor = getattr(module, name, None)
            if tensor is None:
                continue
            found += 1
            full = state[f"{prefix}.{name}"]
            if not isinstance(tensor, DTensor) or tensor.placements != (Shard(0),):
                problems.append(f"{prefix}.{name} is not a Shard(0) DTensor")
            elif tensor.to_local().shape[0] != config.n_heads // WORLD or full.shape[0] != config.n_heads:
                problems.append(f"{prefix}.{name}: local rows {tensor.to_local().shape[0]}, full {full.shape[0]}")
    return problems if found else ["no per-head state found"]


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("name", list(PARITY_CASES))
def test_matches_single_process(ranks: Ranks, name: str) -> None:
    options, sequence_parallel = PARITY_CASES[name]
    ranks.run(check_parity, ModelConfig(**options), sequence_parallel)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp-sp"])
def test_replicas_agree_under_dropout(ranks: Ranks, sequence_parallel: bool) -> None:
    config = ModelConfig(**dict(DECODER, dropout=0.2, attention_dropout=0.2))
    ranks.run(check_replicas_agree_under_dropout, config, sequence_parallel)


@pytest.mark.parametrize("kind", ["routing", "synthesizer"])
def test_per_head_state_is_split_by_head(ranks: Ranks, kind: str) -> None:
    ranks.run(check_head_state_is_split, ModelConfig(**attention_model(kind, "decoder")))


def test_sequence_parallel_refuses_indivisible_lengths(ranks: Ranks) -> None:
    ranks.run(check_sequence_parallel_needs_divisible_lengths, ModelConfig(**DECODER))


def test_logits_are_vocab_sharded(ranks: Ranks) -> None:
    ranks.run(check_logits_are_vocab_sharded, ModelConfig(**BERT))


REFUSED = {
    "heads": (dict(SMALL, n_heads=2, d_model=32), 4, "model.n_heads=2"),
    "kv-heads": (dict(SMALL, n_heads=8, n_kv_heads=2), 4, "model.n_kv_heads=2"),
    "ffn-width": (dict(SMALL, d_ff=33), 2, "model.d_ff"),
    "vocab": (dict(SMALL, vocab_size=65), 2, "pad the vocabulary to 66"),
    "strided-split-heads": (dict(SMALL, attention=AttentionConfig(kind="strided", options={"split_heads": True})),
                            2, "split_heads=false"),
    "fixed-split-heads-in-one-layer": (
        dict(SMALL, attention=AttentionConfig(kind="dense", per_layer=["dense", "fixed"],
                                              options={"split_heads": True})), 2, "attention 'fixed'"),
    "tp-zero": (SMALL, 0, "parallel.tp must be >= 1"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_refuses_unsplittable_models(name: str) -> None:
    options, tp, message = REFUSED[name]
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        check_tensor_parallel(ModelConfig(**options), tp)


def test_refuses_head_mixing_cores_without_a_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """A core that mixes heads is split only when its traits declare gather_heads."""
    monkeypatch.setattr(ATTENTION.get("talking_heads"), "parallel_traits", ParallelTraits(tp="split_heads"))
    with pytest.raises(ConfigError, match="attention 'talking_heads' mixes information across heads"):
        check_tensor_parallel(ModelConfig(**attention_model("talking_heads", "decoder")), 2)


def test_accepts_splittable_models() -> None:
    check_tensor_parallel(ModelConfig(**DECODER), 2)
    check_tensor_parallel(ModelConfig(**dict(SMALL, n_kv_heads=1)), 4)  # MQA: kv replicated
    check_tensor_parallel(ModelConfig(**dict(SWITCH, d_ff=33, moe=dataclasses.replace(SWITCH["moe"], every=1))), 2)
    check_tensor_parallel(ModelConfig(**dict(SMALL, n_heads=3, d_model=33, vocab_size=7)), 1)
    for kind in ("memory_compressed", "compressed", "sinkhorn", "realformer", "residual_attention", "talking_heads"):
        check_tensor_parallel(ModelConfig(**attention_model(kind, "decoder")), 2)
    for kind in ("gaussian", "gaussian_prior", "adaptive_span", "synthesizer", "inducing", "isab", "luna", "routing"):
        check_tensor_parallel(ModelConfig(**attention_model(kind, "encoder" if kind in ("inducing", "isab")
                                                            else "decoder")), 2)  # per-head state split by head


# --------------------------------------------------------------------------- composed with FSDP2 (4 ranks)


def fsdp_over_tensor_parallel(rank: int, case: str) -> None:
    """dp=2 x tp=2: FSDP2 over the tp-split blocks (the lead's order) gives one process's loss and gradients."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    options, sequence_parallel = PARITY_CASES[case]
    config = ModelConfig(**options)
    single = build_model(config, seed=SEED)
    model = build_model(config, materialize=False)
    apply_tensor_parallel(model, mesh["tp"], sequence_parallel=sequence_parallel)
    for stack in (model.stack, model.decoder):
        for block in (stack.layers.values() if stack is not None else ()):
            fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    model.to_empty(device="cpu")
    model.tie_weights()
    init_weights(model, config, SEED)

    batch = {key: torch.cat([value, value.flip(0)]) for key, value in make_batch(config).items()}
    tokens = (batch["labels"] != -100).sum()
    rows = slice(BATCH * mesh["dp"].get_local_rank(), BATCH * (mesh["dp"].get_local_rank() + 1))
    expected = model_loss_sum(single, batch) / tokens
    expected.backward()
    local = {key: value[rows] for key, value in batch.items()}
    loss = model_loss_sum(model, local, split_context(mesh["tp"], sequence_parallel)) / tokens
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total, group=mesh["dp"].get_group())
    torch.testing.assert_close(total, expected.detach(), rtol=LOSS_RTOL, atol=0)
    reference = dict(single.named_parameters())
    for name, param in model.named_parameters():
        grad = param.grad.full_tensor() * 2  # FSDP averages over the two dp ranks
        torch.testing.assert_close(grad, reference[name].grad, rtol=0, atol=GRAD_ATOL,
                                   msg=lambda message, name=name: f"{name}: {message}")


@pytest.mark.slow
@pytest.mark.parametrize("case", ["decoder-gqa-rope-swiglu-sp", "t5-encoder-decoder-sp", "synthesizer-dense-sp", "routing",
                                  "isab-sp"])
def test_fsdp2_over_tensor_parallel(case: str) -> None:
    spawn(fsdp_over_tensor_parallel, case, world=4)
