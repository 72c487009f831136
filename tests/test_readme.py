"""Every command in README.md's code blocks runs, in README order, in one folder (shortened: 2 training steps).

A command either runs here (with the placeholders of :data:`RULES` filled in and training cut to a few steps) or
names the tests that run it elsewhere (the install lines: ``.ci/run``; multi-node and Slurm lines: the launcher and
cluster tiers). A new README command without a rule fails :func:`test_every_readme_command_has_a_rule`.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
SHORT_TRAINING = ["train.steps=2", "train.warmup_steps=1", "train.log_every=1", "train.eval_every=0",
                  "train.global_batch_size=4", "train.seq_len=32", "train.plot=false", "train.progress=false"]


@dataclass(frozen=True)
class Rule:
    pattern: str  # a regular expression the command must match from its start
    covered_by: tuple[str, ...] = ()  # test files (under the repo root) that run it instead, with a word they hold
    replace: dict[str, str] = field(default_factory=dict)  # placeholders filled in before running

    def matches(self, command: str) -> bool:
        return re.match(self.pattern, command) is not None


RULES = (
    Rule(r"python -m pip install ", covered_by=(".ci/run:python -m pip install -q -e", ".ci/run:python -m pytest -q")),
    Rule(r"launch/torchrun\.sh --nnodes", covered_by=("tests/launcher/test_launch_scripts.py:--nnodes",
                                                       "tests/e2e/test_slurm_train.py:torchrun")),
    Rule(r"sbatch launch/slurm\.sbatch", covered_by=("tests/launcher/test_launch_scripts.py:slurm.sbatch",
                                                     "tests/e2e/test_slurm_train.py:slurm")),
    Rule(r"launch/mpirun\.sh", covered_by=("tests/launcher/test_launch_scripts.py:mpirun.sh",
                                           "tests/e2e/test_mpi_launch.py:mpirun")),
    Rule(r"launch/torchrun\.sh --nproc-per-node",
         replace={"--nproc-per-node 8": "--nproc-per-node 2", "CONFIG": "configs/tiny-gpt.yaml", " [overrides]": ""}),
    Rule(r"xscale submit ", replace={"CONFIG": "configs/tiny-gpt.yaml", " [overrides]": "",
                                     "--partition P": "--partition ci", "[--dry-run]": "--dry-run"}),
    Rule(r"(python -c|xscale|torchrun) "),
    Rule(r"xscale$"),
)


def readme_commands() -> list[str]:
    """The commands of README.md's bash blocks in order: continuation lines joined, comments dropped."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", README.read_text(), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                commands.append(re.sub(r"\s+#.*$", "", line).strip())  # no README command holds a quoted '#'
    return commands


def readme_python_examples() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def rule_for(command: str) -> Rule | None:
    return next((rule for rule in RULES if rule.matches(command)), None)


def test_every_readme_command_has_a_rule():
    commands = readme_commands()
    assert len(commands) > 20, "README.md's bash blocks were not found"
    missing = [command for command in commands if rule_for(command) is None]
    assert not missing, f"README commands with no rule in tests/test_readme.py: {missing}"


def test_commands_run_elsewhere_are_run_there():
    for rule in RULES:
        for place in rule.covered_by:
            path, word = place.split(":", 1)
            assert word in (ROOT / path).read_text(), f"{path} no longer runs '{word}' (README rule {rule.pattern})"


def shortened(command: str, index: int) -> str:
    """``command`` with its placeholders filled and any training cut to 2 steps in its own output folder."""
    for old, new in rule_for(command).replace.items():
        command = command.replace(old, new)
    words = shlex.split(command)
    trains = words[0] == "launch/torchrun.sh" or words[0] in ("xscale", "torchrun") and "train" in words[:6]
    if trains and "--print-config" not in words:
        extra = list(SHORT_TRAINING)
        if words != ["xscale", "train"] and not any(word.startswith("train.output_dir=") for word in words):
            extra.append(f"train.output_dir=runs/readme-{index}")  # the bare default keeps runs/default: the
        command += " " + " ".join(extra)                              # evaluation examples read it
    if words[:2] == ["xscale", "parity"]:  # overrides go before --layouts, which takes the rest
        command = shlex.join([*words[:3], "train.global_batch_size=4", "train.seq_len=32", *words[3:], "--steps", "2"])
    return command


def write_user_files(folder: Path) -> None:
    """The files README's examples name as the user's own: a corpus, jsonl documents, a tokenizer.json."""
    tokenizers = pytest.importorskip("tokenizers", reason="the README's data examples use a tokenizer.json")
    lines = [f"def function_{i}(value):\n    return value * {i} + len('text {i}')\n" for i in range(300)]
    (folder / "corpus.txt").write_text("".join(lines))
    (folder / "other.txt").write_text("".join(reversed(lines)))
    (folder / "heldout.txt").write_text("".join(lines[::3]))
    (folder / "docs.jsonl").write_text("".join(json.dumps({"body": line, "id": i}) + "\n" for i, line in enumerate(lines)))
    (folder / "code.jsonl").write_text("".join(json.dumps({"text": line}) + "\n" for line in lines[::2]))
    model = tokenizers.models.BPE(unk_token="<unk>")
    tokenizer = tokenizers.Tokenizer(model)
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<unk>", "<s>", "</s>"])
    tokenizer.train_from_iterator(lines, trainer)
    tokenizer.save(str(folder / "tokenizer.json"))


def environment(folder: Path) -> dict[str, str]:
    """``python``, ``xscale`` and ``torchrun`` on PATH: this interpreter running this checkout; no network."""
    tools = folder / ".tools"
    tools.mkdir()
    for name, arguments in (("xscale", "-m xscale"), ("torchrun", "-m torch.distributed.run"), ("python", "")):
        (tools / name).write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} {arguments} \"$@\"\n")
        (tools / name).chmod(0o755)
    python_path = os.pathsep.join([str(ROOT), str(ROOT / "kernels"), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PATH": f"{tools}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": python_path,
            "PYTHON": sys.executable, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


@pytest.mark.slow
@pytest.mark.timeout(2400)  # ~30 commands, a few of them 4 and 8 processes
def test_readme_commands_run_in_order(tmp_path):
    for name in ("configs", "launch", "README.md"):
        (tmp_path / name).symlink_to(ROOT / name)
    write_user_files(tmp_path)
    env = environment(tmp_path)
    ran = 0
    for index, command in enumerate(readme_commands()):
        if rule_for(command).covered_by:
            continue
        runnable = shortened(command, index)
        result = subprocess.run(["bash", "-c", runnable], cwd=tmp_path, env=env, capture_output=True, text=True,
                                timeout=600)
        output = (result.stdout + result.stderr)[-3000:]
        assert result.returncode == 0, f"README command failed ({result.returncode}): {runnable}\n{output}"
        assert "Traceback" not in result.stderr, f"{runnable}\n{output}"
        ran += 1
    assert ran > 20
    assert (tmp_path / "hf-llama" / "config.json").is_file() and (tmp_path / "run.yaml").is_file()


@pytest.mark.slow
def test_readme_python_examples_run(tmp_path):
    examples = readme_python_examples()
    assert examples, "README.md's python blocks were not found"
    env = environment(tmp_path)
    for example in examples:
        result = subprocess.run([sys.executable, "-c", example], cwd=tmp_path, env=env, capture_output=True, text=True,
                                timeout=600)
        assert result.returncode == 0, f"README example failed:\n{example}\n{(result.stdout + result.stderr)[-3000:]}"


# ---------------------------------------------------------------- the Quick start on its own install lines
PYPROJECT = ROOT / "pyproject.toml"


def _tomllib():
    import tomllib

    return tomllib


def quick_start_commands() -> list[str]:
    """The commands of the README's Quick start section, in order (continuation lines joined, comments dropped)."""
    section = README.read_text().split("## Quick start", 1)[1].split("\n## ", 1)[0]
    block = re.findall(r"```bash\n(.*?)```", section, re.S)[0]
    return [re.sub(r"\s+#.*$", "", line).strip() for line in block.replace("\\\n", " ").splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def installed_by_readme() -> set[str]:
    """The distributions the README's install lines bring: the base install (its first code block) plus the
    extras the Quick start's install lines name, with everything they require (normalised names)."""
    project = _tomllib().loads(PYPROJECT.read_text())["project"]
    wanted = list(project["dependencies"])
    for command in [readme_commands()[0], *quick_start_commands()]:
        for extras in re.findall(r"pip install -e \"?\.\[([\w,]+)\]", command):
            for extra in extras.split(","):
                wanted += project["optional-dependencies"][extra]
    names: set[str] = set()
    while wanted:
        requirement = Requirement(wanted.pop())
        name = requirement.name.lower().replace("_", "-")
        if name in names or (requirement.marker and not requirement.marker.evaluate({"extra": ""})):
            continue
        names.add(name)
        try:
            wanted += metadata.requires(requirement.name) or []
        except metadata.PackageNotFoundError:
            pass
    return names


def modules_not_installed_by_readme() -> set[str]:
    """Top-level modules of this environment's optional (dev) distributions that the README's lines do not
    install: what a fresh venv made from those lines lacks."""
    project = _tomllib().loads(PYPROJECT.read_text())["project"]
    optional = {Requirement(text).name.lower().replace("_", "-") for texts in project["optional-dependencies"].values()
                for text in texts}
    missing = optional - installed_by_readme()
    return {module for module, dists in metadata.packages_distributions().items()
            if all(dist.lower().replace("_", "-") in missing for dist in dists)}


def test_the_quick_start_install_line_brings_what_its_commands_import():
    """The issue's case: the Quick start's first command imports transformers, which `pip install -e .` lacks, and
    preprocessing and blends need megatron-core."""
    installed = installed_by_readme()
    commands = " ".join(quick_start_commands())
    needed = {module.replace("_", "-") for module in re.findall(r"from (\w+)(?:\.\w+)* import", commands)}
    if "xscale data preprocess" in commands or "data.sources" in commands:
        needed.add("megatron-core")  # .bin/.idx and blends (xscale/data/indexed.py, blend.py)
    assert needed and needed <= installed, f"the README's install lines do not install {sorted(needed - installed)}"


def readme_install_lines() -> list[str]:
    """The install lines a new user runs before the Quick start, verbatim: the pip commands of the README's first
    command (base install) and of the Quick start."""
    first = [part.strip() for part in readme_commands()[0].split("&&")]
    return [part for part in [*first, *quick_start_commands()] if part.startswith("python -m pip install ")]


def copy_of_this_checkout(folder: Path) -> Path:
    """The files a clone of this working tree has (tracked and untracked, not ignored), copied to ``folder``."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True,
                            check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, folder / name)
    return folder


def fresh_venv(folder: Path, blocked: set[str]) -> dict[str, str]:
    """A venv seeing the system's packages, with ``blocked`` (what the README's lines do not install) made
    unimportable, so that only the README's install lines can bring a package: the network-free stand-in for a
    venv that starts empty. Returns the environment that puts it first on PATH."""
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(folder / "venv")], check=True)
    site = folder / "site"
    site.mkdir()
    # An import of a blocked module fails as a missing one does; a probe (importlib.util.find_spec, which
    # transformers runs on optional packages such as torchao when it imports its model classes) gets None, as it
    # does for a package that is not there, instead of the finder's exception.
    (site / "sitecustomize.py").write_text(
        "import importlib.util\nimport sys\n\n"
        f"BLOCKED = {sorted(blocked)!r}\n\n\nclass NotInstalled:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in BLOCKED:\n"
        "            raise ModuleNotFoundError(f'No module named {name!r} (not installed by the README)', name=name)\n"
        "        return None\n\n\nsys.meta_path.insert(0, NotInstalled())\n"
        "_find_spec = importlib.util.find_spec\n\n\n"
        "def find_spec(name, package=None):\n"
        "    return None if name.split('.')[0] in BLOCKED else _find_spec(name, package)\n\n\n"
        "importlib.util.find_spec = find_spec\n")
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    return {**env, "PATH": f"{folder / 'venv' / 'bin'}{os.pathsep}{env['PATH']}", "PYTHONPATH": str(site),
            "VIRTUAL_ENV": str(folder / "venv"), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "OMP_NUM_THREADS": "1"}


HF_EXPORT_MATCHES = """
import torch, transformers
from xscale.commands.trained import load_trained_model
from xscale.data.load_tokenizer import load_tokenizer
text = 'def main(argv):\\n    return 42'
hf_tokenizer = transformers.AutoTokenizer.from_pretrained('hf-llama')
ids = load_tokenizer('tok.model').encode(text)
assert hf_tokenizer.encode(text) == ids, f'token ids differ: {hf_tokenizer.encode(text)} != {ids}'
hf_model = transformers.AutoModelForCausalLM.from_pretrained('hf-llama').eval()
xscale_model = load_trained_model('runs/llama').model
with torch.no_grad():
    hf_logits = hf_model(torch.tensor([ids])).logits[0]
    xscale_logits = xscale_model(torch.tensor([ids]))[0, :, :hf_logits.shape[-1]]
difference = (hf_logits - xscale_logits).abs().max().item()
assert difference < 1e-4, f'logits differ by {difference}'
print(f'{len(ids)} ids equal, logits within {difference:.1e}')
"""


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_the_quick_start_runs_verbatim_in_a_fresh_venv(tmp_path):
    """The issue's Done-when: in a fresh venv, the README's install lines run as written, then every Quick start
    command verbatim in the clone; the HF export loads with AutoTokenizer (same ids as xscale's tokenizer) and
    AutoModelForCausalLM (same logits as the xscale checkpoint)."""
    checkout = copy_of_this_checkout(tmp_path / "xscale")
    env = fresh_venv(tmp_path, modules_not_installed_by_readme())
    for command in readme_install_lines():
        result = subprocess.run(["bash", "-c", command], cwd=checkout, env=env, capture_output=True, text=True,
                                timeout=600)
        assert result.returncode == 0, f"README install line failed: {command}\n{(result.stdout + result.stderr)[-3000:]}"
    venv_bin = tmp_path / "venv" / "bin"
    assert (venv_bin / "xscale").is_file(), "the README's install lines did not install the xscale command"
    if not (venv_bin / "torchrun").exists():  # torch's console script, which the system's torch keeps outside the venv
        (venv_bin / "torchrun").write_text(f"#!/bin/sh\nexec {venv_bin / 'python'} -m torch.distributed.run \"$@\"\n")
        (venv_bin / "torchrun").chmod(0o755)
    for command in quick_start_commands():
        if command.startswith("python -m pip install "):
            continue
        result = subprocess.run(["bash", "-c", command], cwd=checkout, env=env, capture_output=True, text=True,
                                timeout=600)
        output = (result.stdout + result.stderr)[-3000:]
        assert result.returncode == 0, f"Quick start command failed ({result.returncode}): {command}\n{output}"
        assert "Traceback" not in result.stderr, f"{command}\n{output}"
    matches = subprocess.run([str(venv_bin / "python"), "-c", HF_EXPORT_MATCHES], cwd=checkout, env=env,
                             capture_output=True, text=True, timeout=600)
    assert matches.returncode == 0, matches.stdout + matches.stderr
