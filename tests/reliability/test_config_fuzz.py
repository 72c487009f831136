"""Every field of every config section, set through the CLI's override path to each of seven bad values and run
through what ``xscale train`` checks before building anything (the config, then the layout for a world of one):
either a ConfigError whose message names the field, or a value the allow-list below documents as valid. Nothing
else escapes (no TypeError, ZeroDivisionError, OverflowError from deep code) and nothing hangs."""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import types
import typing
from collections.abc import Iterator

import pytest

from xscale.config.load import load_config_from_cli
from xscale.config.schema import Config, ConfigError
from xscale.parallel.checks import resolve_dims

# mutation -> the override's YAML text; "wrong_type" depends on the field (see wrong_type()).
MUTATIONS = {"wrong_type": None, "negative": "-1", "zero": "0", "nan": ".nan", "inf": ".inf", "huge": "1.0e+30",
             "empty": ""}
BASES = {"dense": [], "moe": ["model.moe.num_experts=4"]}  # MoE-only checks run only with experts


def _valid(reason: str, *pairs: tuple[str, str]) -> dict[tuple[str, str], str]:
    return dict.fromkeys(pairs, reason)


# (field, mutation) pairs that are legitimately valid, with why.
VALID = {
    # Zero switches a feature off or is the natural lower end of the range.
    **_valid("0 turns the feature off", ("model.dropout", "zero"), ("model.attention_dropout", "zero"),
             ("model.moe.aux_loss_coef", "zero"), ("model.moe.z_loss_coef", "zero"), ("model.moe.jitter", "zero"),
             ("train.grad_clip", "zero"), ("train.spike_factor", "zero"), ("train.eval_every", "zero"),
             ("train.weight_decay", "zero"), ("train.warmup_steps", "zero"), ("launch.max_restarts", "zero"),
             ("launch.max_requeues", "zero"), ("train.profile_steps", "zero"), ("model.segment_memory", "zero"),
             ("model.compressed_memory", "zero")),
    ("model.moe.num_experts", "zero"): "no experts: a dense FFN (the default)",
    ("model.moe.min_capacity", "zero"): "no floor under the expert capacity",
    ("model.vocab_size", "zero"): "the tokenizer's vocabulary, padded to 128 x tp (xscale/data/vocab_size.py)",
    ("model.num_classes", "zero"): "no classification head (train.task=classify takes the count from the labels)",
    ("parallel.zero_stage", "zero"): "ZeRO stage 0 is plain DDP (the default)",
    ("train.min_lr_ratio", "zero"): "the schedule decays to 0",
    ("train.beta1", "zero"): "Adam without momentum (torch allows [0, 1))",
    ("train.beta2", "zero"): "second moment of the last gradient only (torch allows [0, 1))",
    ("train.step_timeout_s", "zero"): "0 is the automatic step limit",
    ("train.seed", "zero"): "any non-negative seed",
    ("data.num_samples", "zero"): "0 is the synthetic task's default size",
    ("data.eval_fraction", "zero"): "no evaluation split",
    ("checkpoint.every", "zero"): "only the final checkpoint",
    ("checkpoint.memory_every", "zero"): "no memory snapshots (off)",
    ("launch.gpus_per_node", "zero"): "CPU processes",
    ("launch.requeue_signal_seconds", "zero"): "no advance warning before the time limit (Slurm accepts @0)",
    ("parallel.dp_shard", "negative"): "-1: what the world size leaves (the default)",
    ("checkpoint.every", "negative"): "-1: no checkpoint at all (benchmarks, throwaway runs)",
    # Finite, well defined, and no allocation, loop or timer depends on them; a value that makes training diverge
    # is stopped at the first non-finite loss by train.on_nonfinite.
    **_valid("finite and well defined", ("model.init_std", "huge"), ("model.moe.aux_loss_coef", "huge"), ("model.moe.z_loss_coef", "huge"),
             ("train.lr", "huge"), ("train.weight_decay", "huge"), ("train.eps", "huge"),
             ("train.peak_flops", "huge")),
    ("train.grad_clip", "huge"): "clipping never triggers",
    ("train.spike_factor", "huge"): "no loss counts as a spike",
    ("train.health_loss_factor", "huge"): "no loss counts as unhealthy (the gradient-collapse check still runs)",
    ("train.health_grad_collapse", "zero"): "0: the gradient-collapse check is off",
    ("train.first_step_timeout_s", "zero"): "0: the first steps, saves and evaluations are not watched",
    ("launch.min_nodes", "zero"): "0: not elastic, exactly launch.nodes",
}
# Valid only without experts: the capacity is unused, and with experts a factor above num_experts is refused.
VALID_WITHOUT_EXPERTS = _valid("unused while model.moe.num_experts=0", ("model.moe.capacity_factor", "huge"),
                               ("model.moe.eval_capacity_factor", "huge"))


def config_fields(cls: type = Config, prefix: str = "") -> Iterator[tuple[str, typing.Any]]:
    """(dotted name, annotation) of every field, sections and nested sections included, read from the dataclasses."""
    hints = typing.get_type_hints(cls)
    for item in dataclasses.fields(cls):
        dotted, annotation = prefix + item.name, hints[item.name]
        yield dotted, annotation
        if dataclasses.is_dataclass(annotation):
            yield from config_fields(annotation, dotted + ".")


FIELDS = dict(config_fields())


def wrong_type(annotation: typing.Any) -> str:
    """A value of another type: a string for numbers and flags, a number for strings, a mapping for lists, a list
    for mappings."""
    options = [option for option in typing.get_args(annotation) if option is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        annotation = options[0]
    origin = typing.get_origin(annotation)
    if origin is list:
        return "{a: 1}"
    if origin is dict:
        return "[1]"
    return "5" if annotation is str else "x"


class Hung(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    def expire(signum, frame):
        raise Hung(f"no answer within {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def outcome(base: list[str], field: str, text: str) -> str | None:
    """None when the CLI's loading path refuses ``field=text`` cleanly, "accepted" when it takes it, else what
    went wrong."""
    try:
        with time_limit(5):
            resolve_dims(load_config_from_cli(None, [*base, f"{field}={text}"]), 1)
    except ConfigError as error:
        return None if field in str(error) else f"refused without naming {field}: {error}"
    except Exception as error:  # any other exception is what this test looks for
        return f"{type(error).__name__}: {error}"
    return "accepted"


@pytest.mark.parametrize("base", BASES)
@pytest.mark.parametrize("field", FIELDS)
def test_each_bad_value_is_refused_naming_the_field_or_documented_as_valid(base, field):
    valid = {**VALID, **(VALID_WITHOUT_EXPERTS if base == "dense" else {})}
    problems = []
    for mutation, text in MUTATIONS.items():
        text = wrong_type(FIELDS[field]) if text is None else text
        result = outcome(BASES[base], field, text)
        if result == "accepted" and (field, mutation) in valid:
            continue
        if result is not None:
            problems.append(f"{field}={text!r} ({mutation}): {result}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("base", BASES)
def test_the_allow_list_is_not_stale(base):
    """Each allowed pair names a field and is still accepted (a fix that starts refusing it shrinks the list)."""
    valid = {**VALID, **(VALID_WITHOUT_EXPERTS if base == "dense" else {})}
    for (field, mutation), reason in valid.items():
        assert field in FIELDS and mutation in MUTATIONS, (field, mutation)
        text = MUTATIONS[mutation] or wrong_type(FIELDS[field])
        assert outcome(BASES[base], field, text) == "accepted", f"{field} {mutation} ({reason}) is now refused"


def test_the_fields_come_from_the_dataclasses():
    assert len(FIELDS) > 100
    for field in ("model", "model.moe.top_k", "model.attention.per_layer", "train.spike_factor",
                  "launch.max_requeues", "data.dataset.options"):
        assert field in FIELDS
