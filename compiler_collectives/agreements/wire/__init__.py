"""The msgpack payloads the ranks exchange, versioned and validated; one module per format.

* ``codec``: ``pack``, the bounded reader every decoder reads a peer's bytes with, and the
  checks and the one failure builder the decoders share;
* ``envelope``: the envelope (and ``FORMAT_VERSION``) that the next two share;
* ``compiler``: the compiler collective's payload (``encode``/``decode``);
* ``audit``: the program audit's payload (``encode_audit``/``decode_audit``);
* ``reasons``: recompile reasons (``encode_reasons``/``decode_reasons``);
* ``setup``: the setup record on the c10d store (``encode_setup``/``decode_setup``);
* ``scope``: a scope leader's verdict on the store (``encode_verdict``/``decode_verdict``).

Every decoder reads through ``codec``'s bounded reader (never pickle; what a payload may cost
to decode is bounded by its size) and raises ``WireFormatError`` naming the sender on anything
malformed, truncated, oversized or of another version. The names callers use are here:
``from . import wire`` then ``wire.encode_audit(...)``.
"""

from .audit import (
    AUDIT_PHASES,
    AuditDetails,
    AuditEnvelope,
    AuditLevel,
    AuditSummary,
    decode_audit,
    encode_audit,
)
from .codec import DECODE_SLACK, DECODED_BYTES_PER_BYTE, NAME_CHARS_PER_BYTE
from .compiler import Envelope, decode, encode
from .envelope import AUDIT, FORMAT_VERSION
from .reasons import (
    MAX_REASON_CHARS,
    MAX_REASONS,
    REASONS_FORMAT_VERSION,
    REASONS_TAG,
    ReasonsEnvelope,
    decode_reasons,
    encode_reasons,
)
from .scope import VERDICT_KINDS, Verdict, decode_verdict, encode_verdict, max_verdict_bytes
from .setup import MAX_SETUP_BYTES, SETUP_FORMAT, SetupRecord, decode_setup, encode_setup

__all__ = [
    "AUDIT",
    "AUDIT_PHASES",
    "DECODED_BYTES_PER_BYTE",
    "DECODE_SLACK",
    "FORMAT_VERSION",
    "MAX_REASONS",
    "MAX_REASON_CHARS",
    "MAX_SETUP_BYTES",
    "NAME_CHARS_PER_BYTE",
    "REASONS_FORMAT_VERSION",
    "REASONS_TAG",
    "SETUP_FORMAT",
    "VERDICT_KINDS",
    "AuditDetails",
    "AuditEnvelope",
    "AuditLevel",
    "AuditSummary",
    "Envelope",
    "ReasonsEnvelope",
    "SetupRecord",
    "Verdict",
    "decode",
    "decode_audit",
    "decode_reasons",
    "decode_setup",
    "decode_verdict",
    "encode",
    "encode_audit",
    "encode_reasons",
    "encode_setup",
    "encode_verdict",
    "max_verdict_bytes",
]
