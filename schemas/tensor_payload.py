"""SGLang's `serialized_named_tensors`: named tensors passed between processes on one host by handle.

An entry is what SGLang's `MultiprocessingSerializer.serialize(named_tensors, output_str=True)` makes:
torch's `ForkingPickler` dump of `[(name, tensor), ...]`, base64-encoded for JSON. The pickle holds
no tensor bytes, only where they live:
- a CUDA tensor: its CUDA IPC handle (torch's own reduction, `rebuild_cuda_tensor`);
- a CPU tensor: the name of the shared-memory file its storage lives in (torch's `file_system`
  sharing strategy, `rebuild_storage_filename`), whatever the process-wide strategy is: the `fd`
  strategy passes file descriptors over a socket authenticated with the sender's own multiprocessing
  key, which an unrelated process (the server) cannot open.
Either way the receiver maps the sender's memory; no byte of the weights crosses HTTP.

`deserialize` takes SGLang's payloads (base64 text, or raw pickle bytes) and unpickles with an
allowlist of the globals such a payload needs (torch's rebuild functions, storages, dtypes and
builtin containers), as SGLang's `SafeUnpickler` does: the route that takes them swaps a server's
weights, and a plain `pickle.loads` of a request body would run whatever the body names.
"""

from __future__ import annotations

import base64
import binascii
import copyreg
import io
import pickle
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing.reductions as reductions

NamedTensors = list[tuple[str, torch.Tensor]]


class PayloadError(ValueError):
    """A payload that does not decode to named tensors (or names something not allowed)."""


def _reduce_storage_file(storage: torch.UntypedStorage) -> tuple[Any, tuple[Any, ...]]:
    """torch's `reduce_storage` under the `file_system` strategy, for this pickler only."""
    if storage.device.type != "cpu":
        raise PayloadError(f"a {storage.device.type} storage reached the CPU reduction")
    if storage.nbytes() == 0:
        return (reductions.rebuild_storage_empty, (type(storage),))
    metadata = storage._share_filename_cpu_()  # moves it into shared memory unless it is already there
    storage._shared_incref()  # the receiver's rebuild takes this reference back
    reductions.shared_cache[metadata[1]] = reductions.StorageWeakRef(storage)
    return (reductions.rebuild_storage_filename, (type(storage), *metadata))


def serialize(named: NamedTensors) -> str:
    """One `serialized_named_tensors` entry (base64 text). CPU tensors should already live in shared
    memory (`share_memory_` / `shm_pool`): a tensor that does not is moved there, a copy per call."""
    buf = io.BytesIO()
    pickler = ForkingPickler(buf, pickle.HIGHEST_PROTOCOL)
    pickler.dispatch_table = {**copyreg.dispatch_table, **ForkingPickler._extra_reducers,  # type: ignore[attr-defined]
                              torch.UntypedStorage: _reduce_storage_file}
    pickler.dump([(str(n), t) for n, t in named])
    return base64.b64encode(buf.getvalue()).decode("ascii")


_ALLOWED: set[tuple[str, str]] = {
    ("builtins", "list"), ("builtins", "tuple"), ("builtins", "int"), ("builtins", "bool"), ("builtins", "str"),
    ("builtins", "bytes"), ("builtins", "float"), ("builtins", "dict"), ("collections", "OrderedDict"),
    ("torch", "Size"), ("torch", "device"), ("torch", "dtype"), ("torch", "Tensor"),
    ("torch.nn.parameter", "Parameter"), ("torch", "UntypedStorage"), ("torch.storage", "UntypedStorage"),
    ("torch.storage", "TypedStorage"),
    ("torch.multiprocessing.reductions", "rebuild_tensor"),
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
    ("torch.multiprocessing.reductions", "rebuild_storage_filename"),
    ("torch.multiprocessing.reductions", "rebuild_storage_empty"),
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"),
    ("torch.multiprocessing.reductions", "rebuild_typed_storage_child"),
    ("torch.multiprocessing.reductions", "rebuild_meta_tensor"),
}
_DTYPES = {name for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype)}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED or (module == "torch" and name in _DTYPES):
            return super().find_class(module, name)
        raise PayloadError(f"serialized_named_tensors names {module}.{name}, which a tensor payload never needs")


def decode_entry(data: str | bytes) -> bytes:
    """Raw pickle bytes from an entry: base64 text (SGLang's HTTP form) or the raw bytes themselves."""
    raw = data.encode("ascii") if isinstance(data, str) else bytes(data)
    if len(raw) >= 2 and raw[0] == 0x80 and raw[1] <= pickle.HIGHEST_PROTOCOL:
        return raw
    try:
        return base64.b64decode(raw, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise PayloadError(f"serialized_named_tensors entry is neither base64 nor a pickle: {exc}") from exc


def deserialize(data: str | bytes) -> NamedTensors:
    """The named tensors an entry refers to, mapped into this process (no copy)."""
    try:
        obj = _Unpickler(io.BytesIO(decode_entry(data))).load()
    except PayloadError:
        raise
    except Exception as exc:  # a handle whose memory is gone, a truncated pickle: say which
        raise PayloadError(f"serialized_named_tensors entry does not load: {exc!r}"[:400]) from exc
    if not isinstance(obj, list | tuple) or not all(
            isinstance(p, tuple | list) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], torch.Tensor)
            for p in obj):
        raise PayloadError("serialized_named_tensors entry is not a list of (name, tensor) pairs")
    return [(str(n), t) for n, t in obj]
