"""The ``core`` command: ``serve``, ``generate``, ``plugins``, ``bench``.

Errors users can act on (bad flags, missing model, unknown plugin) are printed as one
line naming the problem, with exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from core.engine.config import add_engine_args, engine_kwargs
from core.errors import CoreError


def _cmd_generate(ns: argparse.Namespace) -> int:
    from core.engine.offline import Engine
    from core.server.args import check_device_args

    check_device_args(ns)  # before loading: a device this machine lacks is refused in one line
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
    if ns.check:  # the conformance suites of every kind NAME is registered as (core.testing)
        from core.testing.check import check_command

        return check_command(ns.check, manager, sys.stdout, as_json=ns.json)
    if ns.json:
        sys.stdout.write(json.dumps(manager.describe(), indent=2) + "\n")
    else:
        sys.stdout.write(manager.format_table() + "\n")
        sys.stdout.write(_attention_choice(manager) + "\n")
    return 0


def _attention_choice(manager) -> str:
    """What ``--attention-backend`` defaults to on this machine, and who decided."""
    from core.engine.device import pick_device

    device = pick_device("auto")
    try:
        name, why, chooser = manager.choose_attention_backend(device)
    except CoreError as e:
        return f"\ndefault attention backend on {device.type}: none ({e})"
    return f"\ndefault attention backend on {device.type}: {name} (chosen by {chooser}: {why})"


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
    plg.add_argument("--check", metavar="NAME", default=None,
                     help="run the conformance suite of NAME's kind against it; a pass/fail table, exit 1 on a failure")
    plg.set_defaults(func=_cmd_plugins)

    from core.bench_serving import add_bench_command
    from core.server.launch import add_serve_command

    add_serve_command(sub)
    add_bench_command(sub)
    return parser


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[command]


def main(argv: Sequence[str] | None = None) -> int:
    from core.log import configure_logging

    parser = build_parser()
    ns, extras = parser.parse_known_args(argv)
    if extras:  # `core serve` reports its own; argparse's report would be usage plus "unrecognized arguments"
        from core.server.args import unknown_flag_message

        sub = _subparser(parser, ns.command)
        flag = extras[0].split("=", 1)[0]
        sub.exit(2, f"core {ns.command}: error: {unknown_flag_message(flag, list(sub._option_string_actions), ns.command)}\n")
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
