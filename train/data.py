"""Byte-level data for the tiny presets: tokenizer, built-in corpus, packed batches, long-context tasks.

Tokens are bytes: ids 0..255 are the UTF-8 bytes of the text, then BOS, EOS, PAD
(`csa2.presets`, vocabulary of 259). Everything here is numpy and deterministic:

- **Corpus** (`load_corpus`): the text of CPython's `pydoc_data.topics` (in every Python install,
  so nothing is downloaded). Topics are sorted by key and a text equal to an earlier one is dropped
  (some topics are aliases, e.g. `else`/`if`); document i (0-based, in that order) goes to
  validation when `i % 10 == 0`, otherwise to training, so the two splits share no document by
  construction (about 6% of the bytes on CPython 3.11). Each split is the concatenation of
  `[BOS] + utf8(text)` over its documents: BOS separates documents and no EOS is inserted. The
  bytes depend on the Python version.
- **Training batches** (`batches`): random windows of `seq_len + 1` tokens from the stream; the
  batch at step k is a pure function of (seed, k), so the data position of a run is its step and
  resuming with `start_step=k` is bit-identical to an uninterrupted run.
- **Evaluation batches** (`eval_batches`): the stream cut in order into windows that predict every
  token after the first exactly once, padded with PAD and masked out at the tail.
- **Long-context tasks** (`passkey_example`, `multi_needle_example`): filler text with needles at
  chosen relative depths, for the replay-window and Top-K experiments.

Bad arguments raise `ValueError` naming the field, the value and the fix (DESIGN §7).
"""

from __future__ import annotations

import re
from typing import Iterator, NamedTuple, Sequence

import numpy as np

from csa2.checks import fail, is_int
from csa2.presets import BYTE_VOCAB_SIZE, PAD_ID
from csa2.tokenizer import encode

VALID_EVERY = 10  # document i (distinct topic texts, sorted by key) is validation iff i % VALID_EVERY == 0



class Template(NamedTuple):
    """The wording of the long-context tasks: the filler (sentences, each ending in ". "), the pass key's needle
    (`{key}`) and question, a named key's needle (`{name}`, `{value}`) and the questions for one value of one name
    and for several (`{who}`: the asked names, joined by " and "). Each question ends where the answer begins."""

    filler: str
    passkey: str
    passkey_question: str
    named: str
    ask_one: str
    ask_many: str


TEMPLATES = {
    # What training rows use (train.longctx) and what every figure so far was scored on.
    "train": Template(
        filler="The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ",
        passkey="The pass key is {key}. Remember it. ", passkey_question="What is the pass key? The pass key is ",
        named="The key for {name} is {value}. ", ask_one="What is the key for {who}? The key for {who} is ",
        ask_many="What are the keys for {who}? The keys for {who} are "),
    # Never trained on: other filler and other phrasings of the same tasks, for evaluation.
    "held_out": Template(
        filler="A boat drifts on the lake. The wind turns cold. Birds fly south. Night falls on the hills. ",
        passkey="Keep this secret number in mind: {key}. ",
        passkey_question="Which secret number was given? The secret number is ",
        named="{name} holds the number {value}. ", ask_one="Which number does {who} hold? {who} holds ",
        ask_many="Which numbers do {who} hold? {who} hold "),
}
_NAMES = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india",
          "juliet", "kilo", "lima", "mike", "november", "oscar", "papa", "quebec", "romeo",
          "sierra", "tango", "uniform", "victor", "whiskey", "xray", "yankee", "zulu")


# ---------------------------------------------------------------------------------------------
# Corpus


class Corpus(NamedTuple):
    """Byte-id streams [N] int32 of the built-in corpus; documents start with BOS."""

    train: np.ndarray
    valid: np.ndarray


def load_corpus() -> Corpus:
    """CPython's `pydoc_data.topics`, distinct texts sorted by key; documents 0, 10, 20, … are validation."""
    from pydoc_data.topics import topics

    documents = list(dict.fromkeys(topics[key] for key in sorted(topics)))  # drop repeated texts (aliases)
    train: list[np.ndarray] = []
    valid: list[np.ndarray] = []
    for i, text in enumerate(documents):
        (valid if i % VALID_EVERY == 0 else train).append(encode(text, bos=True))
    return Corpus(train=np.concatenate(train), valid=np.concatenate(valid))


# ---------------------------------------------------------------------------------------------
# Batches


def _check_positive(field: str, value: object) -> None:
    """A positive Python/numpy int, or ValueError."""
    if not is_int(value) or value < 1:
        fail(field, value, "must be a positive integer")


def _check_tokens(tokens, min_len: int, fix: str) -> np.ndarray:
    """A 1-D int32 stream of at least `min_len` ids inside the byte vocabulary, or ValueError."""
    arr = np.asarray(tokens)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        fail("tokens", f"array of shape {arr.shape} and dtype {arr.dtype}", "pass a 1-D integer token stream")
    if arr.size < min_len:
        fail("tokens", f"stream of {arr.size} tokens", f"needs at least {min_len} tokens; {fix}")
    bad = (arr < 0) | (arr >= BYTE_VOCAB_SIZE)
    if bad.any():
        fail("tokens", int(arr[bad][0]), f"token ids must lie in [0, {BYTE_VOCAB_SIZE})")
    return arr.astype(np.int32)


def batches(tokens, batch_size: int, seq_len: int, *, seed: int,
            start_step: int = 0) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Infinite (inputs [B, L], targets [B, L]) int32 random windows; step k depends only on (seed, k)."""
    _check_positive("batch_size", batch_size)
    _check_positive("seq_len", seq_len)
    if not is_int(seed) or seed < 0:
        fail("seed", seed, "must be a non-negative integer")
    if not is_int(start_step) or start_step < 0:
        fail("start_step", start_step, "must be a non-negative integer (the saved data position)")
    arr = _check_tokens(tokens, seq_len + 1, "a window is seq_len + 1 tokens, lower seq_len")
    offsets = np.arange(seq_len + 1)
    step = int(start_step)
    while True:
        rng = np.random.default_rng([int(seed), step])
        starts = rng.integers(0, arr.size - seq_len, size=batch_size)  # window [s, s + L] fits
        windows = arr[starts[:, None] + offsets]  # [B, L + 1]
        yield windows[:, :-1], windows[:, 1:]
        step += 1


def eval_batches(tokens, batch_size: int,
                 seq_len: int) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(inputs, targets [B, L] int32, mask [B, L] float32) covering every next-token target once, in order.

    Window j predicts tokens[jL + 1 : (j+1)L + 1] from tokens[jL : (j+1)L]; the tail of the last
    window and whole rows past the end are PAD with mask 0, so every batch has the same shape.
    """
    _check_positive("batch_size", batch_size)
    _check_positive("seq_len", seq_len)
    arr = _check_tokens(tokens, 2, "pass a stream with at least one next-token target")
    n_targets = arr.size - 1
    n_windows = -(-n_targets // seq_len)
    n_batches = -(-n_windows // batch_size)
    total = n_batches * batch_size * seq_len
    inputs = np.full(total, PAD_ID, np.int32)
    targets = np.full(total, PAD_ID, np.int32)
    mask = np.zeros(total, np.float32)
    inputs[:n_targets] = arr[:-1]
    targets[:n_targets] = arr[1:]
    mask[:n_targets] = 1.0
    shape = (n_batches, batch_size, seq_len)
    yield from zip(inputs.reshape(shape), targets.reshape(shape), mask.reshape(shape))


# ---------------------------------------------------------------------------------------------
# Synthetic long-context tasks


def _check_rng(rng) -> None:
    """A numpy Generator, or ValueError."""
    if not isinstance(rng, np.random.Generator):
        fail("rng", type(rng).__name__, "pass a numpy Generator, e.g. np.random.default_rng(seed)")


def _check_depth(field: str, depth) -> float:
    """A relative depth in [0, 1], or ValueError."""
    if not isinstance(depth, (int, float, np.integer, np.floating)) or not 0.0 <= float(depth) <= 1.0:
        fail(field, depth, "must be a relative depth in [0, 1] (0 = start of the filler, 1 = end)")
    return float(depth)


def _digits(rng: np.random.Generator, n: int) -> str:
    """A random n-digit decimal string without a leading zero."""
    return str(rng.integers(1, 10)) + "".join(str(d) for d in rng.integers(0, 10, size=n - 1))


def _haystack(length: int, needles: Sequence[tuple[float, str]], question: str, filler: str) -> np.ndarray:
    """[BOS] + filler with each (depth, needle) inserted at that relative depth + question: `length` ids.

    The filler is the tail of a repeated text, so it ends on a sentence; each needle goes to the
    sentence start nearest its depth (a shift of at most half a sentence), never inside a word.
    """
    fixed = 1 + sum(len(text) for _, text in needles) + len(question)  # ASCII: bytes == chars
    n_filler = length - fixed
    if n_filler < 0:
        fail("length", length, f"needs at least {fixed} tokens for the needles and the question; raise length")
    repeated = filler * (n_filler // len(filler) + 1)
    text = repeated[len(repeated) - n_filler:]
    starts = np.array(sorted({0, n_filler, *(m.end() for m in re.finditer(r"\. ", text))}))
    parts, cut = [], 0
    for depth, needle in sorted(needles, key=lambda dn: dn[0]):
        at = int(starts[np.argmin(np.abs(starts - depth * n_filler))])
        parts += [text[cut:at], needle]
        cut = at
    parts += [text[cut:], question]
    return encode("".join(parts), bos=True)


def passkey_example(rng: np.random.Generator, length: int, depth: float, *, digits: int = 5,
                    template: str = "train") -> tuple[np.ndarray, np.ndarray]:
    """Pass-key retrieval: (prompt [length] int32, answer [digits] int32); the needle sits at relative `depth`.

    The prompt is BOS, filler with the needle ("The pass key is NNNNN. Remember it. " in the "train" template)
    inserted at `depth`, then the question ("What is the pass key? The pass key is ", trailing space), so the answer
    is exactly the digits. `template`: a key of `TEMPLATES` ("held_out": wording never trained on).
    """
    _check_rng(rng)
    _check_positive("length", length)
    depth = _check_depth("depth", depth)
    _check_positive("digits", digits)
    words = _template(template)
    key = _digits(rng, digits)
    prompt = _haystack(length, [(depth, words.passkey.format(key=key))], words.passkey_question, words.filler)
    return prompt, encode(key, bos=False)


def multi_needle_example(rng: np.random.Generator, length: int, n_keys: int, depths: Sequence[float], *,
                         digits: int = 4, template: str = "train") -> tuple[np.ndarray, np.ndarray]:
    """Multi-key retrieval: needles "The key for <name> is NNNN. " at `depths`; one, drawn by rng, is queried.

    Returns (prompt [length] int32, answer [digits] int32); names are distinct, the prompt ends
    with "What is the key for <name>? The key for <name> is " (trailing space). That wording is the "train"
    template's; `template` picks another of `TEMPLATES` ("held_out": never trained on).
    """
    _check_rng(rng)
    _check_positive("length", length)
    _check_positive("n_keys", n_keys)
    if n_keys > len(_NAMES):
        fail("n_keys", n_keys, f"at most {len(_NAMES)} distinct names are available; lower n_keys")
    depths = list(depths)
    if len(depths) != n_keys:
        fail("depths", depths, f"needs one depth per key: {n_keys} values")
    depths = [_check_depth(f"depths[{i}]", d) for i, d in enumerate(depths)]
    _check_positive("digits", digits)
    names = [_NAMES[i] for i in rng.choice(len(_NAMES), size=n_keys, replace=False)]
    values = [_digits(rng, digits) for _ in range(n_keys)]
    q = int(rng.integers(n_keys))
    words = _template(template)
    needles = [(d, words.named.format(name=name, value=value)) for d, name, value in zip(depths, names, values)]
    return _haystack(length, needles, words.ask_one.format(who=names[q]), words.filler), encode(values[q], bos=False)


def ruler_example(rng: np.random.Generator, length: int, depth: float, *, keys: int = 1, values: int = 1,
                  queries: int = 1, digits: int = 4,
                  template: str = "train") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """RULER-style needle retrieval (Hsieh et al. 2024): (prompt [length], answer [A], digit mask [A]).

    `keys` distinct names each hold `values` values, one needle "The key for <name> is NNNN. " per value; the
    question asks for `queries` of the names and every value of each ("What is the key for <a>? The key for <a> is "
    for one value of one name, else "What are the keys for <a> and <b>? The keys for <a> and <b> are "). The
    answer lists the asked values, name by name in the question's order and each name's values in the order they
    appear, joined by ", "; the digit mask marks its digits (the separators are not retrieved). The needles of the
    asked names sit together at relative `depth`; the other names' needles (distractors) at uniform random depths.
    Multi-key: `keys` > 1; multi-value: `values` > 1; multi-query: `queries` > 1. The wording above is the
    "train" template's; `template` picks another of `TEMPLATES` ("held_out": never trained on).
    """
    _check_rng(rng)
    _check_positive("length", length)
    depth = _check_depth("depth", depth)
    for field, value in (("keys", keys), ("values", values), ("queries", queries), ("digits", digits)):
        _check_positive(field, value)
    if keys > len(_NAMES):
        fail("keys", keys, f"at most {len(_NAMES)} distinct names are available; lower keys")
    if queries > keys:
        fail("queries", queries, f"asks for more names than the {keys} keys; use queries ≤ keys")
    words = _template(template)
    names = [_NAMES[i] for i in rng.choice(len(_NAMES), size=keys, replace=False)]
    held = {name: [_digits(rng, digits) for _ in range(values)] for name in names}
    asked = names[:queries]
    needles = [(depth, words.named.format(name=name, value=v)) for name in asked for v in held[name]]
    needles += [(float(rng.random()), words.named.format(name=name, value=v))
                for name in names[queries:] for v in held[name]]
    question = (words.ask_one if queries == values == 1 else words.ask_many).format(who=" and ".join(asked))
    answer = encode(", ".join(v for name in asked for v in held[name]), bos=False)
    return (_haystack(length, needles, question, words.filler), answer,
            np.isin(answer, encode("0123456789", bos=False)))


def _template(name: str) -> Template:
    if name not in TEMPLATES:
        fail("template", name, f"use one of {sorted(TEMPLATES)} ('held_out': wording never trained on)")
    return TEMPLATES[name]
