"""The ``core`` command: ``serve``, ``generate``, ``plugins``, ``bench``.

Errors users can act on (bad flags, missing model, unknown plugin) are printed as one
line naming the problem, with exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from core.errors import CoreError


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine flags shared by ``serve`` and ``generate`` (SGLang's names and defaults)."""
    g = p.add_argument_group("Model and tokenizer")
    g.add_argument("--model-path", "--model", dest="model_path", default=None,
                   help="Hugging Face folder or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    g.add_argument("--tokenizer-path", default=None)
    g.add_argument("--served-model-name", default=None)
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16", "half", "float"])
    g.add_argument("--context-length", type=int, default=None)
    g.add_argument("--skip-tokenizer-init", action="store_true")
    g.add_argument("--json-model-override-args", default=None, help="JSON object overriding config.json fields")
    g.add_argument("--device", default="auto")
    g = p.add_argument_group("Memory and scheduling")
    g.add_argument("--mem-fraction-static", type=float, default=None)
    g.add_argument("--max-total-tokens", type=int, default=None)
    g.add_argument("--max-running-requests", type=int, default=None)
    g.add_argument("--max-prefill-tokens", type=int, default=16384)
    g.add_argument("--chunked-prefill-size", type=int, default=None,
                   help="prefill long prompts in chunks of this many tokens between decode steps "
                        "(default: 2048 on CPU, 8192 on GPU; -1 disables)")
    g.add_argument("--enable-mixed-chunk", action="store_true", help="run a prefill chunk and the decode steps in one forward")
    g.add_argument("--schedule-policy", default="fcfs", choices=["fcfs", "lpm", "dfs-weight", "lof", "random"],
                   help="order of the waiting queue (lpm, dfs-weight: cache-aware)")
    g.add_argument("--schedule-conservativeness", type=float, default=1.0,
                   help="larger: admit fewer requests (estimate more future KV use), fewer retractions")
    g.add_argument("--enable-priority-scheduling", action="store_true",
                   help="order the queue by the request field 'priority' first (higher values first)")
    g.add_argument("--schedule-low-priority-values-first", action="store_true",
                   help="with --enable-priority-scheduling, lower priority values run first")
    g.add_argument("--disable-radix-cache", action="store_true", help="no prefix cache: every prompt is prefilled in full")
    g.add_argument("--radix-eviction-policy", default="lru", choices=["lru", "lfu"],
                   help="which unused cached prefixes are evicted first when the KV pool runs low")
    g.add_argument("--page-size", type=int, default=1)
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--random-seed", type=int, default=None)
    g.add_argument("--cpu-threads", type=int, default=None,
                   help="torch intra-op threads on CPU (default: torch's choice, all cores; OMP_NUM_THREADS also applies)")
    g = p.add_argument_group("Kernel backends and plugins")
    g.add_argument("--attention-backend", default=None)
    g.add_argument("--quantization", default=None)
    g.add_argument("--plugins", default=None, help="comma-separated plugins to load (default: $CORE_PLUGINS or all installed)")
    g.add_argument("--strict-plugins", action="store_true", help="a plugin that fails to load stops start-up")
    g = p.add_argument_group("Logging")
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error", "critical"])


ENGINE_ARG_NAMES = (
    "model_path", "tokenizer_path", "served_model_name", "dtype", "context_length", "skip_tokenizer_init",
    "json_model_override_args", "load_format", "is_embedding", "device", "mem_fraction_static", "max_total_tokens", "max_running_requests",
    "max_prefill_tokens", "chunked_prefill_size", "enable_mixed_chunk", "schedule_policy", "schedule_conservativeness",
    "enable_priority_scheduling", "schedule_low_priority_values_first", "disable_radix_cache", "radix_eviction_policy",
    "page_size", "kv_cache_dtype", "random_seed", "cpu_threads", "attention_backend",
    "quantization", "grammar_backend", "plugins", "strict_plugins", "log_level",
)


def engine_kwargs(ns: argparse.Namespace) -> dict:
    return {k: getattr(ns, k) for k in ENGINE_ARG_NAMES if hasattr(ns, k)}


def _cmd_generate(ns: argparse.Namespace) -> int:
    from core.engine.offline import Engine

    engine = Engine(**engine_kwargs(ns))
    try:
        prompt = ns.prompt
        if ns.chat and engine.tokenizer is not None and engine.tokenizer.chat_template:
            prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
        params = {"max_new_tokens": ns.max_new_tokens, "temperature": ns.temperature}
        shown = 0
        for chunk in engine.generate(prompt, params, stream=True):  # chunks carry the cumulative text
            sys.stdout.write(chunk["text"][shown:])
            sys.stdout.flush()
            shown = len(chunk["text"])
        sys.stdout.write("\n")
    finally:
        engine.shutdown()
    return 0


def _cmd_plugins(ns: argparse.Namespace) -> int:
    from core.plugins import load_plugins

    manager = load_plugins(ns.plugins, strict=ns.strict_plugins)
    if ns.json:
        sys.stdout.write(json.dumps(manager.describe(), indent=2) + "\n")
    else:
        sys.stdout.write(manager.format_table() + "\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="core", description="A small asyncio LLM serving engine with plugins.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate a completion on the command line")
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--no-chat", dest="chat", action="store_false", help="send the prompt raw, without the chat template")
    add_engine_args(gen)
    gen.set_defaults(func=_cmd_generate)

    plg = sub.add_parser("plugins", help="list installed plugins and what they register")
    plg.add_argument("--json", action="store_true")
    plg.add_argument("--plugins", default=None)
    plg.add_argument("--strict-plugins", action="store_true")
    plg.set_defaults(func=_cmd_plugins)

    from core.bench_serving import add_bench_command
    from core.server.args import add_serve_command

    add_serve_command(sub)
    add_bench_command(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from core.log import configure_logging

    parser = build_parser()
    ns = parser.parse_args(argv)
    configure_logging(getattr(ns, "log_level", "info"))
    try:
        return ns.func(ns) or 0
    except CoreError as e:
        sys.stderr.write(f"core {ns.command}: error: {e}\n")
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
