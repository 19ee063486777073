"""Trainer tensors as SGLang's weight-sync calls carry them: ``MultiprocessingSerializer`` payloads
(torch's ``ForkingPickler`` bytes, base64 over HTTP) holding ``[(name, tensor), ...]``, each
tensor possibly wrapped per rank (SGLang's ``LocalSerializedTensor``), or a flattened bucket
(``load_format="flattened_bucket"``: one uint8 tensor and each tensor's span of it).

A payload is a pickle, so it is read with an allowlist, as SGLang's ``SafeUnpickler`` does: plain
containers, dtypes, and torch's own tensor and storage rebuilders (a CPU tensor arrives as a
shared-memory handle, a CUDA one as an IPC handle; only the handle travels), and SGLang's two data
classes read as this module's equivalents. Anything else (a function, a module's callable) is
refused before it is called. A CUDA tensor shared by a trainer that applied SGLang's
``monkey_patch_torch_reductions`` names its GPU by UUID (``rebuild_cuda_tensor_by_uuid``)."""

from __future__ import annotations

import base64
import binascii
import io
import multiprocessing
import pickle
from typing import Any

import torch
import torch.multiprocessing  # noqa: F401  (registers torch's ForkingPickler reductions)

from core.errors import InvalidRequest

_ALLOWED = {
    "builtins": {"bool", "bytearray", "bytes", "dict", "float", "frozenset", "int", "list", "set", "slice", "str",
                 "tuple"},
    "collections": {"OrderedDict"},
    "copyreg": {"__newobj__", "_reconstructor"},
    "multiprocessing.resource_sharer": {"DupFd"},
    "torch": {"Size", "device", "Tensor", "UntypedStorage"},
    "torch.nn.parameter": {"Parameter"},
    "torch.storage": {"UntypedStorage", "TypedStorage"},
    "torch._utils": {"_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_parameter", "_rebuild_parameter_with_state",
                     "_rebuild_device_tensor_from_cpu_tensor"},
    "torch._tensor": {"_rebuild_from_type_v2"},
    "torch.multiprocessing.reductions": {"rebuild_tensor", "rebuild_cuda_tensor", "rebuild_storage_fd",
                                         "rebuild_storage_filename", "rebuild_storage_empty", "rebuild_typed_storage",
                                         "rebuild_typed_storage_child"},
}


class RankPayloads:
    """SGLang's ``LocalSerializedTensor``: one serialized tensor per tensor-parallel rank."""

    values: list[bytes]

    def get(self, rank: int) -> torch.Tensor:
        return loads(self.values[rank])


class BucketEntry:
    """SGLang's ``FlattenedTensorMetadata``: a tensor's name, shape, dtype and byte span in a bucket."""

    name: str
    shape: Any
    dtype: torch.dtype
    start_idx: int
    end_idx: int


class Bucket:
    """SGLang's ``FlattenedTensorBucket`` (``flattened_tensor`` and ``metadata``)."""

    flattened_tensor: torch.Tensor
    metadata: list[BucketEntry]


def rebuild_cuda_tensor_by_uuid(*args: Any) -> torch.Tensor:
    """SGLang's ``monkey_patch_torch_reductions`` (which RL trainers apply) sends a CUDA tensor's
    device as its GPU's UUID (argument 6 of torch's ``rebuild_cuda_tensor``), so that processes
    seeing the GPUs in another order agree: the UUID back to this process's device index."""
    device = args[6]
    if isinstance(device, str):
        found = [i for i in range(torch.cuda.device_count()) if str(torch.cuda.get_device_properties(i).uuid) == device]
        if not found:
            raise ValueError(f"no visible GPU has the UUID {device} the tensor was shared from")
        args = (*args[:6], found[0], *args[7:])
    from torch.multiprocessing import reductions

    return reductions.rebuild_cuda_tensor(*args)


_SGLANG_CLASSES = {
    "LocalSerializedTensor": RankPayloads,
    "FlattenedTensorMetadata": BucketEntry,
    "FlattenedTensorBucket": Bucket,
    "_rebuild_cuda_tensor_modified": rebuild_cuda_tensor_by_uuid,
}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module.startswith("sglang.") and name in _SGLANG_CLASSES:
            return _SGLANG_CLASSES[name]
        if name in _ALLOWED.get(module, ()) or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a tensor payload")


def payload_bytes(data: Any) -> bytes:
    """A payload as raw pickle bytes: base64 text (HTTP) or bytes (pickled, or base64 in bytes)."""
    if isinstance(data, str):
        data = data.encode()
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise InvalidRequest(f"a serialized tensor payload must be base64 text or bytes, not {type(data).__name__}",
                             param="serialized_named_tensors")
    data = bytes(data)
    if len(data) >= 2 and data[0] == 0x80 and data[1] <= pickle.HIGHEST_PROTOCOL:
        return data
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest("a serialized tensor payload is neither a pickle nor base64",
                             param="serialized_named_tensors") from None


def loads(data: Any) -> Any:
    """One payload's object, through the allowlist; a refused or broken payload is an InvalidRequest."""
    try:
        return _Unpickler(io.BytesIO(payload_bytes(data))).load()
    except InvalidRequest:
        raise
    except multiprocessing.AuthenticationError:  # a CPU tensor's fd is handed over only to the sender's children
        raise InvalidRequest("CPU tensors from another process must be shared by file name: call "
                             "torch.multiprocessing.set_sharing_strategy('file_system') in the trainer before "
                             "serializing", param="serialized_named_tensors") from None
    except Exception as e:
        raise InvalidRequest(f"cannot read the serialized tensors: {type(e).__name__}: {e}",
                             param="serialized_named_tensors") from None


def named_tensors(obj: Any, device: torch.device, rank: int = 0) -> list[tuple[str, torch.Tensor]]:
    """``[(name, tensor on device)]`` from what a caller passed: pairs (tensors, or per-rank payloads),
    a flattened bucket (an object or SGLang's dict form), or a list of per-rank payloads of those."""
    if isinstance(obj, list) and obj and isinstance(obj[0], (str, bytes, bytearray, memoryview)):
        if rank >= len(obj):
            raise InvalidRequest(f"serialized_named_tensors has {len(obj)} payload(s); rank {rank} has none",
                                 param="serialized_named_tensors")
        obj = loads(obj[rank])
    if isinstance(obj, dict) and "flattened_tensor" in obj:
        flat, meta = obj["flattened_tensor"], obj.get("metadata") or []
    elif isinstance(obj, Bucket) or hasattr(obj, "flattened_tensor"):
        flat, meta = obj.flattened_tensor, obj.metadata
    else:
        if not isinstance(obj, (list, tuple)) or not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in obj):
            raise InvalidRequest("named tensors must be a list of (name, tensor) pairs or a flattened bucket",
                                 param="serialized_named_tensors")
        out = []
        for name, t in obj:
            if not isinstance(t, torch.Tensor) and hasattr(t, "values"):  # per-rank payloads (in process: SGLang's own class)
                t = loads(t.values[rank])
            if not isinstance(name, str) or not isinstance(t, torch.Tensor):
                raise InvalidRequest(f"entry {name!r} is not a (name, tensor) pair", param="serialized_named_tensors")
            out.append((name, t.to(device)))
        return out
    if not isinstance(flat, torch.Tensor) or flat.dtype != torch.uint8 or flat.dim() != 1:
        raise InvalidRequest("a flattened bucket's flattened_tensor must be a 1-D uint8 tensor",
                             param="serialized_named_tensors")
    flat = flat.to(device)
    out = []
    for m in meta:
        if not 0 <= m.start_idx <= m.end_idx <= flat.numel():
            raise InvalidRequest(f"bucket entry {m.name!r} spans bytes outside the bucket", param="serialized_named_tensors")
        out.append((m.name, flat[m.start_idx:m.end_idx].view(m.dtype).reshape(tuple(m.shape))))
    return out
