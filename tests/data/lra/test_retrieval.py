"""The byte-level matching task: deterministic by seed, balanced, and its label says whether the sources match."""

import random
from collections import Counter

from xscale.data.lra.retrieval import RetrievalTask


def test_examples_are_deterministic_by_seed_and_shaped():
    task = RetrievalTask(seq_len=65)
    first = [task.example(random.Random(seed)) for seed in range(5)]
    assert first == [RetrievalTask(seq_len=65).example(random.Random(seed)) for seed in range(5)]
    tokens, _ = first[0]
    assert len(tokens) == 65 and tokens[32] == task.vocab.sep_id
    assert all(task.vocab.first_symbol_id <= t < task.vocab.vocab_size for i, t in enumerate(tokens) if i != 32)


def test_labels_are_balanced_and_follow_the_sources():
    task = RetrievalTask(seq_len=401, num_sources=4)
    labels = [task.example(random.Random(seed))[1] for seed in range(200)]
    assert 0.35 < sum(labels) / len(labels) < 0.65
    # The overlap of the two documents' bigram histograms tells same-source pairs from different ones.
    right = 0
    for seed in range(60):
        tokens, label = task.example(random.Random(1000 + seed))
        first, second = (Counter(zip(doc, doc[1:])) for doc in (tokens[:200], tokens[201:]))
        overlap = sum((first & second).values()) / 199
        right += (overlap > 0.2) == bool(label)
    assert right / 60 > 0.9, right


def test_sharper_sources_concentrate_each_byte_on_fewer_successors():
    """``sharpness`` is the exponent of the transition weights u^s: the larger, the more a source repeats its own
    bigrams (the bench's knob for a task a small model learns within its budget)."""
    def top_share(sharpness: float) -> float:
        source = RetrievalTask(seq_len=65, sharpness=sharpness).sources[0]
        return sum(max(row) / sum(row) for row in source.weights) / len(source.weights)

    assert top_share(4.0) < 0.2 < 0.35 < top_share(20.0)
