"""EngineArgs and the flags derived from its fields: every field but ``extra`` is a flag whose
default is the field's, values parse to the field's type, serve-only flags stay off
``core generate``, and plugin flags land in ``extra``."""

from __future__ import annotations

import argparse

import attrs
import pytest

from core.engine.config import EngineArgs, add_engine_args, engine_args_from_namespace, engine_flags, engine_kwargs


def _parser(serve: bool = False) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(exit_on_error=False)
    add_engine_args(p, serve=serve)
    return p


def test_every_field_but_extra_is_a_flag_with_the_fields_default():
    flagged = {f.name for f, _, _ in engine_flags(serve=True)}
    assert flagged == {f.name for f in attrs.fields(EngineArgs)} - {"extra"}
    ns = _parser(serve=True).parse_args([])
    assert engine_args_from_namespace(ns) == EngineArgs()


def test_values_parse_to_the_fields_types():
    ns = _parser().parse_args(["--model", "m.gguf", "--context-length", "512", "--mem-fraction-static", "0.5",
                               "--schedule-conservativeness", "2", "--disable-radix-cache", "--dtype", "bfloat16",
                               "--plugins", "a,b", "--grammar-backend", "none", "--load-format", "dummy"])
    args = engine_args_from_namespace(ns)
    assert args.model_path == "m.gguf" and args.context_length == 512 and args.dtype == "bfloat16"
    assert args.mem_fraction_static == 0.5 and args.schedule_conservativeness == 2.0
    assert isinstance(args.schedule_conservativeness, float) and args.disable_radix_cache is True
    assert (args.plugins, args.grammar_backend, args.load_format) == ("a,b", "none", "dummy")


@pytest.mark.parametrize("argv", [["--schedule-policy", "sjf"], ["--dtype", "int3"], ["--page-size", "x"],
                                  ["--radix-eviction-policy", "mru"], ["--log-level", "loud"]])
def test_bad_values_are_refused_by_the_parser(argv):
    with pytest.raises(argparse.ArgumentError, match=argv[0]):
        _parser().parse_args(argv)


def test_serve_only_flags_are_not_offered_to_generate():
    assert _parser().parse_known_args(["--is-embedding"])[1] == ["--is-embedding"]  # not a generate flag
    assert engine_args_from_namespace(_parser(serve=True).parse_args(["--is-embedding"])).is_embedding is True
    assert "is_embedding" not in engine_kwargs(_parser().parse_args([]))


def test_groups_in_order_and_plugin_flags_reach_extra():
    p = _parser(serve=True)
    titles = [g.title for g in p._action_groups[2:]]  # after positionals and options (--help)
    assert titles == ["Model and tokenizer", "Memory and scheduling", "Kernel backends and plugins",
                      "Parallelism and multi-node serving", "LoRA", "Logging"]
    p.add_argument("--myplug-scale", type=float, default=1.0)
    ns = p.parse_args(["--myplug-scale", "3", "--max-total-tokens", "64"])
    args = engine_args_from_namespace(ns, ("myplug_scale",))
    assert args.extra == {"myplug_scale": 3.0} and args.max_total_tokens == 64


def test_core_config_is_a_compat_path():
    import core.config
    import core.engine.config

    assert core.config.EngineArgs is core.engine.config.EngineArgs
    assert core.config.engine_args_from_kwargs(dict(model="x", page_size=4)) == EngineArgs(model_path="x", page_size=4)
