"""Engine arguments and their command-line flags, named as SGLang's server arguments so
launch commands carry over.

Each ``EngineArgs`` field that has a flag says so in its attrs metadata (``Flag``: help
group, help, aliases, choices); ``add_engine_args`` builds the parser from the fields and
``engine_args_from_namespace`` reads them back by field name, so a new engine option is
one field, never a field plus a flag plus an entry in a list of names. The flag's type
comes from the field's annotation (``bool`` fields are switches), its default from the
field's default.
"""

from __future__ import annotations

import argparse
import typing
from typing import Any, Iterator, Sequence

import attrs

from core.engine.mem_cache import (
    HICACHE_IO_BACKENDS, HICACHE_MEM_LAYOUTS, HICACHE_STORAGE_PREFETCH_POLICIES, HICACHE_WRITE_POLICIES,
)
from core.engine.mem_cache.radix_cache import EVICTION_POLICIES
from core.engine.schedule_policy import RETRACTION_POLICIES, SCHEDULE_POLICIES

FLAG = "core.flag"  # attrs metadata key

# Help groups, in the order the flags are listed; ``core serve`` files them into SGLang's
# sections (core.server.args).
MODEL = "Model and tokenizer"
MEMORY = "Memory and scheduling"
BACKENDS = "Kernel backends and plugins"
PARALLEL = "Parallelism and multi-node serving"
LOGGING = "Logging"
LORA = "LoRA"

DTYPES = ("auto", "float32", "bfloat16", "float16", "half", "float")
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8_e4m3", "fp8_e5m2")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
LORA_BACKENDS = ("csgmv", "triton", "torch_native")
LOAD_BALANCE_METHODS = ("round_robin", "shortest_queue", "prefix")  # core.engine.data_parallel.router


@attrs.frozen
class Flag:
    """How an ``EngineArgs`` field appears on the command line (``--field-name``)."""

    group: str
    help: str | None = None
    aliases: tuple[str, ...] = ()  # more option strings, e.g. ``--model`` for ``--model-path``
    choices: tuple[str, ...] | None = None
    serve_only: bool = False  # only ``core serve`` offers it (the option means nothing to ``core generate``)
    nargs: str | None = None  # argparse's nargs: "*" takes a list (``--lora-paths a=x b=y``)
    negatable: bool = False  # a switch with a ``--no-`` form too (argparse's BooleanOptionalAction)


def _arg(default: Any, group: str, help: str | None = None, *, aliases: tuple[str, ...] = (),
         choices: tuple[str, ...] | None = None, serve_only: bool = False, nargs: str | None = None,
         negatable: bool = False) -> Any:
    return attrs.field(default=default, metadata={FLAG: Flag(group, help, aliases, choices, serve_only, nargs,
                                                             negatable)})


@attrs.define(kw_only=True)
class EngineArgs:
    """Everything the engine is built from (SGLang's server-argument names and defaults)."""

    # ---- model and tokenizer
    model_path: str | None = _arg(None, MODEL, "Hugging Face folder, .gguf file or model-hub id (org/name, "
                                               "org/name/file.gguf: from the Hugging Face cache, else downloaded "
                                               "unless HF_HUB_OFFLINE is set; default: the embedded "
                                               "SmolLM2-135M-Instruct)", aliases=("--model",))
    tokenizer_path: str | None = _arg(None, MODEL, "tokenizer folder or model-hub id (default: the model's)")
    revision: str | None = _arg(None, MODEL, "branch, tag or commit of a model-hub id --model-path (default: main)")
    download_dir: str | None = _arg(None, MODEL, "the model-hub cache a hub id --model-path is looked up in and "
                                                  "downloaded into (default: huggingface_hub's, HF_HUB_CACHE)")
    served_model_name: str | None = _arg(None, MODEL, "model name the API reports (default: the model path)")
    dtype: str = _arg("auto", MODEL, "weights and activations dtype", choices=DTYPES)
    context_length: int | None = _arg(None, MODEL, "context length (default: from config.json)")
    skip_tokenizer_init: bool = _arg(False, MODEL, "no tokenizer: requests send input_ids and get token ids back")
    json_model_override_args: str | None = _arg(None, MODEL, "JSON object overriding config.json fields")
    load_format: str = _arg("auto", MODEL, "weights format (auto: safetensors, .bin or .gguf; "
                                           "dummy: random weights from config.json alone)")
    weight_loader_disable_mmap: bool = _arg(False, MODEL, "read each safetensors file whole instead of mapping it "
                                                          "(network file systems where mmap is slow or unsafe)")
    is_embedding: bool = _arg(False, MODEL, "serve an embedding / classification model (/v1/embeddings, /encode, "
                                            "/classify)", serve_only=True)
    device: str = _arg("auto", MODEL, "cpu, cuda or cuda:N (default: cuda if available, else cpu)")
    # ---- memory and scheduling
    mem_fraction_static: float | None = _arg(None, MEMORY, "fraction of memory for weights and KV cache "
                                                           "(default: 0.88 of GPU memory, 0.3 of system memory on CPU)")
    max_total_tokens: int | None = _arg(None, MEMORY, "KV cache size in tokens (default: from --mem-fraction-static)")
    max_running_requests: int | None = _arg(None, MEMORY, "requests in one batch (default: from the KV cache size)")
    max_prefill_tokens: int = _arg(16384, MEMORY, "tokens in one prefill batch")
    chunked_prefill_size: int | None = _arg(None, MEMORY, "prefill long prompts in chunks of this many tokens between "
                                                          "decode steps (default: 2048 on CPU, 8192 on GPU; -1 disables)")
    enable_mixed_chunk: bool = _arg(False, MEMORY, "run a prefill chunk and the decode steps in one forward")
    num_continuous_decode_steps: int = _arg(1, MEMORY, "decode steps run back to back, without scheduling or "
                                                       "streaming between them, while no request waits; on the CPU "
                                                       "a greedy batch runs them as one call (faster decoding, "
                                                       "tokens streamed in bursts)")
    speculative_algorithm: str | None = _arg(None, MEMORY, "speculative decoding: a registered drafter (NGRAM: "
                                                           "drafts copied from the request's own context; "
                                                           "STANDALONE: a smaller draft model; EAGLE, EAGLE3: a "
                                                           "draft head; NEXTN: as EAGLE, as in SGLang)")
    speculative_num_draft_tokens: int | None = _arg(None, MEMORY, "tokens per speculative verify, the last "
                                                                  "known one included (default 12; a draft "
                                                                  "model's: --speculative-num-steps + 1)")
    speculative_num_steps: int | None = _arg(None, MEMORY, "draft tokens a draft model proposes per verify (default 5)")
    speculative_eagle_topk: int | None = _arg(None, MEMORY, "draft branches per step of an EAGLE head (1, the "
                                                            "default: chains; k > 1: trees of the k best children "
                                                            "per level)")
    speculative_draft_model_path: str | None = _arg(None, MEMORY, "the draft model of STANDALONE (a smaller model "
                                                                  "with the target's vocabulary)",
                                                    aliases=("--speculative-draft-model",))
    speculative_ngram_max_trie_depth: int | None = _arg(None, MEMORY, "NGRAM: suffixes of up to this - 1 tokens "
                                                                      "are matched, a k-token match drafts at most "
                                                                      "this - k deep (default: suffixes of up to 8, "
                                                                      "drafts as deep as the verify holds)")
    speculative_ngram_min_bfs_breadth: int | None = _arg(None, MEMORY, "NGRAM: children a draft node holds at least "
                                                                       "(SGLang's BFS breadth; default: no limit on "
                                                                       "children; 1 where only the max is given)")
    speculative_ngram_max_bfs_breadth: int | None = _arg(None, MEMORY, "NGRAM: children a draft node holds at most, "
                                                                       "at the root of the shortest match (1: chains; "
                                                                       "10 where only the min is given)")
    speculative_ngram_match_type: str | None = _arg(None, MEMORY, "NGRAM: BFS, drafts filled in recency order (the "
                                                                  "only fill; SGLang's PROB is refused)")
    speculative_ngram_capacity: int | None = _arg(None, MEMORY, "NGRAM: n-gram ends the index shared across "
                                                                "requests holds (SGLang: trie nodes; default: 32,768 "
                                                                "tokens' worth)")
    speculative_accept_threshold_single: float = _arg(1.0, MEMORY, "sampled requests: a draft token whose target "
                                                                   "probability reaches this is kept (1: exact "
                                                                   "rejection sampling)")
    speculative_accept_threshold_acc: float = _arg(1.0, MEMORY, "sampled requests: a draft token's chance to be kept "
                                                                "is raised from p to min(1, p / this), p summed over "
                                                                "the siblings tried before it (1: exact rejection "
                                                                "sampling)")
    sleep_on_idle: bool = _arg(False, MEMORY, "accepted for SGLang launch commands: an idle engine always sleeps "
                                              "(its loop waits for a request; no polling)")
    disable_overlap_schedule: bool = _arg(False, MEMORY, "process each step's results before scheduling the next "
                                                         "(overlap scheduling is the default on CUDA)")
    enable_overlap_schedule: bool = _arg(False, MEMORY, "overlap scheduling on the CPU too, where the host's work "
                                                        "shares the cores with the forward (off there by default)")
    schedule_policy: str = _arg("fcfs", MEMORY, "order of the waiting queue (lpm, dfs-weight: cache-aware)",
                                choices=SCHEDULE_POLICIES)
    schedule_conservativeness: float = _arg(1.0, MEMORY, "larger: admit fewer requests (estimate more future KV use), "
                                                         "fewer retractions")
    enable_priority_scheduling: bool = _arg(False, MEMORY, "order the queue by the request field 'priority' first "
                                                           "(higher values first)")
    schedule_low_priority_values_first: bool = _arg(False, MEMORY, "with --enable-priority-scheduling, lower priority "
                                                                   "values run first")
    retraction_policy: str = _arg("length", MEMORY, "which running request a decode out of KV pages retracts first: "
                                                   "length (the fewest output tokens, then the longest prompt) or "
                                                   "priority (the least important, then as length)",
                                  choices=RETRACTION_POLICIES)
    prefill_max_requests: int | None = _arg(None, MEMORY, "the most requests one prefill batch admits (default: "
                                                          "no limit)")
    default_priority_value: int | None = _arg(None, MEMORY, "with --enable-priority-scheduling, the priority of a "
                                                            "request that sets none (default: after every request "
                                                            "that sets one, as SGLang)")
    abort_on_priority_when_disabled: bool = _arg(False, MEMORY, "without --enable-priority-scheduling, refuse a "
                                                                "request that sets a priority (503, as SGLang) "
                                                                "instead of ignoring it")
    disable_radix_cache: bool = _arg(False, MEMORY, "no prefix cache: every prompt is prefilled in full")
    radix_eviction_policy: str = _arg("lru", MEMORY, "which unused cached prefixes are evicted first when the KV pool "
                                                     "runs low", choices=EVICTION_POLICIES)
    enable_hierarchical_cache: bool = _arg(False, MEMORY, "HiCache: prefixes evicted from the KV pool are kept in "
                                                          "a host-memory pool and loaded back instead of re-prefilled "
                                                          "(host tier only; not with --tp-size > 1 yet)",
                                           aliases=("--enable-hicache",))
    hicache_ratio: float = _arg(2.0, MEMORY, "host KV pool size as a multiple of the device pool's (must be > 1)")
    hicache_size: int = _arg(0, MEMORY, "host KV pool size in GB; overrides --hicache-ratio when > 0")
    hicache_write_policy: str = _arg("write_through", MEMORY, "when KV is copied to the host pool: write_back (at "
                                                              "eviction), write_through (once computed), "
                                                              "write_through_selective (once hit twice)",
                                     choices=HICACHE_WRITE_POLICIES)
    hicache_io_backend: str = _arg("kernel", MEMORY, "SGLang's host-device transfer kernels; accepted for "
                                                     "compatibility, no effect here (copies are torch index copies)",
                                   choices=HICACHE_IO_BACKENDS)
    hicache_mem_layout: str = _arg("layer_first", MEMORY, "SGLang's host pool layouts; accepted for compatibility, no "
                                                          "effect here (the host pool is laid out like the device "
                                                          "pool, layer first)", choices=HICACHE_MEM_LAYOUTS)
    hicache_storage_backend: str | None = _arg(None, MEMORY, "storage tier under the host pool (any registered "
                                                             "backend; built in: file, one file per page under "
                                                             "$SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR, default "
                                                             "/tmp/hicache); needs --enable-hierarchical-cache")
    hicache_storage_prefetch_policy: str = _arg("best_effort", MEMORY, "storage reads at admission (synchronous): "
                                                                       "best_effort and wait_complete read all that "
                                                                       "is stored, timeout stops at SGLang's budget",
                                                choices=HICACHE_STORAGE_PREFETCH_POLICIES)
    page_size: int = _arg(1, MEMORY, "tokens per KV cache page")
    kv_cache_dtype: str = _arg("auto", MEMORY, "KV cache dtype (auto: the model's; fp8_e4m3 / fp8_e5m2 store K/V in "
                                               "8 bits, twice the tokens in the same memory)", choices=KV_CACHE_DTYPES)
    random_seed: int | None = _arg(None, MEMORY, "random seed (sampling, the random schedule policy, dummy weights)")
    cpu_threads: int | None = _arg(None, MEMORY, "torch intra-op threads on CPU (default: torch's choice, all cores; "
                                                 "OMP_NUM_THREADS also applies)")
    watchdog_timeout: float = _arg(300.0, MEMORY, "seconds one forward or scheduling step may take; a longer one fails "
                                                   "every in-flight request and marks the engine failed (core serve "
                                                   "then exits non-zero for a supervisor to restart it); 0 disables")
    soft_watchdog_timeout: float | None = _arg(None, MEMORY, "seconds after which a step still running is logged "
                                                             "once (its requests and the stuck thread's stack) and "
                                                             "goes on (default: off)")
    enable_memory_saver: bool = _arg(False, MEMORY, "/release_memory_occupation and /resume_memory_occupation may "
                                                    "free the KV cache, the weights and the CUDA graphs for a "
                                                    "colocated trainer and take them back (RL)")
    enable_weights_cpu_backup: bool = _arg(False, MEMORY, "keep a CPU copy of the weights a release frees, restored "
                                                          "on resume (else they come back with the next weight "
                                                          "update); enables the memory saver too, as in SGLang")
    enable_return_hidden_states: bool = _arg(False, MEMORY, "requests may ask for the last layer's hidden states "
                                                            "(return_hidden_states: true or \"last\"); the same as "
                                                            "--return-hidden-states-mode full")
    enable_custom_logit_processor: bool = _arg(False, MEMORY, "requests may carry a custom logit processor "
                                                              "(custom_logit_processor: SGLang's CustomLogitProcessor"
                                                              ".to_str()): client code run in the server, so for "
                                                              "trusted clients only; needs dill")
    return_hidden_states_mode: str | None = _arg(None, MEMORY, "the most a request's return_hidden_states may ask: "
                                                               "last (\"last\" only) or full (also true)",
                                                 choices=("last", "full"))
    # ---- kernel backends and plugins
    attention_backend: str | None = _arg(None, BACKENDS, "attention backend (default: chosen for the device by the choose_attention_backend hook: flashinfer or triton on CUDA, cpu on CPU where its C++ kernel builds, else torch_native; `core plugins` shows the choice)")
    prefill_attention_backend: str | None = _arg(None, BACKENDS, "attention backend of prefill, extend and mixed batches, speculative verifies and draft extends (SGLang's flag; default: --attention-backend); differing from the decode one, both run over the one KV pool")
    decode_attention_backend: str | None = _arg(None, BACKENDS, "attention backend of decode steps, the one CUDA graphs capture (SGLang's flag; default: --attention-backend)")
    quantization: str | None = _arg(None, BACKENDS, "quantization method (any registered; default: the checkpoint's "
                                                    "quantization_config, gguf for a .gguf model on CPU in bf16/fp16, "
                                                    "else none)")
    torchao_config: str | None = _arg(None, BACKENDS, "quantize a dense checkpoint at load, weight-only (SGLang's "
                                                      "names): int8wo, int4wo-32, int4wo-64, int4wo-128, int4wo-256")
    enable_deterministic_inference: bool = _arg(False, BACKENDS, "batch-invariant kernels: a request's tokens and "
                                                                 "logprobs do not depend on what it is batched with "
                                                                 "(CPU; unseeded samples take seed 42; slower)")
    enable_tf32_matmul: bool | None = _arg(None, BACKENDS, "float32 matmuls in TensorFloat32 on CUDA (faster, 10 "
                                                           "mantissa bits; default: off; no effect off CUDA)",
                                           negatable=True)
    enable_fp32_lm_head: bool = _arg(False, BACKENDS, "logits in float32, not rounded to the activations' dtype: "
                                                      "the LM head multiplies by the unquantized table (a GGUF "
                                                      "file's head dequantized), accumulating into float32")
    cuda_graph_max_bs: int | None = _arg(None, BACKENDS, "largest decode batch captured in a CUDA graph (sizes 1, 2, 4, "
                                                         "8, then every 16; default: 256, at most "
                                                         "--max-running-requests)")
    disable_cuda_graph: bool = _arg(False, BACKENDS, "run decode steps without CUDA graphs")
    grammar_backend: str | None = _arg(None, BACKENDS, "constrained decoding backend: xgrammar (default), llguidance, "
                                                       "or none to disable")
    constrained_json_whitespace_pattern: str | None = _arg(
        None, BACKENDS, "regex for the whitespace JSON constraints (json_schema, json_object) allow between "
                        "tokens, e.g. '[\\n\\t ]*' (the llguidance backend; default: the backend's own)")
    constrained_json_disable_any_whitespace: bool = _arg(
        False, BACKENDS, "JSON constraints (json_schema, json_object) allow no free whitespace: one line, with "
                         "xgrammar's ', ' and ': ' or llguidance's ',' and ':' (the xgrammar and llguidance backends)")
    constrained_json_max_whitespace_cnt: int | None = _arg(
        None, BACKENDS, "JSON constraints (json_schema, json_object) allow at most this many whitespace characters in "
                        "a row, a guard against a model looping on newlines (the xgrammar backend; default: no "
                        "limit)")
    plugins: str | list[str] | None = _arg(None, BACKENDS, "comma-separated plugins to load "
                                                           "(default: $CORE_PLUGINS or all installed)")
    strict_plugins: bool = _arg(False, BACKENDS, "a plugin that fails to load stops start-up")
    # ---- parallelism (core.engine.distributed.tensor_parallel, core.engine.data_parallel.engine)
    tp_size: int = _arg(1, PARALLEL, "tensor parallelism: ranks (processes) the model's heads and features are split "
                                     "over", aliases=("--tensor-parallel-size",))
    dp_size: int = _arg(1, PARALLEL, "data parallelism: engine replicas (processes, each --tp-size ranks) behind one "
                                     "front end", aliases=("--data-parallel-size",))
    load_balance_method: str = _arg("round_robin", PARALLEL, "how --dp-size replicas share requests (prefix: to the "
                                                             "replica that served the longest shared prompt prefix)",
                                    choices=LOAD_BALANCE_METHODS)
    dist_init_addr: str | None = _arg(None, PARALLEL, "HOST:PORT where the tensor-parallel ranks meet (rank 0 listens; "
                                                      "default: a free local port; required with --nnodes > 1)")
    nnodes: int = _arg(1, PARALLEL, "machines the tensor-parallel ranks span (--tp-size / --nnodes ranks each)")
    node_rank: int = _arg(0, PARALLEL, "this machine's index among --nnodes (0 serves HTTP, the others only run ranks)")
    base_gpu_id: int = _arg(0, PARALLEL, "the first GPU this server uses (--device cuda:N says the same); the "
                                         "ranks and data-parallel replicas take the next ones")
    gpu_id_step: int = _arg(1, PARALLEL, "GPUs between two consecutive ranks (and replicas' first ranks follow their "
                                         "predecessors' last)")
    disable_custom_all_reduce: bool = _arg(False, PARALLEL, "accepted for SGLang launch commands: the all-reduce is "
                                                            "always torch.distributed's (NCCL, gloo), there is no "
                                                            "custom one")
    enable_p2p_check: bool = _arg(False, PARALLEL, "accepted for SGLang launch commands: no custom all-reduce reads "
                                                   "peer GPUs' memory, so there is no peer access to check")
    dist_timeout: float | None = _arg(None, PARALLEL, "seconds a collective or the ranks' rendezvous may wait before "
                                                      "the engine fails its requests and stops (default 300)")
    enable_multimodal: bool | None = _arg(None, MODEL, "serve a vision-language model's image inputs (the default "
                                                       "for an architecture with a multimodal processor; no effect "
                                                       "on a text-only model; False in the offline Engine turns "
                                                       "images off)")
    limit_mm_data_per_request: str | None = _arg(None, MODEL, 'most images one request may carry, as JSON: \'{"image": 4}\'')
    allowed_media_domains: list[str] | None = _arg(None, MODEL, "hosts image URLs may be fetched from (default: any; "
                                                               "none while HF_HUB_OFFLINE is set)", nargs="*")
    media_url_max_file_size_mb: int = _arg(64, MODEL, "largest image a request may send or point to, in MB (0: no limit)")
    allowed_local_media_path: str | None = _arg(None, MODEL, "a folder whose files requests may name as images "
                                                             "(vLLM's flag; default: local paths are refused)")
    # ---- LoRA (core.engine.lora)
    enable_lora: bool = _arg(False, LORA, "serve LoRA adapters on top of the base model (implied by --lora-paths)")
    lora_paths: list[str] | None = _arg(None, LORA, "adapters loaded at start: PATH, NAME=PATH, or JSON "
                                                    '{"lora_name": ..., "lora_path": ..., "pinned": ...}', nargs="*")
    max_loras_per_batch: int = _arg(8, LORA, "distinct adapters one batch may use (adapter slots in device memory)")
    max_lora_rank: int | None = _arg(None, LORA, "largest adapter rank (default: the largest of --lora-paths; set it to "
                                                 "load larger adapters at run time)")
    lora_target_modules: list[str] | None = _arg(None, LORA, "modules adapters may target: q_proj k_proj v_proj o_proj "
                                                             "gate_proj up_proj down_proj, or all (default: those "
                                                             "of --lora-paths)", nargs="*")
    max_loaded_loras: int | None = _arg(None, LORA, "adapters kept in host memory; past it the least recently used "
                                                    "unpinned, idle one is dropped (default: no limit)")
    lora_backend: str = _arg("csgmv", LORA, "LoRA GEMMs: csgmv and triton (segmented Triton kernels on a GPU), "
                                            "torch_native; the CPU always runs torch_native", choices=LORA_BACKENDS)
    lora_eviction_policy: str = _arg("lru", LORA, "which adapter slot is reused first when a batch needs one",
                                     choices=("lru", "fifo"))
    # ---- logging
    log_level: str = _arg("info", LOGGING, None, choices=LOG_LEVELS)
    decode_log_interval: int = _arg(40, LOGGING, "log a scheduler.decode_batch line (running and queued requests, "
                                                 "KV token usage, generation throughput) every this many decode "
                                                 "batches; every prefill batch logs a scheduler.prefill_batch line")
    gc_warning_threshold_secs: float = _arg(0.0, LOGGING, "log a garbage-collector pass longer than this many "
                                                          "seconds (a stall of every stream); 0 disables")
    gc_threshold: list[int] | None = _arg(None, MEMORY, "the garbage collector's thresholds (gc.set_threshold: 1 to "
                                                        "3 integers, generation 0 first)", nargs="+")
    # plugin-defined options (their flags come from the add_cli_options hook); no flag of its own
    extra: dict[str, Any] = attrs.field(factory=dict)


def engine_flags(serve: bool = True) -> Iterator[tuple[attrs.Attribute, Flag, type | None]]:
    """(field, its Flag, the flag's value type: int, float, str, or None for a switch), in field order."""
    hints = typing.get_type_hints(EngineArgs)
    for field in attrs.fields(EngineArgs):
        flag = field.metadata.get(FLAG)
        if flag is None or (flag.serve_only and not serve):
            continue
        yield field, flag, _value_type(hints[field.name])


def _value_type(hint: Any) -> type | None:
    if hint is bool or set(typing.get_args(hint)) == {bool, type(None)}:  # a switch (None: not given)
        return None
    kinds = set(typing.get_args(hint)) or {hint}
    kinds |= {a for k in kinds if typing.get_origin(k) is list for a in typing.get_args(k)}  # a list's items
    for kind in (int, float):
        if kind in kinds:
            return kind
    return str


def add_engine_args(parser: argparse.ArgumentParser, *, serve: bool = False) -> None:
    """Add the engine's flags to ``parser``, one argument group per ``Flag.group`` (SGLang's
    names and defaults). ``serve``: include the flags only ``core serve`` offers."""
    groups: dict[str, Any] = {}
    for field, flag, kind in engine_flags(serve):
        group = groups.get(flag.group)
        if group is None:
            group = groups[flag.group] = parser.add_argument_group(flag.group)
        names = ("--" + field.name.replace("_", "-"), *flag.aliases)
        if kind is None:
            action = argparse.BooleanOptionalAction if flag.negatable else "store_true"
            group.add_argument(*names, dest=field.name, action=action, default=field.default, help=flag.help)
        else:
            group.add_argument(*names, dest=field.name, type=kind, default=field.default, help=flag.help,
                               choices=list(flag.choices) if flag.choices else None, nargs=flag.nargs)


def engine_kwargs(ns: argparse.Namespace) -> dict[str, Any]:
    """The ``EngineArgs`` fields present in a parsed namespace, by name (``extra`` excluded)."""
    return {f.name: getattr(ns, f.name) for f in attrs.fields(EngineArgs) if f.name != "extra" and hasattr(ns, f.name)}


def engine_args_from_namespace(ns: argparse.Namespace, plugin_dests: Sequence[str] = ()) -> EngineArgs:
    """``EngineArgs`` from parsed flags; the values of plugin flags (``plugin_dests``) go to ``extra``.
    Model-hub ids are resolved to local paths here (``core.engine.model_loader.hub.resolve_hub_args``)."""
    from core.engine.model_loader.hub import resolve_hub_args

    extra = {d: getattr(ns, d) for d in plugin_dests if hasattr(ns, d)}
    return resolve_hub_args(EngineArgs(**engine_kwargs(ns), extra=extra))


# SGLang server flags whose features this engine does not have yet: passing one is an error, never silently ignored.
# SGLang options of features this engine lacks -> their "off" values (SGLang's defaults). Any other
# value is refused: compared by type and value, so True is not taken for pp_size's 1, nor 1 for False.
UNSUPPORTED_SGLANG_ARGS: dict[str, tuple[Any, ...]] = {
    "pp_size": (1,), "ep_size": (1,),
    "disaggregation_mode": (None, "null"), "enable_dp_attention": (False,),
    "enable_torch_compile": (False,),
}


# SGLang's speculative algorithms that need a draft head (not supported yet; NGRAM, STANDALONE, EAGLE,
# EAGLE3, NEXTN (as EAGLE) and drafters from plugins are): refused when the arguments are read
DRAFT_MODEL_ALGORITHMS = ("DFLASH", "DSPARK", "UNO")


def _is_off(value: Any, defaults: tuple[Any, ...]) -> bool:
    """Whether ``value`` is one of ``defaults``, by exact type: ``True == 1`` must not pass."""
    return any(type(value) is type(d) and value == d for d in defaults)


def engine_args_from_kwargs(kwargs: dict[str, Any]) -> EngineArgs:
    """Accept SGLang-style keyword arguments; unknown ones are an error naming them. Model-hub
    ids are resolved to local paths here (``core.engine.model_loader.hub.resolve_hub_args``)."""
    from core.engine.model_loader.hub import resolve_hub_args
    from core.engine.sglang_flags import SGLANG_FLAGS_LACKING
    from core.errors import CoreError

    if "model" in kwargs and "model_path" not in kwargs:  # SGLang's alias
        kwargs = dict(kwargs)
        kwargs["model_path"] = kwargs.pop("model")
    names = {f.name for f in attrs.fields(EngineArgs)}
    unsupported = [k for k in kwargs if k in UNSUPPORTED_SGLANG_ARGS and not _is_off(kwargs[k], UNSUPPORTED_SGLANG_ARGS[k])]
    if str(kwargs.get("speculative_algorithm")).upper() in DRAFT_MODEL_ALGORITHMS:
        unsupported.append(f"speculative_algorithm={kwargs['speculative_algorithm']} (NGRAM, STANDALONE, EAGLE, EAGLE3 and NEXTN are supported)")
    if unsupported:
        raise CoreError(f"SGLang option(s) not supported by this engine yet: {', '.join(unsupported)}")
    unknown = [k for k in kwargs if k not in names and k not in UNSUPPORTED_SGLANG_ARGS]
    sglang = [k for k in unknown if "--" + k.replace("_", "-") in SGLANG_FLAGS_LACKING]
    if sglang:  # a real SGLang server argument: say so, rather than "unknown"
        raise CoreError(f"SGLang option(s) not supported by this engine yet: {', '.join(sorted(sglang))}")
    if unknown:
        raise CoreError(f"unknown engine argument(s): {', '.join(sorted(unknown))}")
    return resolve_hub_args(EngineArgs(**{k: v for k, v in kwargs.items() if k in names}))


def check_scheduling_args(args: EngineArgs) -> None:
    """Refuse scheduling options no scheduler can run, naming the flag."""
    from core.engine.mem_cache.radix_cache import EVICTION_POLICIES
    from core.errors import CoreError

    if args.schedule_policy not in SCHEDULE_POLICIES:
        raise CoreError(f"--schedule-policy {args.schedule_policy!r} is not one of {', '.join(SCHEDULE_POLICIES)}")
    if args.retraction_policy not in RETRACTION_POLICIES:
        raise CoreError(f"--retraction-policy {args.retraction_policy!r} is not one of {', '.join(RETRACTION_POLICIES)}")
    if args.radix_eviction_policy not in EVICTION_POLICIES:
        raise CoreError(f"--radix-eviction-policy {args.radix_eviction_policy!r} is not one of {', '.join(EVICTION_POLICIES)}")
    if args.num_continuous_decode_steps < 1:
        raise CoreError(f"--num-continuous-decode-steps must be >= 1, got {args.num_continuous_decode_steps}")
    if args.decode_log_interval < 1:
        raise CoreError(f"--decode-log-interval must be >= 1, got {args.decode_log_interval}")
    if args.prefill_max_requests is not None and args.prefill_max_requests < 1:
        raise CoreError(f"--prefill-max-requests must be >= 1, got {args.prefill_max_requests}")
    if args.soft_watchdog_timeout is not None and args.soft_watchdog_timeout <= 0:
        raise CoreError(f"--soft-watchdog-timeout must be > 0 seconds, got {args.soft_watchdog_timeout}")
    if args.schedule_conservativeness <= 0:
        raise CoreError(f"--schedule-conservativeness must be > 0, got {args.schedule_conservativeness}")
    from core.engine.hidden_states import check_args

    check_args(args)
    if args.enable_custom_logit_processor:
        import importlib.util

        if importlib.util.find_spec("dill") is None:  # (SGLang's clients pickle processors with dill)
            raise CoreError("--enable-custom-logit-processor needs the dill package: pip install dill")


def lora_requested(args: Any) -> bool:
    """Whether the engine serves LoRA adapters: ``--enable-lora``, or ``--lora-paths`` (which implies
    it, as in SGLang). The one test the engine, its start-up checks and the server share."""
    return bool(getattr(args, "enable_lora", False) or getattr(args, "lora_paths", None))


def overlap_schedule(args: EngineArgs, device: torch.device) -> bool:
    """Whether steps overlap (``AsyncEngine._step``): by default on CUDA, where the host's work
    hides behind the device's; on the CPU only when asked (``--enable-overlap-schedule``): there
    the host's Python and the forward's threads share the cores (docs/benchmarks.md has the figures)."""
    from core.errors import CoreError

    if args.disable_overlap_schedule and args.enable_overlap_schedule:
        raise CoreError("--disable-overlap-schedule and --enable-overlap-schedule contradict each other; pass one")
    if args.disable_overlap_schedule:  # (speculation: a step that may verify waits, Scheduler.needs_results)
        return False
    return args.enable_overlap_schedule or device.type == "cuda"
