"""The handoff's wire format and socket transport: a `Part` as bytes, and length-prefixed messages over TCP.

A message is `MAGIC`, the header length (8 bytes, little endian), a UTF-8 JSON header and the arrays' raw bytes:

    {"kind": "global", "meta": {...}, "arrays": [{"name": ..., "dtype": "uint8", "shape": [2, 7, 16]}, ...]}

Arrays follow in the header's order, C-contiguous, little endian, each exactly `prod(shape) · itemsize` bytes.
Decoding is data only (no pickle, no code): it accepts only the dtypes a state holds, checks that the header's
sizes add up to the message before it reads an array, and hands the part to `infer.handoff.receive`, which checks
everything else. A socket carries messages as an 8-byte length and the message; `listen` binds to loopback unless
told otherwise, and `recv_message` refuses a message larger than its `limit`.
"""

from __future__ import annotations

import json
import math
import socket
import struct

import numpy as np

from infer.handoff import Part

MAGIC = b"CSA2PART"
DTYPES = ("uint8", "int32", "float32")
MAX_HEADER = 1 << 20  # bytes of JSON: metadata and array names only
MAX_MESSAGE = 1 << 34  # default receive limit, 16 GiB: above a 1M-token v41_flash package
LOOPBACK = "127.0.0.1"
_LEN = struct.Struct("<Q")


def encode_part(part: Part) -> bytes:
    """`part` as one message."""
    arrays = [(name, np.ascontiguousarray(a)) for name, a in part.arrays.items()]
    for name, a in arrays:
        if a.dtype.name not in DTYPES:
            raise ValueError(f"encode_part: array {name!r} has dtype {a.dtype}; the wire carries {DTYPES}")
    header = json.dumps({"kind": part.kind, "meta": part.meta,
                         "arrays": [{"name": n, "dtype": a.dtype.name, "shape": list(a.shape)} for n, a in arrays]},
                        separators=(",", ":")).encode()
    return b"".join([MAGIC, _LEN.pack(len(header)), header, *(a.astype(a.dtype.newbyteorder("<")).tobytes()
                                                              for _, a in arrays)])


def decode_part(message: bytes | bytearray) -> Part:
    """The `Part` in `message`; ValueError for anything that is not a well-formed message. Its arrays are views
    of `message` (little-endian hosts), so the message is held once."""
    view = memoryview(message)
    if len(view) < len(MAGIC) + _LEN.size or bytes(view[:len(MAGIC)]) != MAGIC:
        raise ValueError(f"decode_part: the message does not start with {MAGIC!r}; it is not a handoff part")
    (size,) = _LEN.unpack_from(view, len(MAGIC))
    start = len(MAGIC) + _LEN.size
    if size > min(MAX_HEADER, len(view) - start):
        raise ValueError(f"decode_part: header length {size} exceeds the message ({len(view) - start} bytes left) "
                         f"or {MAX_HEADER}")
    try:
        header = json.loads(bytes(view[start:start + size]).decode())
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise ValueError(f"decode_part: the header is not UTF-8 JSON ({type(err).__name__}: {err})") from None
    if not (isinstance(header, dict) and set(header) == {"kind", "meta", "arrays"}
            and isinstance(header["kind"], str) and isinstance(header["meta"], dict)
            and isinstance(header["arrays"], list)):
        raise ValueError("decode_part: the header must be {kind: str, meta: dict, arrays: list}")
    offset, arrays = start + size, {}
    for spec in header["arrays"]:
        if not (isinstance(spec, dict) and set(spec) == {"name", "dtype", "shape"} and isinstance(spec["name"], str)
                and spec["dtype"] in DTYPES and isinstance(spec["shape"], list)
                and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in spec["shape"])):
            raise ValueError(f"decode_part: array spec {spec!r}: needs a name, a dtype in {DTYPES} and a shape of "
                             "non-negative integers")
        if spec["name"] in arrays:
            raise ValueError(f"decode_part: array {spec['name']!r} appears twice")
        dtype = np.dtype(spec["dtype"]).newbyteorder("<")
        nbytes = math.prod(spec["shape"]) * dtype.itemsize
        if nbytes > len(view) - offset:
            raise ValueError(f"decode_part: array {spec['name']!r} {spec['shape']} needs {nbytes} bytes, the message "
                             f"has {len(view) - offset} left")
        flat = np.frombuffer(view[offset:offset + nbytes], dtype=dtype)  # a view of the message, not a copy
        arrays[spec["name"]] = flat.astype(dtype.newbyteorder("="), copy=False).reshape(spec["shape"])
        offset += nbytes
    if offset != len(view):
        raise ValueError(f"decode_part: {len(view) - offset} bytes follow the last array; the message is corrupt")
    return Part(header["kind"], header["meta"], arrays)


# ---------------------------------------------------------------------------------------------
# Sockets

def listen(host: str = LOOPBACK, port: int = 0) -> socket.socket:
    """A listening TCP socket (loopback by default; port 0 = any free port, read it from `.getsockname()`)."""
    return socket.create_server((host, port))


def send_message(sock: socket.socket, message: bytes) -> None:
    sock.sendall(_LEN.pack(len(message)))
    sock.sendall(message)


def recv_message(sock: socket.socket, limit: int = MAX_MESSAGE) -> bytearray | None:
    """The next message, or None when the peer closed the connection between messages."""
    head = _recv_exactly(sock, _LEN.size, allow_eof=True)
    if head is None:
        return None
    (size,) = _LEN.unpack(head)
    if size > limit:
        raise ValueError(f"recv_message: a {size}-byte message exceeds limit={limit}; raise the limit if the peer "
                         "is trusted and the package is that large")
    return _recv_exactly(sock, size, allow_eof=False)


def _recv_exactly(sock: socket.socket, n: int, allow_eof: bool) -> bytearray | None:
    """`n` bytes, the buffer grown as they arrive (a length alone allocates nothing)."""
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 22))
        if not chunk:
            if allow_eof and not buf:
                return None
            raise ValueError(f"recv_message: the peer closed the connection after {len(buf)} of {n} bytes")
        buf += chunk
    return buf
