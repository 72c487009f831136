"""Synthetic tasks that need no download: copy, associative recall (Ba et al. 2016; Zoology, Arora et al. 2023)
and ListOps as generated for Long Range Arena (Nangia & Bowman 2018; Tay et al. 2021).

A task turns a seeded ``random.Random`` into one example ``(prompt, answer)`` of token ids over its
:class:`FixedVocab`; :mod:`xscale.data.datasets` lays examples out for the objective.
"""

from __future__ import annotations

import random
import statistics

from xscale.data.fixed_vocab import FixedVocab

Example = tuple[list[int], list[int]]


class CopyTask:
    """Prompt ``<s> x_1 .. x_n <sep>``; answer ``x_1 .. x_n`` (n uniform symbols)."""

    def __init__(self, seq_len: int, num_symbols: int = 32, length: int | None = None) -> None:
        self.vocab = FixedVocab([f"c{i}" for i in range(num_symbols)])
        self.length = length if length is not None else (seq_len - 2) // 2
        if self.length < 1 or 2 * self.length + 2 > seq_len:
            raise ValueError(f"copy task: length={self.length} does not fit seq_len={seq_len} "
                             f"(needs 2*length+2 <= seq_len); raise train.seq_len or lower data.dataset.options.length")
        self.num_symbols = num_symbols

    def example(self, rng: random.Random) -> Example:
        first = self.vocab.first_symbol_id
        symbols = [first + rng.randrange(self.num_symbols) for _ in range(self.length)]
        return [self.vocab.bos_id, *symbols, self.vocab.sep_id], symbols


class AssociativeRecallTask:
    """Prompt ``k_1 v_1 .. k_n v_n <sep> k_q``; answer ``v_q`` (distinct keys, values with replacement)."""

    def __init__(self, seq_len: int, num_keys: int = 64, num_values: int = 64, pairs: int | None = None) -> None:
        self.vocab = FixedVocab([f"k{i}" for i in range(num_keys)] + [f"v{i}" for i in range(num_values)])
        self.pairs = pairs if pairs is not None else min((seq_len - 3) // 2, num_keys)
        if self.pairs < 1 or 2 * self.pairs + 3 > seq_len or self.pairs > num_keys:
            raise ValueError(f"associative recall: pairs={self.pairs} needs 2*pairs+3 <= seq_len={seq_len} and "
                             f"pairs <= num_keys={num_keys}; change data.dataset.options or train.seq_len")
        self.num_keys, self.num_values = num_keys, num_values

    def example(self, rng: random.Random) -> Example:
        first_key = self.vocab.first_symbol_id
        first_value = first_key + self.num_keys
        keys = [first_key + k for k in rng.sample(range(self.num_keys), self.pairs)]
        values = [first_value + rng.randrange(self.num_values) for _ in range(self.pairs)]
        query = rng.randrange(self.pairs)
        prompt = [token for pair in zip(keys, values) for token in pair] + [self.vocab.sep_id, keys[query]]
        return prompt, [values[query]]


LISTOPS_OPERATORS = {
    "[MAX": max,
    "[MIN": min,
    "[MED": lambda values: int(statistics.median(values)),
    "[SM": lambda values: sum(values) % 10,
}
LISTOPS_CLOSE = "]"
# LRA draws an operator node with this probability (else a digit) at every depth below max_depth.
_OPERATOR_PROBABILITY = 0.25


class ListOpsTask:
    """LRA ListOps: nested MAX/MIN/MED/SUM_MOD over digits, e.g. ``[MAX 2 9 [MIN 4 7 ] 0 ]`` -> 9.

    Trees follow LRA's generator (operator with p=0.25 below ``max_depth``, 2..``max_args`` arguments),
    rejected until their token count lies in [min_length, max_length]; the answer is one digit token.
    """

    def __init__(self, seq_len: int, max_depth: int = 10, max_args: int = 10, min_length: int | None = None,
                 max_length: int | None = None) -> None:
        self.vocab = FixedVocab(list(LISTOPS_OPERATORS) + [LISTOPS_CLOSE] + [str(d) for d in range(10)])
        self.max_length = max_length if max_length is not None else seq_len - 1
        self.min_length = min_length if min_length is not None else max(3, self.max_length // 4)
        if not 3 <= self.min_length <= self.max_length <= seq_len - 1:
            raise ValueError(f"listops: need 3 <= min_length={self.min_length} <= max_length={self.max_length} <= "
                             f"seq_len-1={seq_len - 1}; change data.dataset.options or train.seq_len")
        if max_args < 2 or max_depth < 1:
            raise ValueError(f"listops: max_args={max_args} must be >= 2 and max_depth={max_depth} >= 1")
        self.max_depth, self.max_args = max_depth, max_args

    def example(self, rng: random.Random) -> Example:
        while True:
            tokens: list[str] = []
            value = self._tree(rng, 1, tokens)
            if value is not None and len(tokens) >= self.min_length:
                return [self.vocab.ids[t] for t in tokens], [self.vocab.ids[str(value)]]

    def _tree(self, rng: random.Random, depth: int, tokens: list[str]) -> int | None:
        """Append one subtree's tokens and return its value; None once it grows past max_length."""
        if depth >= self.max_depth or rng.random() > _OPERATOR_PROBABILITY:
            digit = rng.randrange(10)
            tokens.append(str(digit))
            return digit if len(tokens) <= self.max_length else None
        operator = rng.choice(list(LISTOPS_OPERATORS))
        tokens.append(operator)
        arguments = []
        for _ in range(rng.randint(2, self.max_args)):
            value = self._tree(rng, depth + 1, tokens)
            if value is None:
                return None
            arguments.append(value)
        tokens.append(LISTOPS_CLOSE)
        if len(tokens) > self.max_length:
            return None
        return LISTOPS_OPERATORS[operator](arguments)
