"""The ``xscale`` command: the built-in default run, inspect, --version, --print-config, every command's help in
plain text, and bad input as one line with exit code 2."""

import re
import subprocess
import sys

import pytest

from tests.reliability.test_bad_input import ENV
from xscale.cli import COMMANDS, main, version
from xscale.commands.bench import BENCHMARKS
from xscale.commands.data import TOOLS
from xscale.config.load import load_config, read_config

# reStructuredText that argparse would print as it is: ``literals`` and :roles:`targets`.
MARKUP = re.compile(r"``|:[a-z]+:`")


def test_default_run_trains_checkpoints_and_plots(tmp_path, capsys):
    code = main(["train", "train.steps=3", "train.global_batch_size=4", "train.seq_len=32", "model.n_layers=1",
                 "train.log_every=1", f"train.output_dir={tmp_path}", "data.tokenizer_vocab_size=1000",
                 "model.vocab_size=1000"])
    assert code == 0
    out = capsys.readouterr().out
    assert "step 3/3" in out and "tok/s" in out and "MFU" in out
    assert (tmp_path / "loss_curve.png").stat().st_size > 1000
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_00000003"
    assert (tmp_path / "tokenizer").is_dir()


def test_inspect_prints_parameters_flops_and_memory(capsys):
    assert main(["inspect", "configs/gpt2-small.yaml"]) == 0
    out = capsys.readouterr().out
    assert "124,439,808" in out and "FLOPs per token" in out and "optimizer" in out


def test_inspect_plans_a_pipeline_without_a_microbatch_count(capsys):
    """parallel.pp=2 alone: the microbatch count defaults to the fewest 1F1B runs (2), printed with its bubble."""
    tiny = ["model.vocab_size=64", "model.d_model=32", "model.n_layers=4", "model.n_heads=4", "train.seq_len=16",
            "train.global_batch_size=8"]
    assert main(["inspect", *tiny, "parallel.pp=2"]) == 0
    out = capsys.readouterr().out
    assert "layout: world 2: pp=2" in out
    assert "pipeline: 1f1b, 2 stages (1 per rank), 2 microbatches per step (auto), bubble (p-1)/(m+p-1) = 0.333" in out
    assert main(["inspect", *tiny, "parallel.pp=2", "parallel.microbatches=4"]) == 0
    assert "4 microbatches per step, bubble (p-1)/(m+p-1) = 0.200" in capsys.readouterr().out
    assert main(["inspect", *tiny, "parallel.pp=2", "parallel.microbatches=1"]) == 2  # a set count is not changed
    assert "needs at least parallel.pp=2 microbatches, got parallel.microbatches=1" in capsys.readouterr().err


def test_bad_config_exits_2_with_the_reason(capsys):
    assert main(["train", "model.n_heads=7"]) == 2
    assert "does not divide model.d_model" in capsys.readouterr().err
    assert main(["trian"]) == 2
    assert "did you mean 'train'" in capsys.readouterr().err


def test_module_entry_point_runs():
    result = subprocess.run([sys.executable, "-m", "xscale", "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "inspect" in result.stdout


def test_help_lists_every_command_benchmark_and_data_tool(capsys):
    """The issue's case: `xscale --help` left out bench collectives and bench optimizer."""
    from xscale.cli import COMMANDS
    from xscale.commands.bench import BENCHMARKS
    from xscale.commands.data import TOOLS

    assert main(["--help"]) == 0
    flat = " ".join(capsys.readouterr().out.split())  # help lines wrap at the terminal's width
    assert all(f" {name} " in flat for name in COMMANDS)
    bench, data = flat.split(" bench ", 1)[1].split(" data ", 1)
    assert all(re.search(rf"\b{name}\b", bench) for name in BENCHMARKS), bench
    assert all(re.search(rf"\b{name}\b", data.split(" submit ")[0]) for name in TOOLS), data


def run_xscale(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "xscale", *args], capture_output=True, text=True, timeout=300,
                          env=ENV, cwd=cwd)


def test_version_names_the_package_version(capsys):
    from importlib.metadata import version as installed

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"xscale {installed('xscale')}" == f"xscale {version()}"


def test_version_falls_back_to_the_source_tree(monkeypatch, capsys):
    import importlib.metadata

    import xscale

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    monkeypatch.setattr(xscale, "__version__", "9.9.9-source")
    assert main(["-V"]) == 0
    assert capsys.readouterr().out.strip() == "xscale 9.9.9-source"


PRINT_OVERRIDES = ["train.steps=7", "model.attention.per_layer=[local, dense]", "train.loggers=[csv]",
                   "launch.time='02:00:00'", "train.schedule=wsd", "train.warmup_steps=2", "train.decay_steps=3",
                   "train.peak_flops=1.5e12"]


def test_print_config_reads_back_to_the_same_config(tmp_path, capsys):
    output_dir = tmp_path / "run"
    assert main(["train", "--print-config", "configs/tiny-gpt.yaml", *PRINT_OVERRIDES,
                 f"train.output_dir={output_dir}"]) == 0
    printed = capsys.readouterr().out
    assert not output_dir.exists()  # nothing was built or written
    (tmp_path / "printed.yaml").write_text(printed)
    expected = load_config("configs/tiny-gpt.yaml", [*PRINT_OVERRIDES, f"train.output_dir={output_dir}"])
    assert read_config(tmp_path / "printed.yaml") == expected
    assert main(["train", str(tmp_path / "printed.yaml"), "--print-config"]) == 0  # the flag anywhere
    assert capsys.readouterr().out == printed


def test_print_config_refuses_a_bad_config_in_one_line(capsys):
    assert main(["train", "--print-config", "train.decay_steps=3"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "train.decay_steps=3 applies to train.schedule=wsd only" in err


@pytest.mark.parametrize("command", COMMANDS)
def test_each_command_prints_plain_help(command):
    result = run_xscale(command, "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: xscale {command}") and not result.stderr
    assert not MARKUP.search(result.stdout), result.stdout


@pytest.mark.parametrize("argv", [["bench", name] for name in ("train", "attention", "kernels", "moe", "parallel",
                                                               "dropout")] + [["data", "tokenizer"],
                                                                             ["data", "preprocess"]])
def test_each_tool_prints_plain_help(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and out.startswith(f"usage: xscale {' '.join(argv)} ")
    assert not MARKUP.search(out), out


BAD_INPUT = {  # command -> (arguments, what the one stderr line says)
    "train": (["model.n_heads=7"], "does not divide model.d_model"),
    "inspect": (["model.n_heads=7"], "does not divide model.d_model"),
    "plan": (["{tmp}/missing.yaml", "--cluster", "{tmp}/cluster.yaml", "--devices", "8"], "cluster.yaml: cannot be read"),
    "export": (["{tmp}/missing", "{tmp}/out.safetensors"], "missing is not a complete xscale checkpoint"),
    "bench": (["atention"], "unknown benchmark 'atention' (did you mean 'attention'?)"),
    "data": (["tokenizer", "--input", "{tmp}/missing.txt", "--vocab-size", "1000", "--output", "{tmp}/tok"],
             "missing.txt does not exist"),
    "submit": (["{tmp}/missing.yaml", "--dry-run"], "missing.yaml' does not exist"),
    "parity": (["--layouts", "dp_shard=2", "tpp=2"], "unknown key 'parallel.tpp' (did you mean 'tp'?)"),
    "eval": (["{tmp}/missing"], "missing does not exist"),
    "generate": (["{tmp}/missing", "--tokens", "1"], "missing does not exist"),
    "convert": (["hf-to-xscale", "{tmp}/missing", "{tmp}/out"], "missing is not a Hugging Face model folder"),
    "chaos": (["--kinds", "kill_node", "--output-dir", "{tmp}/soak"], "unknown fault kind kill_node"),
}


@pytest.mark.parametrize("command", COMMANDS)
def test_bad_input_is_one_line_and_exit_2(command, tmp_path):
    arguments, expected = BAD_INPUT[command]
    result = run_xscale(command, *(argument.format(tmp=tmp_path) for argument in arguments), cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith(f"xscale {command}") and expected in lines[0], lines[0]


@pytest.mark.parametrize("argv", [["train", "--bogus"], ["export"], ["parity"], ["bench"], ["data"], ["--bogus"]])
def test_a_usage_error_is_one_line_too(argv, capsys):
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err


def _train_and_report(argv: list[str]) -> list:
    code = main(argv)
    import torch.distributed as dist

    return [code, dist.is_initialized()]


def test_a_launched_run_tears_its_process_group_down(tmp_path):
    """Each rank of a finished ``xscale train`` destroys the group it made: left to exit-time destructors, gloo's
    threads aborted a rank after a successful run ("terminate called without an active exception")."""
    from xscale.commands.parity import run_local

    argv = ["train", "train.steps=1", "train.global_batch_size=4", "train.seq_len=16", "model.n_layers=1",
            "model.d_model=32", "model.n_heads=2", "model.vocab_size=512", "data.tokenizer_vocab_size=512",
            "parallel.dp_shard=2", "train.plot=false", f"train.output_dir={tmp_path}"]
    assert run_local(_train_and_report, 2, argv) == [[0, False], [0, False]]


# Commands that never compile nor load a Hugging Face model: importing them must not load torch._dynamo (a second of
# every start-up, pulled in by @torch.compiler.disable at import), DeepSpeed or transformers.
LIGHT_COMMANDS = ("data", "generate", "export", "convert", "bench", "submit", "chaos")


def test_light_commands_start_without_dynamo_deepspeed_or_transformers():
    modules = ", ".join(f"xscale.commands.{name}" for name in LIGHT_COMMANDS)
    code = (f"import sys, xscale.cli, {modules}\n"
            "print(sorted(name for name in ('torch._dynamo', 'deepspeed', 'transformers') if name in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=ENV)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]", f"importing the light commands loaded {result.stdout.strip()}"


# The commands of a run: importing them and the default config's set-up (its model built and initialised, a forward
# and backward, xscale inspect) load nothing only some runs need: torch._dynamo (torch.compile; also imported by the
# two below), torch's pipelining (parallel.pp > 1), MemTracker (inspect --measure), DeepSpeed, transformers (Hugging
# Face in or out), rich (preprocessing's progress bar). torch's own optimizer imports torch._dynamo when built, so a
# training run still loads it there.
RUN_COMMANDS = ("train", "inspect", "eval", "plan")
ONLY_SOME_RUNS = ("torch._dynamo", "torch.distributed.pipelining", "torch.distributed._tools.mem_tracker", "deepspeed",
                  "transformers", "rich")


def test_a_default_run_sets_up_without_what_only_some_runs_need():
    modules = ", ".join(f"xscale.commands.{name}" for name in RUN_COMMANDS)
    code = (f"import contextlib, io, sys, torch, xscale.cli, {modules}\n"
            "from xscale.config.load import load_config\n"
            "from xscale.parallel.checks import resolve_layout\n"
            "from xscale.parallel.parallelize import parallelize\n"
            "from xscale.train.step import forward_backward_step\n"
            "dims, config = resolve_layout(load_config(None, ['model.vocab_size=512']), 1)\n"
            "ids = torch.randint(0, 512, (2, 16))\n"
            "forward_backward_step(parallelize(config, dims, None, torch.device('cpu')), {'input_ids': ids, 'labels': ids})\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    assert xscale.cli.main(['inspect']) == 0\n"
            f"print(sorted(name for name in {ONLY_SOME_RUNS} if name in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=ENV)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]", f"a default run's set-up loaded {result.stdout.strip()}"


@pytest.mark.parametrize("argv, title, entries", [
    (["--help"], "commands", {name: text for name, (_, _, text) in COMMANDS.items()}),
    (["data", "--help"], "tools", {name: text for name, (_, text) in TOOLS.items()}),
    (["bench", "--help"], "benchmarks", BENCHMARKS),
])
def test_commands_made_of_subcommands_share_one_help_layout(argv, title, entries, capsys):
    """xscale, xscale data and xscale bench: usage, options, then a titled section with each subcommand and the
    start of its one-line description on the same line."""
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: xscale {' '.join(argv[:-1])}".rstrip() + " [-h]")
    assert "\noptions:\n" in out and f"\n{title}:\n" in out
    listed = out.split(f"\n{title}:\n", 1)[1]
    for name, text in entries.items():
        assert re.search(rf"^    {name} +{re.escape(text.split()[0])}", listed, re.M), f"{name} not listed:\n{out}"
