"""Early exit (xscale/models/stacks/early_exit.py, xscale/models/heads/early_exit.py): the joint loss against the per-layer losses summed here, the entropy
and patience rules against loops written here, one forward giving every layer's logits, the forward that stops each
example at its exit against every exit's predictions and the rows each layer ran on, the fallback where rows are
coupled, a tiny run reporting the metrics, and the options and layouts refused."""

import json

import pytest
import torch
import torch.nn.functional as F

from xscale.cli import main
from xscale.config.load import load_config_from_cli
from xscale.config.schema import ConfigError, ModelConfig, MoEConfig
from xscale.models import build_model
from xscale.models.heads.early_exit import exit_layers, exit_predictions, joint_exit_loss_sum
from xscale.parallel.checks import resolve_dims
from xscale.parallel.data.fsdp import FullyShardedDataParallel
from xscale.parallel.data.strategies import DataParallel
from xscale.parallel.loss import model_loss_sum, prediction_counts
from xscale.parallel.model import ParallelModel
from xscale.train.step import evaluation_predictions, exit_path_refusal

LOGITS = torch.randn(4, 64, 3, generator=torch.Generator().manual_seed(0)) * 3
CLASSIFY = ["model.family=encoder", "train.task=classify", "data.dataset=lra_listops", "model.position=learned",
            "model.vocab_size=64", "model.d_model=16", "model.n_layers=3", "model.n_heads=2", "model.max_seq_len=32",
            "train.seq_len=32", "model.pooling=mean", "model.stack=early_exit"]


def _model(n_layers: int = 3) -> torch.nn.Module:
    config = ModelConfig(family="encoder", vocab_size=40, d_model=16, n_layers=n_layers, n_heads=2, max_seq_len=16,
                         position="learned", num_classes=3, pooling="mean", stack="early_exit")
    return build_model(config, seed=0).eval()


def test_the_joint_loss_is_the_layer_weighted_average_of_the_per_layer_losses():
    labels = torch.randint(0, 3, (64,), generator=torch.Generator().manual_seed(1))
    per_layer = [F.cross_entropy(LOGITS[layer], labels, reduction="sum") for layer in range(4)]
    expected = sum((layer + 1) * loss for layer, loss in enumerate(per_layer)) / (1 + 2 + 3 + 4)
    torch.testing.assert_close(joint_exit_loss_sum(LOGITS, labels), expected)


def test_one_forward_gives_every_layers_logits_and_the_joint_loss():
    model = _model()
    tokens = torch.randint(1, 40, (5, 8), generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([0, 1, 2, 0, 1])
    with torch.no_grad():
        logits = model(tokens)
        assert logits.shape == (3, 5, 3)
        torch.testing.assert_close(model_loss_sum(model, {"input_ids": tokens, "labels": labels}),
                                   joint_exit_loss_sum(logits, labels))
        # The last exit is the plain classifier's head on the final layer.
        plain = build_model(ModelConfig(family="encoder", vocab_size=40, d_model=16, n_layers=3, n_heads=2,
                                        max_seq_len=16, position="learned", num_classes=3, pooling="mean"), seed=0)
        plain.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("exits.")})
        torch.testing.assert_close(logits[-1], plain.eval()(tokens))


def test_one_forward_counts_right_at_the_exits_right_at_full_depth_and_the_exit_layers():
    model = _model()
    model.exits.entropy = 0.5
    with torch.no_grad():
        for linear in model.exits.linears:  # confident early exits: some examples leave before the last layer
            linear.weight.mul_(300)
    tokens = torch.randint(1, 40, (16, 8), generator=torch.Generator().manual_seed(2))
    labels = torch.randint(0, 3, (16,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = model(tokens)
    classes, layers = exit_predictions(logits, 0.5)
    expected = [(classes == labels).sum(), (logits[-1].argmax(dim=-1) == labels).sum(), (layers + 1).sum()]
    assert not torch.equal(classes, logits[-1].argmax(dim=-1))  # the two accuracies count different classes
    batch = {"input_ids": tokens, "labels": labels}
    every_exit = [*(int(x) for x in expected), 3 * 16, 3 * 16]  # every layer-row computed, of 3 * 16
    assert prediction_counts(model, batch).tolist() == every_exit
    stopped = [*(int(x) for x in expected), int((layers + 1).sum()), 3 * 16]  # each example's layers up to its exit
    assert prediction_counts(model, batch, exit_early=True).tolist() == stopped


def _confident_model(n_layers: int = 4, **options) -> torch.nn.Module:
    """Exits with wide weights (confident early answers: examples leave at every layer)."""
    config = ModelConfig(family="encoder", vocab_size=40, d_model=16, n_layers=n_layers, n_heads=2, max_seq_len=16,
                         position="learned", num_classes=3, pooling="mean", stack="early_exit", **options)
    model = build_model(config, seed=0).eval()
    with torch.no_grad():
        for linear in model.exits.linears:
            linear.weight.mul_(40)
    return model


def _padded_batch(rows: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens (rows, 16) and a padding mask giving row b b + 4 real tokens: a row is known by its length."""
    tokens = torch.randint(1, 40, (rows, 16), generator=torch.Generator().manual_seed(4))
    mask = torch.arange(16)[None, :] < (torch.arange(rows) + 4)[:, None]
    return tokens, mask


@pytest.mark.parametrize("entropy,patience,options", [
    (0.6, 0, {}), (0.0, 1, {"n_layers": 6}), (0.0, 2, {"n_layers": 6}),
    (0.6, 0, {"share_layers": True, "norm_placement": "post"})])
def test_stopping_at_the_exits_gives_the_every_exit_predictions_and_layers(entropy, patience, options):
    model = _confident_model(**options)
    model.exits.entropy, model.exits.patience = entropy, patience
    tokens, mask = _padded_batch()
    with torch.no_grad():
        classes, layers = exit_predictions(model(tokens, padding_mask=mask), entropy, patience)
        stopped = model(tokens, padding_mask=mask, exit_early=True)
    assert len(set(layers.tolist())) >= 2, "the rule must send examples out at different layers"
    assert torch.equal(stopped[:, 0], classes) and torch.equal(stopped[:, 1], layers)
    assert torch.equal(stopped[:, 2], layers + 1)  # the layers each example ran


@pytest.mark.parametrize("entropy,deepest", [(0.9, 3), (1.0, 2)])
def test_each_layer_runs_on_exactly_the_rows_not_yet_exited(entropy, deepest):
    """Every block records which rows it ran on (known by their padding lengths): layer l, those with exit >= l; with
    no row left after layer ``deepest`` the later layers never run."""
    model = _confident_model()
    model.exits.entropy = entropy
    tokens, mask = _padded_batch()
    ran: dict[int, list[int]] = {}

    def record(depth: int, kwargs: dict) -> None:
        ran[depth] = kwargs["context"].padding_mask.sum(-1).tolist()

    for depth, block in enumerate(model.stack.layers.values()):
        block.register_forward_pre_hook(lambda module, args, kwargs, depth=depth: record(depth, kwargs),
                                        with_kwargs=True)
    with torch.no_grad():
        layers = model(tokens, padding_mask=mask, exit_early=True)[:, 1]
    lengths = mask.sum(-1)
    expected = {depth: sorted(lengths[layers >= depth].tolist()) for depth in range(4) if (layers >= depth).any()}
    assert {depth: sorted(rows) for depth, rows in ran.items()} == expected
    assert int(layers.max()) == deepest and set(ran) == set(range(deepest + 1))
    assert len(set(layers.tolist())) >= 3


def test_batch_coupled_rows_are_refused_and_evaluation_computes_every_exit():
    """MoE routes the batch's tokens together: the stopping forward is refused, and evaluation falls back to computing
    every exit (compute fraction 1) with the reason; without MoE it stops (fraction = mean exit layer / L)."""
    tokens, mask = _padded_batch()
    batch = {"input_ids": tokens, "padding_mask": mask, "labels": torch.randint(0, 3, (12,))}
    moe = _confident_model(moe=MoEConfig(num_experts=2))
    moe.exits.entropy = 0.6
    with pytest.raises(ValueError, match="model.moe routes the batch's tokens together"):
        moe(tokens, padding_mask=mask, exit_early=True)
    assert exit_path_refusal(ParallelModel([moe], micro_batch_size=12)).startswith("model.moe routes")
    metrics = evaluation_predictions(ParallelModel([moe], micro_batch_size=12), batch, exits=True)
    assert metrics["exit_compute_fraction"] == 1.0 and metrics["mean_exit_layer"] < 4
    plain = _confident_model()
    plain.exits.entropy = 0.6
    metrics = evaluation_predictions(ParallelModel([plain], micro_batch_size=12), batch, exits=True)
    assert metrics["exit_compute_fraction"] == pytest.approx(metrics["mean_exit_layer"] / 4)
    assert metrics["exit_compute_fraction"] < 1
    assert FullyShardedDataParallel.gathers_in_forward and not DataParallel.gathers_in_forward  # ZeRO-3 falls back


def test_entropy_zero_never_exits_early_and_infinity_exits_at_the_first_layer():
    assert torch.equal(exit_layers(LOGITS, 0.0), torch.full((64,), 3))
    assert torch.equal(exit_layers(LOGITS, float("inf")), torch.zeros(64, dtype=torch.int64))
    predictions, _ = exit_predictions(LOGITS, 0.0)
    assert torch.equal(predictions, LOGITS[-1].argmax(dim=-1))


def test_the_entropy_rule_uses_the_probabilities():
    threshold = 0.6
    probabilities = LOGITS.softmax(dim=-1)
    entropy = -(probabilities * probabilities.log()).sum(dim=-1)
    expected = [next((layer for layer in range(4) if entropy[layer, b] < threshold), 3) for b in range(64)]
    got = exit_layers(LOGITS, threshold)
    assert got.tolist() == expected
    assert 0 < len(set(expected)) and min(expected) < 3 < max(expected) + 1


def _patience_loop(logits: torch.Tensor, patience: int) -> list[int]:
    """PABEE, Zhou et al. 2020, Algorithm 1 / eq. 3-4, one example at a time."""
    exits = []
    for b in range(logits.shape[1]):
        counter, chosen, previous = 0, logits.shape[0] - 1, None
        for layer in range(logits.shape[0]):
            prediction = int(logits[layer, b].argmax())
            counter = counter + 1 if prediction == previous else 0
            previous = prediction
            if counter >= patience:
                chosen = layer
                break
        exits.append(chosen)
    return exits


@pytest.mark.parametrize("patience", [1, 2, 3])
def test_the_patience_rule_matches_the_papers_loop(patience):
    logits = torch.randn(5, 256, 2, generator=torch.Generator().manual_seed(2))  # 2 classes: agreement is common
    expected = _patience_loop(logits, patience)
    assert exit_layers(logits, 0.0, patience).tolist() == expected
    assert min(expected) == patience  # some example agreed from the start


def test_a_tiny_early_exit_run_reports_the_three_metrics(tmp_path, capsys):
    run = tmp_path / "run"
    # ListOps has 10 classes (entropy at most ln 10 = 2.303): 2.25 with wide initial weights lets some examples leave early.
    assert main(["train", *CLASSIFY, "model.stack.options.entropy=2.25", "model.init_std=0.3", "data.num_samples=48", "data.eval_fraction=0.34",
                 "train.global_batch_size=16", "train.steps=2", "train.eval_every=2", "train.eval_batches=1",
                 "train.loggers=[jsonl]", "train.plot=false", "train.progress=false", "train.watchdog=false",
                 f"train.output_dir={run}"]) == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evaluated = [record for record in records if "eval/mean_exit_layer" in record][-1]
    assert 0 <= evaluated["eval/accuracy"] <= 1 and 0 <= evaluated["eval/accuracy_full_depth"] <= 1
    assert 1 <= evaluated["eval/mean_exit_layer"] < 3  # a loose threshold: examples leave before the last layer
    # Each example stopped at its exit: the layer-rows computed are the exit layers' sum over L per example.
    assert evaluated["eval/exit_compute_fraction"] == pytest.approx(evaluated["eval/mean_exit_layer"] / 3)
    capsys.readouterr()
    assert main(["eval", str(run), "--batches", "1"]) == 0
    line = capsys.readouterr().out.splitlines()[-1]
    assert "accuracy " in line and "(full depth " in line and "mean exit layer " in line, line
    assert "layer-rows computed " in line and "wall-clock exit path " in line and " vs full depth " in line, line


@pytest.mark.parametrize("overrides,message", [
    (["train.task=lm", "data.dataset=copy"], "needs train.task=classify"),
    (["model.reversible=true"], "model.reversible=True chooses model.stack.kind=reversible but "
                                "model.stack.kind=early_exit is set"),
    (["model.stack.options.entropy=-1"], "model.stack.options.entropy must be >= 0"),
    (["model.stack.options.patience=-1"], "model.stack.options.patience must be >= 0"),
])
def test_options_early_exit_cannot_run_with_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config_from_cli(None, [*CLASSIFY, *overrides])


@pytest.mark.parametrize("layout", ["parallel.tp=2", "parallel.pp=2", "parallel.cp=2"])
def test_model_and_sequence_parallel_layouts_are_refused(layout):
    name = layout.split("=")[0]
    with pytest.raises(ConfigError, match=name):
        resolve_dims(load_config_from_cli(None, [*CLASSIFY, layout]), 2)
