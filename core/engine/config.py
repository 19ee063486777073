"""Engine arguments, named as SGLang's server arguments so launch commands carry over."""

from __future__ import annotations

from typing import Any

import attrs


@attrs.define
class EngineArgs:
    model_path: str | None = None  # None: the embedded SmolLM2-135M-Instruct
    tokenizer_path: str | None = None
    served_model_name: str | None = None
    dtype: str = "auto"
    context_length: int | None = None
    device: str = "auto"  # auto: cuda if available, else cpu
    mem_fraction_static: float | None = None  # auto: 0.88 on GPU, 0.3 of system memory on CPU
    max_total_tokens: int | None = None
    max_running_requests: int | None = None
    max_prefill_tokens: int = 16384
    chunked_prefill_size: int | None = None  # None: 2048 on CPU, 8192 on GPU; -1 (or 0) disables chunked prefill
    enable_mixed_chunk: bool = False
    schedule_policy: str = "fcfs"  # fcfs, lpm, dfs-weight, lof, random
    schedule_conservativeness: float = 1.0
    enable_priority_scheduling: bool = False
    schedule_low_priority_values_first: bool = False
    disable_radix_cache: bool = False
    radix_eviction_policy: str = "lru"  # lru or lfu
    page_size: int = 1
    attention_backend: str | None = None  # None: torch_native
    quantization: str | None = None
    grammar_backend: str | None = None  # None: xgrammar; "none" disables constrained decoding
    kv_cache_dtype: str = "auto"
    random_seed: int | None = None
    skip_tokenizer_init: bool = False
    json_model_override_args: str | None = None
    load_format: str = "auto"  # auto / safetensors / pt / gguf read the checkpoint; dummy: random weights from config.json
    is_embedding: bool = False  # serve pooled hidden states (/v1/embeddings, /encode) and classification scores
    plugins: str | list[str] | None = None  # allowlist; None: $CORE_PLUGINS or all installed
    strict_plugins: bool = False
    cpu_threads: int | None = None  # torch intra-op threads on CPU; None: torch's default (all cores)
    log_level: str = "info"
    extra: dict[str, Any] = attrs.field(factory=dict)  # plugin-defined options


# SGLang server flags whose features this engine does not have yet: passing one is an error, never silently ignored.
UNSUPPORTED_SGLANG_ARGS = (
    "tp_size", "dp_size", "pp_size", "ep_size", "enable_lora", "lora_paths", "speculative_algorithm",
    "disaggregation_mode", "enable_dp_attention", "cuda_graph_max_bs", "enable_torch_compile",
)


def engine_args_from_kwargs(kwargs: dict[str, Any]) -> EngineArgs:
    """Accept SGLang-style keyword arguments; unknown ones are an error naming them."""
    from core.errors import CoreError

    if "model" in kwargs and "model_path" not in kwargs:
        kwargs = {**kwargs, "model_path": kwargs.pop("model")}
    names = {f.name for f in attrs.fields(EngineArgs)}
    unsupported = [k for k in kwargs if k in UNSUPPORTED_SGLANG_ARGS and kwargs[k] not in (None, False, 1)]
    if unsupported:
        raise CoreError(f"SGLang option(s) not supported by this engine yet: {', '.join(unsupported)}")
    unknown = [k for k in kwargs if k not in names and k not in UNSUPPORTED_SGLANG_ARGS]
    if unknown:
        raise CoreError(f"unknown engine argument(s): {', '.join(sorted(unknown))}")
    return EngineArgs(**{k: v for k, v in kwargs.items() if k in names})
