"""Replay bundles: a folder of tensors (``tensors.safetensors``) and ``bundle.json``.

Read without executing anything: the tensors are the safetensors layout (an 8-byte
little-endian header length, a JSON header naming each tensor's dtype, shape and byte
range, then the raw bytes), written and parsed here in plain Python so that the core
library needs no extra package; the ``safetensors`` library reads the file as it is.
Nothing is unpickled. ``bundle.json`` holds what the writer says about the tensors
(``"schema": "amped.replay/1"``, amped's version, the recipe, the layers) and two
SHA-256 digests: ``tensors_sha256`` of the tensor file and ``sha256`` of the JSON
document itself without that field, so a truncated or edited bundle is refused by
:func:`read_bundle` with the name of what differs.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Any

import torch

from amped._internal.files import write_files

__all__ = ["SCHEMA", "BundleError", "read_bundle", "tensor_digest", "write_bundle"]

SCHEMA = "amped.replay/1"
TENSORS, DOCUMENT = "tensors.safetensors", "bundle.json"

# safetensors' dtype names; only these are read back (no other type is constructed).
_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
_BY_NAME = {name: dtype for dtype, name in _DTYPES.items()}
_MAX_HEADER = 16 * 1024 * 1024  # a header past this is not one this module wrote


class BundleError(ValueError):
    """A bundle that cannot be read as written: truncated, edited or of another schema."""


def _digest(document: dict[str, Any]) -> str:
    body = {key: value for key, value in document.items() if key != "sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _encode(tensors: dict[str, torch.Tensor]) -> bytes:
    header: dict[str, Any] = {}
    chunks, offset = [], 0
    for name in sorted(tensors):
        tensor = tensors[name].detach().cpu().contiguous()
        if tensor.dtype not in _DTYPES:
            raise TypeError(
                f"A bundle holds tensors of {sorted(map(str, _DTYPES))}; {name!r} is "
                f"{tensor.dtype}. Received: tensors[{name!r}].dtype={tensor.dtype}"
            )
        data = tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
        header[name] = {
            "dtype": _DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        chunks.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # safetensors aligns the data on 8 bytes
    return struct.pack("<Q", len(text)) + text + b"".join(chunks)


def _decode(blob: bytes, where: Path) -> dict[str, torch.Tensor]:
    def broken(what: str) -> BundleError:
        return BundleError(
            f"The bundle's tensor file {str(where)!r} is damaged: {what}. Record the step "
            "again (amped.monitor(setup, record=DIR))"
        )

    if len(blob) < 8:
        raise broken(f"{len(blob)} bytes, shorter than its 8-byte header length")
    (size,) = struct.unpack("<Q", blob[:8])
    if size > min(_MAX_HEADER, len(blob) - 8):
        raise broken(f"its header claims {size} bytes, the file holds {len(blob) - 8}")
    try:
        header = json.loads(blob[8 : 8 + size])
    except ValueError as error:
        raise broken(f"its header is not JSON ({error})") from None
    data = memoryview(blob)[8 + size :]
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        start, end = entry["data_offsets"]
        dtype = _BY_NAME.get(entry["dtype"])
        if dtype is None or not 0 <= start <= end <= len(data):
            raise broken(f"tensor {name!r} has dtype {entry['dtype']!r}, bytes {start}:{end}")
        shape = [int(n) for n in entry["shape"]]
        if end - start != torch.Size(shape).numel() * dtype.itemsize:
            raise broken(f"tensor {name!r} holds {end - start} bytes for shape {shape}")
        if start == end:  # frombuffer takes no empty buffer
            tensors[name] = torch.zeros(shape, dtype=dtype)
            continue
        raw = torch.frombuffer(bytearray(data[start:end]), dtype=torch.uint8)
        tensors[name] = raw.view(dtype).reshape(shape)
    return tensors


def tensor_digest(tensor: torch.Tensor) -> str:
    """SHA-256 of a tensor's dtype, shape and bytes (its bits, in row-major order)."""
    tensor = tensor.detach().cpu().contiguous()
    data = tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
    head = f"{_DTYPES.get(tensor.dtype, str(tensor.dtype))}{list(tensor.shape)}".encode()
    return hashlib.sha256(head + data).hexdigest()


def write_bundle(folder: Path, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> Path:
    """Write ``tensors`` and ``meta`` (JSON-ready) as a bundle into ``folder`` (created);
    returns the folder. The two files are written as one set (:func:`write_files`)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    blob = _encode(tensors)
    document = {"schema": SCHEMA, **meta, "tensors_sha256": hashlib.sha256(blob).hexdigest()}
    document["sha256"] = _digest(document)
    text = json.dumps(document, indent=1, sort_keys=True)
    write_files([(folder / TENSORS, blob), (folder / DOCUMENT, text)])
    return folder


def read_bundle(folder: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The tensors and the document of the bundle in ``folder``, both checked against
    the document's digests (nothing in the bundle is executed).

    Raises:
        BundleError: a file missing, truncated or changed since it was written, or a
            document of another schema; the message names which.
    """
    folder = Path(folder)
    try:
        text, blob = (folder / DOCUMENT).read_text(), (folder / TENSORS).read_bytes()
    except OSError as error:
        raise BundleError(
            f"{str(folder)!r} is not a replay bundle (a folder holding {DOCUMENT} and "
            f"{TENSORS}, as amped.monitor(setup, record=DIR) writes): {error}"
        ) from None
    try:
        document = json.loads(text)
    except ValueError as error:
        raise BundleError(f"{DOCUMENT} in {str(folder)!r} is not JSON: {error}") from None
    if not isinstance(document, dict) or document.get("schema") != SCHEMA:
        schema = document.get("schema") if isinstance(document, dict) else None
        raise BundleError(f"{DOCUMENT} has schema {schema!r}; this amped reads {SCHEMA!r}")
    if document.get("sha256") != _digest(document):
        raise BundleError(
            f"{DOCUMENT} in {str(folder)!r} was changed after it was written: its sha256 "
            f"is {_digest(document)}, the recorded one {document.get('sha256')}"
        )
    actual = hashlib.sha256(blob).hexdigest()
    if actual != document.get("tensors_sha256"):
        raise BundleError(
            f"{TENSORS} in {str(folder)!r} is not the file the bundle recorded "
            f"(truncated or changed: {len(blob)} bytes, sha256 {actual}; recorded "
            f"{document.get('tensors_sha256')})"
        )
    return _decode(blob, folder / TENSORS), document
