"""The byte tokenizer of the tiny presets: ids 0..255 are the UTF-8 bytes of the text, then BOS, EOS, PAD
(`csa2.presets`, vocabulary of 259). Training data and inference both read text through it.

Bad arguments raise `ValueError` naming the field, the value and the fix (DESIGN §7).
"""

from __future__ import annotations

import numpy as np

from csa2.checks import fail
from csa2.presets import BOS_ID, BYTE_VOCAB_SIZE, EOS_ID


def encode_bytes(data: bytes, *, bos: bool = True, eos: bool = False) -> np.ndarray:
    """Raw bytes → int32 ids 0..255, optionally framed by BOS / EOS; any bytes are accepted."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        fail("data", type(data).__name__, "pass bytes (use encode() for str)")
    body = np.frombuffer(bytes(data), dtype=np.uint8).astype(np.int32)
    head = np.array([BOS_ID] if bos else [], np.int32)
    tail = np.array([EOS_ID] if eos else [], np.int32)
    return np.concatenate([head, body, tail])


def encode(text: str, *, bos: bool = True, eos: bool = False) -> np.ndarray:
    """Text → int32 ids of its UTF-8 bytes, optionally framed by BOS / EOS."""
    if not isinstance(text, str):
        fail("text", type(text).__name__, "pass str (use encode_bytes() for bytes)")
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError as e:
        fail("text", text[e.start:e.end],
              f"character at index {e.start} has no UTF-8 encoding ({e.reason}); remove it")
    return encode_bytes(data, bos=bos, eos=eos)


def decode(ids) -> str:
    """Ids → text: stops at the first EOS, skips BOS and PAD, replaces invalid UTF-8 with U+FFFD."""
    ids = np.asarray(ids)
    if ids.ndim != 1 or not (ids.size == 0 or np.issubdtype(ids.dtype, np.integer)):
        fail("ids", f"array of shape {ids.shape} and dtype {ids.dtype}", "pass a 1-D sequence of integer token ids")
    bad = (ids < 0) | (ids >= BYTE_VOCAB_SIZE)
    if bad.any():
        fail("ids", int(ids[bad][0]), f"token ids must lie in [0, {BYTE_VOCAB_SIZE}); check the model's vocab_size")
    eos = np.flatnonzero(ids == EOS_ID)
    if eos.size:
        ids = ids[: eos[0]]
    return bytes(ids[ids < 256].astype(np.uint8)).decode("utf-8", errors="replace")


def validate_utf8(data: bytes, *, field: str = "prompt") -> str:
    """Decode `data` as strict UTF-8 (e.g. a CLI prompt read as bytes), or raise ValueError saying where it fails."""
    data = bytes(data)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        fail(field, data[e.start:e.end],
              f"byte at offset {e.start} is not valid UTF-8 ({e.reason}); re-encode the input as UTF-8")
