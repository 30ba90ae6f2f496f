"""`aotgrad.export` / `aotgrad.deserialize`: a compiled forward/backward pair that outlives
the process, loaded without the function's source.

An `Exported` holds three `jax.export` programs (forward-only; forward, returning outputs
and saved activations; backward, from the saved values and output cotangents to the
differentiated inputs' cotangents), the values the function closed over, and what is
needed to call them: the argument and output structures, which inputs are differentiated,
the saved-value layout, and the `explain` report made when it was exported.

The serialized form (`Exported.serialize()`, `export.blob`) is a header and a payload:

    b"AOTGRAD\\0"  format version (u32)  payload length (u64)  SHA-256 of the payload (32 bytes)
    payload: metadata length (u32), metadata (UTF-8 JSON), then the sections the metadata
             lists by name, offset and length: the three `jax.export` blobs, one per
             program, and the raw bytes of each closed-over array

No Python object is pickled: a blob is data, read with `json` and `jax.export.deserialize`.
"""
from aotgrad.export.blob import ExportError as ExportError
from aotgrad.export.build import export as export
from aotgrad.export.loaded import Exported as Exported
from aotgrad.export.loaded import deserialize as deserialize

__all__ = ["ExportError", "Exported", "deserialize", "export"]
