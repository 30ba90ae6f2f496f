"""The blob an `Exported` serializes to: a header and a payload, checked before anything is read.

    b"AOTGRAD\\0"  format version (u32)  payload length (u64)  SHA-256 of the payload (32 bytes)
    payload: metadata length (u32), metadata (UTF-8 JSON), then the sections the metadata
             lists by name, offset and length: the three `jax.export` blobs, one per
             program, and the raw bytes of each closed-over array

Static arguments are stored as JSON values. No Python object is pickled.
"""
from __future__ import annotations

import hashlib
import json
import struct
from typing import Any

__all__ = ["FORMAT_VERSION", "MAGIC", "PROGRAMS", "ExportError", "decode_static", "encode_static", "pack", "unpack"]

MAGIC = b"AOTGRAD\0"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<8sIQ32s")  # magic, format version, payload length, SHA-256
PROGRAMS = ("forward_only", "forward", "backward")


class ExportError(ValueError):
    """An export that cannot be made, a blob that cannot be loaded, or a call that does not
    match what was exported."""


def encode_static(who: str, key: Any, value: Any) -> Any:
    """A static argument as JSON: None, bool, int, float, str, and tuples of those."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, tuple):
        return {"tuple": [encode_static(who, key, v) for v in value]}
    raise ExportError(f"{who}: static argument {key!r} is a {type(value).__name__} ({value!r}); an "
                      f"export records static arguments of type None, bool, int, float, str and "
                      f"tuples of those. Pass it as one of those, or close over it.")


def decode_static(value: Any) -> Any:
    if isinstance(value, dict):
        return tuple(decode_static(v) for v in value["tuple"])
    return value



def pack(meta: dict[str, Any], sections: dict[str, bytes]) -> bytes:
    offset, table = 0, []
    for name, data in sections.items():
        table.append([name, offset, len(data)])
        offset += len(data)
    head = json.dumps({**meta, "sections": table}).encode()
    payload = struct.pack("<I", len(head)) + head + b"".join(sections.values())
    return _HEADER.pack(MAGIC, FORMAT_VERSION, len(payload), hashlib.sha256(payload).digest()) + payload


def unpack(blob: bytes) -> tuple[dict[str, Any], dict[str, bytes]]:
    """Checks the header and the checksum; returns the metadata and the sections."""
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise TypeError(f"aotgrad.deserialize expects bytes (from Exported.serialize()); got "
                        f"{type(blob).__name__}.")
    blob = bytes(blob)
    if len(blob) < _HEADER.size or not blob.startswith(MAGIC):
        raise ExportError("aotgrad.deserialize: these bytes are not an aotgrad export (no aotgrad "
                          "header); pass the bytes of Exported.serialize().")
    _, version, length, digest = _HEADER.unpack_from(blob)
    if version != FORMAT_VERSION:
        raise ExportError(f"aotgrad.deserialize: the export has format version {version}; this aotgrad "
                          f"reads format version {FORMAT_VERSION}. Export again with this aotgrad, or "
                          f"load it with the aotgrad version that made it.")
    payload = blob[_HEADER.size:]
    if len(payload) != length:
        raise ExportError(f"aotgrad.deserialize: the export is truncated or padded: its header says "
                          f"{length} bytes of payload, found {len(payload)}. Copy the file again.")
    if hashlib.sha256(payload).digest() != digest:
        raise ExportError("aotgrad.deserialize: the export is corrupted (its checksum does not match "
                          "its contents). Copy the file again, or export again.")
    try:
        (n,) = struct.unpack_from("<I", payload)
        meta = json.loads(payload[4:4 + n].decode())
        body = payload[4 + n:]
        sections = {name: body[start:start + size] for name, start, size in meta.pop("sections")}
    except (ValueError, TypeError, KeyError, struct.error) as e:
        raise ExportError(f"aotgrad.deserialize: the export's metadata cannot be read ({e}).") from e
    return meta, sections
