"""The on-disk cache of converted GGUF files, one pair of folders per file (by content hash) and
serving dtype (bf16 unsuffixed, others ``-<dtype>``), each written whole and then renamed into place:

* ``<hash>[-<dtype>]-packed/``, made at the first start through transformers' GGUF reader: config,
  tokenizer, the tensor table (``gguf_tensors.json``: which converted tensors the file's raw blocks
  can feed, verified in memory against transformers' dequantization) and only the tensors the table
  does not list (embeddings, norms, whatever did not verify). Serving from the packed blocks (quant
  method ``gguf``) reads this folder and the GGUF file: no dequantized copy of a linear weight is
  written (57 MB in bf16 for the default 98 MB model, against 260 MB for the whole model).
* ``<hash>[-<dtype>]/``, the whole model dequantized as a Hugging Face folder, made from the first on
  the first serve that needs dense weights (``--quantization none``, a GPU, ``--dtype float32``):
  its tensors plus gguf's dequantization of the listed ones, which equals transformers' (verified),
  so transformers does not run again. A model whose table lists nothing has no second folder.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np
import structlog
import torch

from core.errors import ModelLoadError

log = structlog.get_logger("core.engine.model_loader.gguf_cache")

GGUF_CACHE_DTYPE = torch.bfloat16  # the unsuffixed folders' dtype; others get ``<hash>-<dtype>``
GGUF_TABLE = "gguf_tensors.json"  # in the packed folder, next to the tensors it does not list
PACKED_SUFFIX = "-packed"
SHARD_BYTES = 2 << 30  # the dense folder's safetensors files are at most this big (one held in memory)


def cache_dir() -> Path:
    return Path(os.environ.get("CORE_CACHE_DIR", Path.home() / ".cache" / "core"))


def _file_hash(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()[:24]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def gguf_cache_folder(path: Path, dtype: torch.dtype = GGUF_CACHE_DTYPE, dense: bool = False) -> Path:
    """The packed folder of GGUF file ``path`` in ``dtype`` (what ``ModelConfig.path`` names), or with
    ``dense`` the whole dequantized model: one pair per dtype, so a float32 serve never reads
    bf16-rounded weights."""
    suffix = "" if dtype == GGUF_CACHE_DTYPE else "-" + _dtype_name(dtype)
    return cache_dir() / "gguf" / (_file_hash(path) + suffix + ("" if dense else PACKED_SUFFIX))


def _cached_dtype(folder: Path) -> str | None:
    """The dtype a cached conversion was saved in (its config.json), None where there is none. An
    unsuffixed folder written before caches were keyed by dtype holds float32: it is converted again."""
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return cfg.get("dtype") or cfg.get("torch_dtype")


def _packed_done(folder: Path, dtype: str) -> bool:
    return _cached_dtype(folder) == dtype and (folder / GGUF_TABLE).is_file()


def _dense_done(folder: Path, dtype: str) -> bool:
    return _cached_dtype(folder) == dtype


@contextlib.contextmanager
def _building(target: Path, done: Callable[[], bool]) -> Iterator[Path]:
    """A fresh folder to write ``target`` into, renamed into place when the block ends (atomic: a
    partial folder is never read; where a concurrent converter won, ours is dropped). A stale
    ``target`` (not ``done()``: another dtype, from before) is set aside and removed first."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if target.exists() and not done():
        stale = Path(tempfile.mkdtemp(dir=target.parent))
        with contextlib.suppress(OSError):
            target.rename(stale / "old")
        shutil.rmtree(stale, ignore_errors=True)
    try:
        tmp.rename(target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)


def convert_gguf(path: Path, dtype: torch.dtype = GGUF_CACHE_DTYPE) -> Path:
    """The packed folder of GGUF file ``path`` in ``dtype``, made once: from the dense folder where an
    earlier serve left one, else through transformers' GGUF reader, whose dequantized linear weights
    are verified against the file's blocks in memory and then dropped."""
    target, name = gguf_cache_folder(path, dtype), _dtype_name(dtype)
    done = lambda: _packed_done(target, name)  # noqa: E731
    if done():
        return target
    dense = gguf_cache_folder(path, dtype, dense=True)
    if _dense_done(dense, name):
        log.info("gguf.convert", file=str(path), cache=str(target), dtype=name, source=str(dense))
        with _building(target, done) as tmp:
            for f in dense.iterdir():
                if f.is_file() and not _is_weight_file(f) and f.name != GGUF_TABLE:
                    shutil.copy2(f, tmp / f.name)
            table, kept = _verify(path, _folder_tensors(dense))
            _write_table(tmp, table)
            _save_sharded(kept.items(), tmp)
        return target
    log.info("gguf.convert", file=str(path), cache=str(target), dtype=name)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype).to(dtype)
    except Exception as e:  # transformers raises many types for unsupported GGUF content
        raise ModelLoadError(f"cannot read GGUF file {path}: {e}") from e
    model.hf_quantizer = None  # otherwise save_pretrained refuses the GGUF quantizer config
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    state = model.state_dict()
    table, kept = _verify(path, state.items())
    with _building(target, done) as tmp:
        model.save_pretrained(tmp, state_dict=kept)  # drops tied copies (lm_head) as a full save does
        tok.save_pretrained(tmp)
        _write_table(tmp, table)
    return target


def gguf_dense_folder(gguf_file: Path, folder: Path) -> Path:
    """The whole model of packed ``folder`` dequantized (a Hugging Face folder), made on first use:
    the folder's tensors plus gguf's dequantization of every tensor its table lists, bit-equal to
    transformers' converted tensors (the table lists only those that verified). ``folder`` itself
    where its table lists nothing, or where it is not a packed folder."""
    if not folder.name.endswith(PACKED_SUFFIX) or not _read_table(folder)["tensors"]:
        return folder
    target = folder.with_name(folder.name.removesuffix(PACKED_SUFFIX))
    name = _cached_dtype(folder)
    done = lambda: _dense_done(target, name)  # noqa: E731
    if done():
        return target
    log.info("gguf.dequantize", file=str(gguf_file), cache=str(target), dtype=name)
    dtype = getattr(torch, name or "float32")
    with _building(target, done) as tmp:
        for f in folder.iterdir():
            if f.is_file() and not _is_weight_file(f) and f.name != GGUF_TABLE:
                shutil.copy2(f, tmp / f.name)
        table = _read_table(folder)["tensors"]
        by_name = _gguf_tensors(gguf_file)
        listed = ((n, gguf_dequantized(by_name[g], h).to(dtype)) for n, (g, h) in table.items())
        _save_sharded(itertools.chain(_folder_tensors(folder), listed), tmp)
    return target


def gguf_tensor_table(gguf_file: Path, folder: Path) -> dict:
    """Which converted tensors can be fed from the GGUF file's raw blocks, and how.

    ``{"tensors": {hf_name: [gguf_name, heads]}, "head_type": GGML type of the LM head or None}``:
    a quantized 2-D tensor is listed when gguf's dequantization of it equals the converted
    tensor exactly, as is (``heads`` 0) or after transformers' Llama q/k row permutation over
    ``heads`` heads. Checking values rather than trusting name rules keeps every architecture
    correct: whatever does not verify is fed dense. Made at conversion (``convert_gguf``); a folder
    without one (a dense folder) gets one from its tensors. A file whose blocks gguf cannot read
    raises ``ModelLoadError``."""
    if not (folder / GGUF_TABLE).is_file():
        table, _ = _verify(gguf_file, _folder_tensors(folder), keep=False)
        _write_table(folder, table)
    table = _read_table(folder)
    if table.get("error"):
        raise ModelLoadError(table["error"])
    return table


def llama_rows(rows: int, heads: int) -> torch.Tensor:
    """Row order transformers gives a llama.cpp q/k weight (it undoes the convert script's
    interleave): HF row (head, j, i) is GGUF row (head, i, j), i < rows / heads / 2, j < 2."""
    return torch.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)


def gguf_dequantized(t, heads: int) -> torch.Tensor:
    """float32 dequantization of GGUF tensor ``t`` (a ``gguf.ReaderTensor``) in transformers' row order."""
    import gguf

    deq = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy())
    return deq[llama_rows(deq.shape[0], heads)] if heads else deq


def _gguf_tensors(gguf_file: Path) -> dict:
    import gguf

    return {t.name: t for t in gguf.GGUFReader(gguf_file).tensors}


def _verify(gguf_file: Path, tensors: Iterable[tuple[str, torch.Tensor]],
            keep: bool = True) -> tuple[dict, dict[str, torch.Tensor]]:
    """(the tensor table of ``gguf_tensor_table``, the converted tensors it does not list where
    ``keep``): each quantized 2-D tensor of the file compared with its converted tensor, in the
    converted tensor's dtype (after the same rounding). A file gguf cannot read lists nothing and
    records why."""
    import gguf

    kept: dict[str, torch.Tensor] = {}
    try:
        reader = gguf.GGUFReader(gguf_file)
        arch = reader.fields["general.architecture"].contents()
        archs = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}
        names = gguf.get_tensor_name_map(archs[arch], int(reader.fields[f"{arch}.block_count"].contents()))
        heads = {int(reader.fields[f"{arch}.attention.{k}"].contents())
                 for k in ("head_count", "head_count_kv") if f"{arch}.attention.{k}" in reader.fields}
    except Exception as e:  # not a readable GGUF, or an architecture gguf does not know
        error = f"cannot read the quantized tensors of {gguf_file}: {type(e).__name__}: {e}"
        return {"tensors": {}, "head_type": None, "error": error}, dict(tensors) if keep else {}
    by_name = {t.name: t for t in reader.tensors}
    floats = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16}
    listed: dict[str, list] = {}
    for name, ref in tensors:
        t = by_name.get(names.get_name(name, try_suffixes=(".weight", ".bias")) or "")
        if not (t is None or t.tensor_type in floats or len(t.shape) != 2
                or t.name in ("token_embd.weight", "output.weight")):
            deq = gguf_dequantized(t, 0).to(ref.dtype)
            for h in [0, *sorted(heads)] if deq.shape == ref.shape else []:
                if h and deq.shape[0] % (2 * h):
                    continue
                if torch.equal(deq if h == 0 else deq[llama_rows(deq.shape[0], h)], ref):
                    listed[name] = [t.name, h]
                    break
        if keep and name not in listed:
            kept[name] = ref
    head = by_name.get("output.weight") or by_name.get("token_embd.weight")
    log.info("gguf.table", file=str(gguf_file), kept_quantized=len(listed))
    blocks = {g: _block_entry(by_name[g]) for g, _ in listed.values()}
    return {"tensors": listed, "head_type": int(head.tensor_type) if head is not None else None,
            "blocks": blocks, "head": None if head is None else [head.name, *_block_entry(head)]}, kept


def _block_entry(t) -> list[int]:
    """Where a tensor's raw rows lie in the file: [byte offset, GGML type, rows, bytes]. Reading
    them by offset (``raw_rows``) spares a start the seconds gguf's reader takes to parse the file."""
    return [int(t.data_offset), int(t.tensor_type), int(t.shape[-1]), int(t.n_bytes)]


def raw_rows(gguf_file: Path, entry: list[int]) -> torch.Tensor:
    """A tensor's raw GGUF rows, uint8 ``[rows, bytes per row]``, from a table's block entry."""
    offset, _, rows, nbytes = entry
    data = np.fromfile(gguf_file, dtype=np.uint8, count=nbytes, offset=offset)
    if data.size != nbytes:
        raise ModelLoadError(f"{gguf_file} ends before the tensor at byte {offset}: the file changed since it was read")
    return torch.from_numpy(data).reshape(rows, -1)


def _read_table(folder: Path) -> dict:
    return json.loads((folder / GGUF_TABLE).read_text())


def _write_table(folder: Path, table: dict) -> None:
    tmp = folder / f"{GGUF_TABLE}.tmp{os.getpid()}"
    tmp.write_text(json.dumps(table))
    tmp.replace(folder / GGUF_TABLE)


def _is_weight_file(f: Path) -> bool:
    return f.name.endswith((".safetensors", ".safetensors.index.json"))


def _folder_tensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(f, framework="pt") as sf:
            for name in sf.keys():
                yield name, sf.get_tensor(name)


def _save_sharded(tensors: Iterable[tuple[str, torch.Tensor]], folder: Path) -> None:
    """``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` files of at most SHARD_BYTES
    with transformers' ``model.safetensors.index.json``, as ``save_pretrained`` lays them out."""
    from safetensors.torch import save_file

    shards: list[list[str]] = []
    shard: dict[str, torch.Tensor] = {}
    size = 0

    def flush() -> None:
        save_file(shard, folder / f"shard{len(shards)}.tmp", metadata={"format": "pt"})
        shards.append(list(shard))

    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        if shard and size + nbytes > SHARD_BYTES:
            flush()
            shard, size = {}, 0
        shard[name], size = t.contiguous(), size + nbytes
    if shard or not shards:
        flush()
    if len(shards) == 1:
        (folder / "shard0.tmp").rename(folder / "model.safetensors")
        return
    weight_map = {}
    for i, names in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        (folder / f"shard{i}.tmp").rename(folder / fname)
        weight_map.update(dict.fromkeys(names, fname))
    total = sum((folder / f).stat().st_size for f in set(weight_map.values()))
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
