"""Which documents --eval_share holds out (preprocessing.heldout): a function of the text and --seed,
about the share asked for in each language, and nothing held out at 0."""

import random

import pytest

from preprocessing.heldout import held_out_rule
from tests.support.builder import WORDS


def _docs(n: int, *, zh: bool, seed: int) -> list[list[str]]:
    rng = random.Random(seed)
    if zh:
        return [["".join(chr(rng.randint(0x4E00, 0x9FFF)) for _ in range(30)) + "。"] for _ in range(n)]
    return [[" ".join(rng.choice(WORDS) for _ in range(12)) + f" {i}."] for i in range(n)]


@pytest.mark.parametrize("share", [0.01, 0.1, 0.5])
def test_about_the_share_in_every_language_and_a_function_of_text_and_seed(share):
    rule = held_out_rule(seed=12345, share=share)
    for zh in (False, True):
        docs = _docs(20000, zh=zh, seed=1)
        picked = [rule(d) for d in docs]
        n = len(docs)
        assert abs(sum(picked) - share * n) < 5 * (share * (1 - share) * n) ** 0.5, (zh, sum(picked))
        again = held_out_rule(seed=12345, share=share)
        assert [again(d) for d in docs] == picked  # the text and the seed decide
        assert [again(list(d)) for d in reversed(docs)] == picked[::-1]  # not the position
        other = held_out_rule(seed=54321, share=share)
        assert [other(d) for d in docs] != picked
    smaller = held_out_rule(seed=12345, share=share / 2)
    docs = _docs(2000, zh=False, seed=2)
    assert all(rule(d) for d in docs if smaller(d))  # a smaller share holds out a subset


def test_nothing_held_out_at_zero():
    assert held_out_rule(seed=1, share=0.0) is None
