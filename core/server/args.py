"""``core serve``: SGLang's server flags, a YAML ``--config`` file and plugin flags.

Flag names and defaults follow SGLang's ``launch_server`` where the feature exists.
SGLang flags for features this engine does not have yet are still accepted by the
parser, but setting one to a non-default value stops start-up with an error naming
it: they are never silently ignored. ``--help`` groups the flags as SGLang's docs do.

Plugins add namespaced flags through the ``add_cli_options`` hook. The serve parser
loads the plugins (honouring ``--plugins`` / ``--strict-plugins`` / ``$CORE_PLUGINS``)
the first time it parses, before the real parse, so plugin flags work on the command
line, in ``--config`` files and in ``--help``; their values reach
``EngineArgs.extra``.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
from typing import Any, Callable, NoReturn, Sequence

import attrs

from core.engine.config import DRAFT_MODEL_ALGORITHMS, add_engine_args, engine_args_from_namespace  # noqa: F401 (engine_args_from_namespace: re-exported)
from core.engine import gc_watch
from core.engine.sampling_params import PREFERRED_SAMPLING_KEYS, check_preferred
from core.engine.sglang_flags import SGLANG_FLAGS_LACKING
from core.errors import CoreError
from core.server.limits import DEFAULT_MAX_BODY_BYTES
from core.server.observability import Observability, add_observability_args, check_observability, observability_of
from core.server.http2 import add_frontend_args, check_frontend_args
from core.server.tls import check_ssl_args

# SGLang's help sections, in the order of its server-arguments docs.
GROUPS = (
    "Model and tokenizer",
    "HTTP server",
    "Quantization and data type",
    "Memory and scheduling",
    "Runtime options",
    "Logging",
    "API related",
    "Data parallelism",
    "Multi-node distributed serving",
    "Model override args",
    "LoRA",
    "Kernel backends (attention, sampling, grammar, GEMM)",
    "Speculative decoding",
    "Expert parallelism",
    "Optimization/debug options",
    "PD disaggregation",
    "Plugins",
    "Configuration file",
)

# core.engine.config.add_engine_args group titles -> SGLang sections; per-flag moves for flags it files elsewhere.
_ENGINE_GROUP_MAP = {
    "Model and tokenizer": "Model and tokenizer",
    "Memory and scheduling": "Memory and scheduling",
    "Kernel backends and plugins": "Kernel backends (attention, sampling, grammar, GEMM)",
    "Parallelism and multi-node serving": "Runtime options",
    "Logging": "Logging",
    "LoRA": "LoRA",
}
_FLAG_SECTION = {
    "--dtype": "Quantization and data type",
    "--quantization": "Quantization and data type",
    "--kv-cache-dtype": "Quantization and data type",
    "--torchao-config": "Quantization and data type",
    "--served-model-name": "API related",
    "--device": "Runtime options",
    "--random-seed": "Runtime options",
    "--cpu-threads": "Runtime options",
    "--watchdog-timeout": "Runtime options",
    "--json-model-override-args": "Model override args",
    "--plugins": "Plugins",
    "--tp-size": "Runtime options",
    "--dp-size": "Data parallelism",
    "--load-balance-method": "Data parallelism",
    "--dist-init-addr": "Multi-node distributed serving",
    "--nnodes": "Multi-node distributed serving",
    "--node-rank": "Multi-node distributed serving",
    "--dist-timeout": "Multi-node distributed serving",
    "--strict-plugins": "Plugins",
}

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 30000


def _off(*ok: Any) -> Callable[[Any], bool]:
    """Unset (None / False), or one of ``ok``."""
    return lambda v: v is None or v is False or (not isinstance(v, (list, tuple, dict)) and not isinstance(v, bool)
                                                 and any(type(v) is type(o) and v == o for o in ok))


NOT_SUPPORTED_YET: dict[str, tuple[Callable[[Any], bool], str]] = {
    # dest: (is the value acceptable, what is supported)
    "pp_size": (_off(1), "only 1 is supported"),
    "ep_size": (_off(1), "only 1 is supported"),
    "enable_dp_attention": (_off(), ""),
    "speculative_algorithm": (lambda v: str(v).upper() not in DRAFT_MODEL_ALGORITHMS, "NGRAM, STANDALONE, EAGLE, EAGLE3 and NEXTN are supported"),
    "disaggregation_mode": (_off("null"), ""),
    "enable_torch_compile": (_off(), ""),
    "trust_remote_code": (_off(), "custom model code is never executed"),
    "tokenizer_mode": (_off("auto"), "only 'auto' is supported"),
    "load_format": (_off("auto", "safetensors", "pt", "gguf", "dummy"), "supported: auto, safetensors, pt, gguf, dummy"),
}


CUDA_ONLY_ATTENTION_BACKENDS = ("flashinfer", "triton")  # their kernels are CUDA-only


def unknown_flag_message(flag: str, known: Sequence[str], command: str = "serve") -> str:
    """One line for a flag the parser does not know: an SGLang server flag core lacks is named as
    one (so nobody hunts for a typo), anything else gets the closest known spellings."""
    if command == "serve" and flag in SGLANG_FLAGS_LACKING:
        return f"{flag} is an SGLang flag this server does not support yet"
    if not flag.startswith("-"):
        return f"unexpected argument {flag!r} (flags start with --; the model is --model-path)"
    close = difflib.get_close_matches(flag, [k for k in known if k.startswith("--")], n=3, cutoff=0.6)
    hint = f"; did you mean {_one_of(close)}?" if close else f"; `core {command} --help` lists the flags"
    return f"unknown flag {flag}{hint}"


def _one_of(words: Sequence[str]) -> str:
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


class _Sections:
    """Stands in for the parser in ``add_engine_args``: its argument groups land in SGLang's sections."""

    def __init__(self, parser: argparse.ArgumentParser, sections: dict[str, argparse._ArgumentGroup]) -> None:
        self._parser, self._sections = parser, sections

    def add_argument_group(self, title: str | None = None, *args: Any, **kwargs: Any) -> Any:
        return _SectionRouter(self._sections, self._sections.get(_ENGINE_GROUP_MAP.get(title or "", ""))
                              or self._sections.setdefault(title or "Other", self._parser.add_argument_group(title)))

    def add_argument(self, *args: Any, **kwargs: Any) -> Any:
        return _SectionRouter(self._sections, self._sections["Runtime options"]).add_argument(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._parser, name)


class _SectionRouter:
    def __init__(self, sections: dict[str, argparse._ArgumentGroup], default: argparse._ArgumentGroup) -> None:
        self._sections, self._default = sections, default

    def add_argument(self, *args: Any, **kwargs: Any) -> Any:
        target = next((self._sections[_FLAG_SECTION[a]] for a in args if a in _FLAG_SECTION), self._default)
        return target.add_argument(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._default, name)


class ServeArgumentParser(argparse.ArgumentParser):
    """The ``serve`` sub-parser: loads plugins (for their flags) and expands ``--config`` before parsing."""

    plugin_manager: Any = None
    plugin_dests: tuple[str, ...] = ()
    _prepared = False

    def parse_known_args(self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None):  # type: ignore[override]
        import sys

        args = list(sys.argv[1:] if args is None else args)
        if not self._prepared:
            self._prepared = True
            self._load_plugin_options(args)
        args = self._expand_config(args)
        ns, extras = super().parse_known_args(args, namespace)
        if extras:  # argparse's own report is the whole usage and "unrecognized arguments", no hint
            flag = extras[0].split("=", 1)[0]
            self.error(unknown_flag_message(flag, list(self._option_string_actions)))
        return ns, extras

    def error(self, message: str) -> NoReturn:  # type: ignore[override]
        """One line naming the problem, not argparse's 60 lines of usage above it."""
        self.exit(2, f"core serve: error: {message}\n")

    # ------------------------------------------------------------------ plugins
    def _load_plugin_options(self, args: list[str]) -> None:
        pre = argparse.ArgumentParser(add_help=False)
        pre.add_argument("--plugins", default=None)
        pre.add_argument("--strict-plugins", action="store_true")
        pre.add_argument("--config", default=None)
        known, _ = pre.parse_known_args([a for a in args if a not in ("-h", "--help")])
        allow, strict = known.plugins, known.strict_plugins
        if known.config and (allow is None or not strict):
            try:
                cfg = read_config_file(known.config)
            except CoreError:
                cfg = {}  # reported properly by _expand_config
            allow = allow if allow is not None else cfg.get("plugins")
            strict = strict or bool(cfg.get("strict_plugins"))
        from core.plugins import load_plugins

        try:
            manager = load_plugins(allow, strict=strict)
        except CoreError as e:
            self.exit(2, f"core serve: error: {e}\n")
        before = {a.dest for a in self._actions}
        group = self._sections["Plugins"] if hasattr(self, "_sections") else self
        manager.pm.hook.add_cli_options(parser=_PluginOptions(self, group))
        self.plugin_manager = manager
        self.plugin_dests = tuple(a.dest for a in self._actions if a.dest not in before)
        # cmd_serve gets them through the namespace (underscore names are not flags)
        self.set_defaults(_plugin_manager=manager, _plugin_dests=self.plugin_dests)

    # ------------------------------------------------------------------ --config
    def _expand_config(self, args: list[str]) -> list[str]:
        path = None
        for i, a in enumerate(args):
            if a == "--config" and i + 1 < len(args):
                path = args[i + 1]
            elif a.startswith("--config="):
                path = a.split("=", 1)[1]
        if path is None:
            return args
        try:
            cfg = read_config_file(path)
        except CoreError as e:
            self.exit(2, f"core serve: error: {e}\n")
        by_dest = {a.dest: a for a in self._actions if a.option_strings}
        expanded: list[str] = []
        for key, value in cfg.items():
            action = by_dest.get(key)
            if action is None or key in ("config", "help"):
                self.error(f"config file {path}: " + unknown_flag_message(
                    "--" + key.replace("_", "-"), [f for f in self._option_string_actions if f != "--config"]))
            flag = next((s for s in action.option_strings if s.startswith("--")), action.option_strings[0])
            if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
                if not isinstance(value, bool):
                    self.error(f"config file {path}: {key}: {value!r} is not allowed (allowed: true or false)")
                if value == isinstance(action, argparse._StoreTrueAction):
                    expanded.append(flag)
                continue
            if value is None:
                continue
            if isinstance(value, (list, tuple)):
                if action.nargs in (None, 1, "?") and key != "plugins":
                    self.error(f"config file {path}: {key}: takes one value, got the list {value!r}")
                if key == "plugins":
                    expanded += [flag, ",".join(map(str, value))]
                    continue
                values = [_yaml_scalar(v) for v in value]
            elif isinstance(value, dict):
                import json

                values = [json.dumps(value)]
            else:
                values = [_yaml_scalar(value)]
            for text in values:
                self._check_config_value(path, key, action, text)
            expanded += [flag, *values]
        return expanded + args  # command-line values come later, so they win

    def _check_config_value(self, path: str, key: str, action: argparse.Action, text: str) -> None:
        """A bad value names the file, the key and what is allowed; argparse would blame a flag
        the user never typed, under 60 lines of usage."""
        kind = action.type if callable(action.type) else None
        try:
            value = kind(text) if kind else text
        except (TypeError, ValueError, argparse.ArgumentTypeError):
            allowed = _KIND_WORDS.get(kind, getattr(kind, "__name__", "another value"))
        else:
            if action.choices is None or value in action.choices:
                return
            allowed = "one of " + ", ".join(map(str, action.choices))
        self.error(f"config file {path}: {key}: {text!r} is not allowed (allowed: {allowed})")


_KIND_WORDS: dict[Any, str] = {int: "an integer", float: "a number"}


class _PluginOptions:
    """What a plugin's ``add_cli_options(parser)`` sees: flags land in the "Plugins" section."""

    def __init__(self, parser: argparse.ArgumentParser, group: Any) -> None:
        self._parser, self._group = parser, group

    def add_argument(self, *args: Any, **kwargs: Any) -> Any:
        return self._group.add_argument(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._parser, name)


def _yaml_scalar(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def read_config_file(path: str) -> dict[str, Any]:
    """A YAML mapping of flag names (dashes or underscores, optional leading ``--``) to values."""
    import yaml

    try:
        with open(os.path.expanduser(path), encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except FileNotFoundError:
        raise CoreError(f"config file {path} does not exist") from None
    except (OSError, yaml.YAMLError) as e:
        raise CoreError(f"cannot read config file {path}: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise CoreError(f"config file {path} must hold a mapping of option names to values")
    out: dict[str, Any] = {}
    for k, v in data.items():
        key = str(k).lstrip("-").replace("-", "_")
        if key == "model":
            key = "model_path"
        out[key] = v
    return out


# ---------------------------------------------------------------------------- parser
def add_serve_args(p: argparse.ArgumentParser) -> None:
    sections = {title: p.add_argument_group(title) for title in GROUPS}
    p._sections = sections  # type: ignore[attr-defined]
    add_engine_args(_Sections(p, sections), serve=True)  # type: ignore[arg-type]

    def s(title: str) -> argparse._ArgumentGroup:
        return sections[title]

    g = s("Model and tokenizer")
    g.add_argument("--tokenizer-mode", default="auto", help="not supported yet except 'auto'")
    g.add_argument("--trust-remote-code", action="store_true", help="not supported: custom model code never runs")

    g = s("HTTP server")
    g.add_argument("--host", default=DEFAULT_HOST, help=f"address to bind (default {DEFAULT_HOST})")
    g.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port to bind (default {DEFAULT_PORT})")
    g.add_argument("--skip-server-warmup", action="store_true", help="skip the warm-up generate before /health reports ready")
    g.add_argument("--graceful-shutdown-timeout", "--drain-timeout", dest="graceful_shutdown_timeout", type=float,
                   default=5.0, help="after SIGTERM/SIGINT: seconds running requests (streams included) may take to "
                                     "finish while /health and new requests get 503; the rest are then aborted with "
                                     "a reason and the server exits 0")
    g.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help=f"largest JSON request body; a larger one gets HTTP 413 (default {DEFAULT_MAX_BODY_BYTES}, "
                        "8 MiB; /v1/files uploads have their own limit)")
    g.add_argument("--fastapi-root-path", default="", metavar="PREFIX",
                   help="the path prefix a proxy strips before forwarding (the ASGI root_path): routes stay at "
                        "/generate etc., request URLs carry the prefix")
    g.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this PEM certificate (needs --ssl-keyfile)")
    g.add_argument("--ssl-keyfile", default=None, help="the certificate's PEM private key (needs --ssl-certfile)")
    g.add_argument("--ssl-ca-certs", default=None,
                   help="CA certificates (PEM) loaded into the server's TLS context; clients are not asked for "
                        "certificates (no mutual TLS, as in SGLang)")
    g.add_argument("--ssl-keyfile-password", default=None, help="the password of an encrypted --ssl-keyfile")
    add_frontend_args(g, s("Model and tokenizer"))  # --enable-http2, --http2-*, --tokenizer-worker-num

    g = s("Memory and scheduling")
    g.add_argument("--max-queued-requests", type=int, default=None,
                   help="requests allowed to wait for admission; more get HTTP 503 (default: unlimited)")

    g = s("Runtime options")
    g.add_argument("--pipeline-parallel-size", "--pp-size", dest="pp_size", type=int, default=1, help="only 1 is supported")
    g.add_argument("--stream-interval", type=int, default=1,
                   help="send a streaming chunk every this many tokens, the first token at once (default 1)")
    g.add_argument("--disable-frontend-multiprocessing", action="store_true",
                   help="run the engine in the HTTP server's process (vLLM's flag; by default on CUDA the engine "
                        "runs in a process of its own, so that the server's Python never holds its GIL)")
    g.add_argument("--enable-frontend-multiprocessing", action="store_true",
                   help="the engine in a process of its own on the CPU too (off there by default: the default "
                        "model measured the same either way; a small model's many streams gain, docs/benchmarks.md)")
    g.add_argument("--incremental-streaming-output", action="store_true",
                   help="a streaming /generate chunk holds the text, output_ids and output logprobs new since the "
                        "last chunk (default: everything so far)")

    g = s("Logging")
    g.add_argument("--log-level-http", default=None, choices=["debug", "info", "warning", "error", "critical"],
                   help="the HTTP server's (hypercorn's) log level (default: --log-level)")
    g.add_argument("--log-requests", action="store_true", help="log the inputs and outputs of every request")
    g.add_argument("--log-requests-level", type=int, default=2, choices=[0, 1, 2, 3],
                   help="0: metadata, 1: + sampling params, 2: + inputs/outputs up to 2048 chars, 3: everything")
    g.add_argument("--enable-metrics", action="store_true", help="serve Prometheus metrics at /metrics")
    add_observability_args(g)

    g = s("API related")
    g.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every endpoint but /health*, /ready* and /metrics")
    g.add_argument("--admin-api-key", default=None,
                   help="the key of the admin endpoints (weight updates, /flush_cache, LoRA loading, profiling, "
                        "/abort_request...); there --api-key is then not accepted, nor this key elsewhere")
    g.add_argument("--weight-version", default="default",
                   help="the weights' version string, reported by /get_model_info and in meta_info; "
                        "/update_weights_from_disk and /update_weight_version change it")
    g.add_argument("--chat-template", default=None, help="chat template: a Jinja file path or a template string")
    g.add_argument("--file-storage-path", default="sglang_storage", help="where the files API stores uploads")
    g.add_argument("--enable-cache-report", action="store_true",
                   help="report cached prompt tokens in usage.prompt_tokens_details")
    g.add_argument("--reasoning-parser", default=None,
                   help="separate reasoning_content in chat responses: deepseek-r1, qwen3, qwen3-thinking, kimi, gpt-oss "
                        "(any registered reasoning parser)")
    g.add_argument("--tool-call-parser", default=None,
                   help="parse tool calls from model output: qwen25, llama3, mistral, deepseekv3, pythonic, qwen3_coder, "
                        "kimi_k2, glm45, gpt-oss (any registered tool parser)")
    g.add_argument("--sampling-defaults", default="model", choices=["openai", "model"],
                   help="where a chat request's omitted temperature, top_p, top_k, min_p and repetition_penalty come "
                        "from: the model's generation_config.json (model, the default, as SGLang) or OpenAI's defaults")
    g.add_argument("--preferred-sampling-params", type=_json_object, default=None, metavar="JSON",
                   help="server-wide defaults for the sampling parameters a request leaves unset, as a JSON object "
                        f"of {', '.join(PREFERRED_SAMPLING_KEYS)} (SGLang's; /get_model_info reports them)")
    g.add_argument("--default-chat-template-kwargs", type=_json_object, default=None, metavar="JSON",
                   help='chat template kwargs of every chat request, under its own (per key, the request wins), '
                        'e.g. \'{"enable_thinking": false}\'; the reasoning parser reads the merged ones')
    g.add_argument("--hf-chat-template-name", default=None, metavar="NAME",
                   help="the tokenizer's named chat template to use when it has several (default: its 'default', "
                        "else the first)")
    g.add_argument("--completion-template", default=None, metavar="NAME|FILE",
                   help="fill-in-the-middle markers for /v1/completions' suffix: deepseek_coder, star_coder, "
                        "qwen_coder or a JSON file in SGLang's format (without it a suffix is refused)")
    g.add_argument("--stream-response-default-include-usage", action="store_true",
                   help="every streamed chat or completion ends with the usage chunk, stream_options or not")
    g.add_argument("--allow-auto-truncate", action="store_true",
                   help="a prompt longer than the context keeps its first context-length - 1 tokens (the tail is "
                        "dropped, as SGLang does) instead of being rejected; max tokens are cut to what fits. "
                        "Same rule on /generate, /v1/completions and /v1/chat/completions")

    g = s("Expert parallelism")
    g.add_argument("--expert-parallel-size", "--ep-size", "--ep", dest="ep_size", type=int, default=1,
                   help="only 1 is supported")

    g = s("Optimization/debug options")
    g.add_argument("--enable-torch-compile", action="store_true", help="not supported yet")
    g.add_argument("--enable-dp-attention", action="store_true", help="not supported yet")

    g = s("PD disaggregation")
    g.add_argument("--disaggregation-mode", default="null", help="not supported yet (only 'null')")

    g = s("Configuration file")
    g.add_argument("--config", default=None, metavar="FILE.yaml",
                   help="YAML file of flags (dashes or underscores); command-line flags override it")


def add_serve_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """The ``serve`` sub-parser with every flag (``core.server.launch`` attaches the command)."""
    previous = subparsers._parser_class
    subparsers._parser_class = ServeArgumentParser
    try:
        p = subparsers.add_parser(
            "serve", help="serve a model over HTTP (SGLang native + OpenAI-compatible APIs)",
            description="Serve a model over HTTP with SGLang's native API and the OpenAI-compatible API. "
                        "Flags follow SGLang's `launch_server`; those for features core lacks are rejected.",
        )
    finally:
        subparsers._parser_class = previous
    add_serve_args(p)
    return p


# ---------------------------------------------------------------------------- validation
def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object is needed, got {text!r}")
    return value


def check_serve_chat_flags(ns: argparse.Namespace) -> None:
    """``--default-chat-template-kwargs`` and the JSON whitespace flags, refused before the model
    loads where every request would fail or the grammar backend cannot honour them."""
    from core.engine.grammar import check_json_whitespace, json_whitespace_options
    from core.server.openai.chat_template import check_default_template_kwargs

    check_default_template_kwargs(getattr(ns, "default_chat_template_kwargs", None))
    if (plugins := getattr(ns, "_plugin_manager", None)) is not None:  # (the engine checks again, with its own)
        check_json_whitespace(plugins, getattr(ns, "grammar_backend", None), json_whitespace_options(ns))


def validate_serve_args(ns: argparse.Namespace) -> None:
    """Raise CoreError naming the first flag that asks for something core cannot do yet."""
    for dest, (ok, note) in NOT_SUPPORTED_YET.items():
        if not hasattr(ns, dest):
            continue
        value = getattr(ns, dest)
        if not ok(value):
            flag = "--" + dest.replace("_", "-")
            shown = "" if isinstance(value, bool) or value is None else f" {_show(value)}"
            raise CoreError(f"{flag}{shown} is not supported yet" + (f" ({note})" if note else ""))
    if not 1 <= ns.port <= 65535:
        raise CoreError(f"--port must be in [1, 65535], got {ns.port}")
    if ns.stream_interval < 1:
        raise CoreError(f"--stream-interval must be >= 1, got {ns.stream_interval}")
    check_preferred(getattr(ns, "preferred_sampling_params", None))
    check_serve_chat_flags(ns)
    if ns.max_queued_requests is not None and ns.max_queued_requests < 0:
        raise CoreError(f"--max-queued-requests must be >= 0, got {ns.max_queued_requests}")
    if getattr(ns, "schedule_conservativeness", 1.0) <= 0:
        raise CoreError(f"--schedule-conservativeness must be > 0, got {ns.schedule_conservativeness}")
    if getattr(ns, "num_continuous_decode_steps", 1) < 1:
        raise CoreError(f"--num-continuous-decode-steps must be >= 1, got {ns.num_continuous_decode_steps}")
    if ns.max_running_requests is not None and ns.max_running_requests < 1:
        raise CoreError(f"--max-running-requests must be >= 1, got {ns.max_running_requests}")
    if ns.context_length is not None and ns.context_length < 2:
        raise CoreError(f"--context-length must be >= 2, got {ns.context_length}")
    for flag, key in (("--api-key", ns.api_key), ("--admin-api-key", getattr(ns, "admin_api_key", None))):
        if key is not None and not key:
            raise CoreError(f"{flag} must not be empty")
    check_ssl_args(ns)
    check_frontend_args(ns)
    check_observability(ns)  # (bucket, request-log and export flags; their directories are made here)
    if ns.graceful_shutdown_timeout < 0:
        raise CoreError("--graceful-shutdown-timeout must be >= 0")
    if ns.max_request_body_bytes < 1:
        raise CoreError(f"--max-request-body-bytes must be >= 1, got {ns.max_request_body_bytes}")
    if getattr(ns, "watchdog_timeout", 0) < 0:
        raise CoreError(f"--watchdog-timeout must be >= 0 (0 disables it), got {ns.watchdog_timeout}")
    if hasattr(ns, "gc_threshold"):
        gc_watch.check(ns)
    if ns.chat_template and _looks_like_path(ns.chat_template) and not os.path.isfile(os.path.expanduser(ns.chat_template)):
        raise CoreError(f"--chat-template {ns.chat_template}: no such file")
    from core.server.openai.completion_template import load_completion_template

    load_completion_template(getattr(ns, "completion_template", None))
    check_device_args(ns)


def check_device_args(ns: argparse.Namespace) -> None:
    """Refuse device choices this machine cannot run before the model loads (a CUDA-only backend
    used to fail after half a minute of loading, with advice to pip install it), and warn where
    a 16-bit dtype makes CPU serving many times slower than the fast one."""
    import torch

    device = getattr(ns, "device", "auto")
    if device != "auto" and not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        raise CoreError(f"--device {device} is not supported: use cpu, cuda or cuda:N, or leave it unset")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device.startswith("cuda") and not gpus:
        raise CoreError(f"--device {device} needs a CUDA GPU; this machine has none: use cpu, or leave it unset")
    if device.startswith("cuda") and int(device.partition(":")[2] or 0) >= gpus:
        raise CoreError(f"--device {device}: this machine has {gpus} CUDA GPU(s), cuda:0 to cuda:{gpus - 1}")
    on_cuda = device.startswith("cuda") or (device == "auto" and gpus > 0)
    for flag in ("attention", "prefill_attention", "decode_attention"):  # (the per-phase ones too)
        if (backend := getattr(ns, f"{flag}_backend", None)) in CUDA_ONLY_ATTENTION_BACKENDS and not on_cuda:
            why = "this machine has none" if not gpus else "--device cpu was given"
            raise CoreError(f"--{flag.replace('_', '-')}-backend {backend} cannot run here: it needs a CUDA GPU and "
                            f"{why}; use cpu or torch_native, or leave it unset")
    # (a slow --dtype on this CPU is warned about where the dtype is picked: core.engine.model_loader.loader.pick_dtype)


def _show(v: Any) -> str:
    return " ".join(map(str, v)) if isinstance(v, (list, tuple)) else str(v)


def _looks_like_path(s: str) -> bool:
    return "{" not in s and (s.endswith((".jinja", ".j2", ".json", ".txt")) or os.sep in s)


# ---------------------------------------------------------------------------- the typed view
@attrs.frozen
class ServerArgs:
    """The serve flags the HTTP layer reads, typed, built once from the parsed namespace
    (the engine's own flags become ``EngineArgs``)."""

    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    api_key: str | None = None
    model_path: str | None = None
    tokenizer_path: str | None = None
    log_level: str = "info"
    log_level_http: str | None = None
    skip_server_warmup: bool = False
    graceful_shutdown_timeout: float = 5.0
    max_request_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_queued_requests: int | None = None
    stream_interval: int = 1
    incremental_streaming_output: bool = False
    disable_frontend_multiprocessing: bool = False
    enable_frontend_multiprocessing: bool = False
    log_requests: bool = False
    log_requests_level: int = 2
    enable_metrics: bool = False
    chat_template: str | None = None
    file_storage_path: str = "sglang_storage"
    enable_cache_report: bool = False
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    allow_auto_truncate: bool = False
    sampling_defaults: str = "model"
    preferred_sampling_params: dict[str, Any] | None = None
    default_chat_template_kwargs: dict[str, Any] | None = None
    hf_chat_template_name: str | None = None
    completion_template: str | None = None
    stream_response_default_include_usage: bool = False
    fastapi_root_path: str = ""
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_keyfile_password: str | None = None
    admin_api_key: str | None = None
    weight_version: str = "default"
    observability: Observability = attrs.field(factory=Observability)  # core.server.observability's flags
    flags: dict[str, Any] = attrs.field(factory=dict)  # every serve flag, JSON-able, the key redacted (/get_server_info)

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> ServerArgs:
        names = [f.name for f in attrs.fields(cls) if f.name != "flags"]
        return cls(**{n: getattr(ns, n) for n in names if hasattr(ns, n)}, flags=public_flags(ns),
                   observability=observability_of(ns))


SECRET_FLAGS = ("api_key", "admin_api_key", "ssl_keyfile_password")


def public_flags(ns: argparse.Namespace) -> dict[str, Any]:
    """The parsed flags, JSON-able, with the keys and the key password redacted (SECRET_FLAGS)."""
    import msgspec

    out: dict[str, Any] = {}
    for k, v in vars(ns).items():
        if k.startswith("_") or k == "func" or callable(v):
            continue
        if k in SECRET_FLAGS and v is not None:
            v = "<redacted>"
        try:
            msgspec.json.encode(v)
        except (TypeError, msgspec.EncodeError):
            v = str(v)
        out[k] = v
    return out
