"""The compressed Engram vocabulary (SPEC §10b): token ids are mapped to canonical ids before hashing.

The release hashes n-grams of *compressed* ids: tokens that differ only by case, accents, Unicode
compatibility form or whitespace runs share one id, so "The", " the" and "THE" feed the same n-gram.
`V_c = engram_compressed_vocab_size` counts them (99,092 for the released 129,280-token vocabulary).

Building it (`from_tokenizer`, as the release does from its fast tokenizer): for each token id in
order, its text is the tokenizer's decoding of that one id; a text holding U+FFFD (a partial UTF-8
byte token) keeps its raw token string as its key, any other text is normalized by NFKC → NFD →
strip accents → lowercase → runs of spaces/tabs/newlines become one space → a lone space is kept
(protected from the strip) → strip; an empty result keeps the text. Keys get ids in first-seen
order, so the map is the identity exactly when no two tokens share a key (`V_c == vocab_size`: a
byte vocabulary), and then the model holds no table at all.

In the model (`has_table`), the map is the `engram_vocab` parameter, a `CompressedVocab` variable
(int32 `[vocab_size]`, never trained: the optimizer only updates `nnx.Param`s), applied to the Engram
history (padding included: the pad hashes as its compressed id, as in the release). A freshly
initialised model holds `default_table`: the identity below `V_c`, and the pad's id above it (the
release maps the multimodal placeholder tokens beyond its text vocabulary that way); load the real
one with `from_tokenizer` (`csa2.checkpoints.load_hf` does, from the checkpoint's `tokenizer.json`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from csa2.config import ModelConfig

Array = jax.Array
PARAM = "engram_vocab"  # the model's parameter holding the table (absent when the map is the identity)


class CompressedVocab(nnx.Variable):
    """Token id → compressed Engram id, int32 `[vocab_size]` (not an `nnx.Param`: never trained)."""


def has_table(cfg: ModelConfig) -> bool:
    """Whether the model needs a table: Engram layers and a vocabulary larger than its compressed one."""
    return bool(cfg.engram_layer_ids) and cfg.engram_compressed_vocab_size < cfg.vocab_size


@dataclasses.dataclass(frozen=True)
class DefaultTable:
    """The table's initializer (`csa2.params.Initializer`): identity on `[0, compressed_size)`, `pad_id` above."""

    compressed_size: int
    pad_id: int
    stream: str | None = None

    def __call__(self, rng: np.random.Generator | None, shape: tuple[int, ...]) -> np.ndarray:
        ids = np.arange(shape[0], dtype=np.int32)
        return np.where(ids < self.compressed_size, ids, self.pad_id).astype(np.int32)

    @classmethod
    def of(cls, cfg: ModelConfig) -> "DefaultTable":
        return cls(cfg.engram_compressed_vocab_size, cfg.engram_pad_id)


def default_table(cfg: ModelConfig) -> np.ndarray:
    """The table of a freshly initialised model: identity on `[0, V_c)`, the pad's id for ids ≥ V_c."""
    return DefaultTable.of(cfg)(None, (cfg.vocab_size,))


def compressed(params: dict, tokens: Array) -> Array:
    """`tokens` as compressed ids: through the model's table, or unchanged when it has none (identity)."""
    return tokens if PARAM not in params else jnp.take(params[PARAM], tokens, axis=0)


def check_table(cfg: ModelConfig, table: np.ndarray, what: str = "engram_vocab") -> np.ndarray:
    """The table as int32 `[vocab_size]` with ids in `[0, V_c)` covering every one of them, or ValueError."""
    table = np.asarray(table)
    v, vc = cfg.vocab_size, cfg.engram_compressed_vocab_size
    if table.shape != (v,) or not np.issubdtype(table.dtype, np.integer):
        raise ValueError(f"{what}: shape {table.shape} dtype {table.dtype}; expected int [vocab_size={v}]")
    if table.min() < 0 or table.max() >= vc or len(np.unique(table)) != vc:
        raise ValueError(f"{what}: ids span [{table.min()}, {table.max()}] with {len(np.unique(table))} distinct; the "
                         f"hash multipliers assume exactly engram_compressed_vocab_size={vc} ids [0, {vc})")
    return table.astype(np.int32)


def _normalizer():
    from tokenizers import Regex, normalizers

    return normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), "\ue000"),
        normalizers.Strip(), normalizers.Replace("\ue000", " "),
    ])


def from_tokenizer(tokenizer, cfg: ModelConfig | None = None) -> np.ndarray:
    """The compressed vocabulary of a fast tokenizer (a `tokenizers.Tokenizer`, or a file path of its JSON):
    int32 `[vocab size]`, checked against `cfg` when given (its vocab_size and engram_compressed_vocab_size)."""
    from tokenizers import Tokenizer

    if not isinstance(tokenizer, Tokenizer):
        tokenizer = Tokenizer.from_file(str(tokenizer))
    normalizer, keys = _normalizer(), {}
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    table = np.empty(size, np.int32)
    for token_id in range(size):
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:
            key = tokenizer.id_to_token(token_id)
        else:
            key = normalizer.normalize_str(text) or text
        table[token_id] = keys.setdefault(key, len(keys))
    if cfg is not None:
        if size < cfg.vocab_size:
            raise ValueError(f"tokenizer: {size} ids for vocab_size={cfg.vocab_size}; the Engram hash needs an id for "
                             "every token")
        table = check_table(cfg, table[:cfg.vocab_size], "tokenizer's compressed vocabulary")
    return table
