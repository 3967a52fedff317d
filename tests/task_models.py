"""Models and files with known answers for the evaluation-task tests (unit and distributed)."""

from __future__ import annotations

import random

import torch

from dtmega.data.tokenizers import ByteTokenizer
from dtmega.models import Llama, LlamaConfig

BYTES = ByteTokenizer()


def small_model(seed: int = 0) -> Llama:
    torch.manual_seed(seed)
    model = Llama(LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=BYTES.vocab_size, ffn_dim=128,
                              max_seq_len=64, init_std=0.1, rope_theta=10000.0, rope_scaling=None))
    model.init_weights(seed=seed)
    return model


LETTERS = "abcdefghijklmnopqrstuvwxyz "


def next_letter_model() -> Llama:
    """A Llama whose argmax after any byte is a known function of that byte alone: the blocks add
    nothing (their output projections are zero), and the output layer maps the normalized
    embedding of byte t to the row of f(t), where f cycles ' ' -> a -> b ... -> z -> ' ' and
    leaves every other byte where it is."""
    model = small_model()
    f = {t: t for t in range(BYTES.vocab_size)}
    cycle = [ord(c) for c in LETTERS]
    for i, t in enumerate(cycle):
        f[t] = cycle[(i + 1) % len(cycle)]
    with torch.no_grad():
        for block in model.layers.values():
            block.attention.wo.weight.zero_()
            block.feed_forward.w2.weight.zero_()
        normalized = model.norm(model.tok_embeddings.weight)
        for t, target in f.items():
            model.output.weight[target] = normalized[t]
    return model




# Passages and their answers under `next_letter_model`: loose (last token) 5 of 6, strict (last word) 2 of 6.
LAMBADA_PASSAGES = [
    "we xy abc",   # last token 'c' after 'b': right; last word 'abc' after 'xy': 'y'->'z', not ' ': wrong
    "we yz abc",   # right; strict: 'z'->' ', ' '->'a', 'a'->'b', 'b'->'c': right
    "we yz abd",   # 'b'->'c', not 'd': wrong in both
    "we mn opq",   # 'p'->'q': right; strict: 'n'->'o', not ' ': wrong
    "go yz hij",   # right; strict: ' '->'a', not 'h': wrong
    "so xyz abcd",  # right in both
]
LAMBADA_ANSWERS = {False: 5, True: 2}


def wikitext_sample(seed: int = 0, words: int = 160) -> str:
    """A WikiText-style text (heading markers, " @-@ ", spaced punctuation) of random words."""
    rng = random.Random(seed)
    vocabulary = ["the", "of", "@-@", "king", ",", "land", ".", "=", "and", "( God )", "'s"]
    return " = Title = \n" + " ".join(rng.choice(vocabulary) for _ in range(words)) + " \n"
