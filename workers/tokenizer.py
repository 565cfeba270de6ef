"""A byte-level BPE tokenizer of real size (32k tokens, say), trained on this machine: no download.

The sized configs (configs/grpo_100m.yaml, grpo_0.5b.yaml) need an embedding table of a real vocabulary, not
the tiny model's 14 words. The BPE is trained by `tokenizers` on text generated from a fixed seed: pseudo-words
(enough distinct letter pairs to fill any vocabulary up to `model.vocab_size`) and lines of the digit tasks'
shape ("3 5 = 5"), so that every digit, " 5" and " =" are single tokens and the default task's prompts and
answers tokenize as one token per symbol, as with the word-level tokenizer. Training is deterministic (the
same merges on every process, checked by a unit test) and takes about a second at 32k tokens, so every
process that needs it trains it in memory, once (cached per process), instead of sharing a file.
"""
from __future__ import annotations

import functools

import numpy as np

SPECIAL = ("<pad>", "<s>", "</s>")  # pad, bos, eos: ids 0, 1, 2 as in the word-level vocabulary
CORPUS_SEED = 20240917  # part of the tokenizer's definition: changing it changes every token id
WORDS_PER_TOKEN = 2  # generated pseudo-words per vocabulary entry: enough pairs to reach the size asked


def corpus(vocab_size: int, seed: int = CORPUS_SEED) -> list[str]:
    """Lines of generated text: pseudo-words of 2-7 letters, 20 a line, then "a b = c" digit lines."""
    rng = np.random.default_rng(seed)
    n = WORDS_PER_TOKEN * vocab_size
    lengths = rng.integers(2, 8, size=n)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))[rng.integers(0, 26, size=int(lengths.sum()))]
    text, ends = "".join(letters), np.cumsum(lengths)
    words = [text[e - k:e] for e, k in zip(ends.tolist(), lengths.tolist())]
    lines = [" ".join(words[i:i + 20]) for i in range(0, n, 20)]
    digits = rng.integers(0, 10, size=(n // 10, 3)).tolist()
    return lines + [f"{a} {b} = {c}" for a, b, c in digits]


@functools.lru_cache(maxsize=4)
def _trained(vocab_size: int) -> str:
    """The trained tokenizer as JSON (a string, so that every caller gets its own copy)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(vocab_size), trainer)
    if tok.get_vocab_size() != vocab_size:
        raise ValueError(f"model.vocab_size: the generated corpus gave only {tok.get_vocab_size()} of "
                         f"{vocab_size} BPE tokens")
    return tok.to_str()


def bpe_tokenizer(vocab_size: int):
    """A HuggingFace fast tokenizer over the trained BPE (exports save and reload it with AutoTokenizer)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer.from_str(_trained(vocab_size))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
