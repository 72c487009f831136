"""The sentence pairs of BERT's NSP (Devlin et al. 2019) and ALBERT's SOP (Lan et al. 2020), seeded: [CLS] A [SEP]
B [SEP] from the window, half the pairs flipped (B swapped before A, or B from a random place of the corpus), the
separators never masked, the masked tokens' labels the originals."""

import pytest
import torch

from xscale.data.objectives import IGNORE_INDEX, sentence_pair

CLS, SEP, MASK = 2, 3, 4
WINDOW = torch.arange(10, 39)  # 29 tokens: a pair of 32
ELSEWHERE = torch.arange(100, 200)


def _random_segment(count: int, generator: torch.Generator) -> torch.Tensor:
    start = int(torch.randint(len(ELSEWHERE) - count + 1, (1,), generator=generator))
    return ELSEWHERE[start:start + count]


def _pair(kind: str, seed: int) -> dict[str, torch.Tensor]:
    return sentence_pair(WINDOW, torch.Generator().manual_seed(seed), kind=kind, cls_id=CLS, sep_id=SEP,
                         vocab_size=200, mask_id=MASK, special_ids=[0, 1, CLS, SEP, MASK],
                         random_segment=_random_segment)


def _segments(sample: dict[str, torch.Tensor]) -> tuple[list[int], list[int]]:
    """The unmasked A and B: labels where a token is masked, the input elsewhere."""
    original = torch.where(sample["labels"] != IGNORE_INDEX, sample["labels"], sample["input_ids"])
    assert original[0] == CLS and original[-1] == SEP
    middle = torch.nonzero(original == SEP).flatten()[0]
    return original[1:middle].tolist(), original[middle + 1:-1].tolist()


@pytest.mark.parametrize("kind", ["sop", "nsp"])
def test_pairs_are_laid_out_and_labelled(kind):
    flipped = 0
    for seed in range(400):
        sample = _pair(kind, seed)
        first, second = _segments(sample)
        assert sample["input_ids"].shape == (32,) and first and second
        labelled = sample["labels"] != IGNORE_INDEX
        assert not labelled[0] and not labelled[len(first) + 1] and not labelled[-1], "separators are never masked"
        assert int(labelled.sum()) == round(0.15 * 29)
        label = int(sample["pair_label"])
        flipped += label
        if label == 0:
            assert first + second == WINDOW.tolist()
        elif kind == "sop":
            assert second + first == WINDOW.tolist(), "sentence order: the window's two parts swapped"
        else:
            assert first == WINDOW[:len(first)].tolist() and min(second) >= 100, "B from elsewhere in the corpus"
    assert flipped / 400 == pytest.approx(0.5, abs=0.07)


def test_next_sentence_prediction_needs_a_corpus():
    with pytest.raises(ValueError, match="needs a corpus to draw random second segments"):
        for seed in range(10):
            sentence_pair(WINDOW, torch.Generator().manual_seed(seed), kind="nsp", cls_id=CLS, sep_id=SEP,
                          vocab_size=200, mask_id=MASK, special_ids=[CLS, SEP, MASK])
