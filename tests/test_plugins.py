"""Plugin discovery, allowlist, failure handling, conflicts and lazy targets (no models loaded)."""

from __future__ import annotations

import re

import json
import sys
import types
import typing
from typing import Any

import pytest
from structlog.testing import capture_logs

import core.plugins as plugins
from core import hookimpl
from core.errors import PluginError, UnknownNameError
from core.interfaces import EXTENSION_KINDS, PLUGIN_API_VERSION
from core.plugins import ALLOW_ENV, PluginManager, load_plugins


class FakeDist:
    def __init__(self, name: str, version: str = "1.0") -> None:
        self.name, self.version = name, version


class FakeEP:
    """Stands in for importlib.metadata.EntryPoint: name, value, dist, load()."""

    def __init__(self, name: str, obj: Any = None, *, value: str | None = None,
                 dist: str | None = None, exc: BaseException | None = None) -> None:
        self.name, self.value = name, value or f"fake_{name}"
        self.dist = FakeDist(dist or f"dist-{name}")
        self.obj, self.exc, self.loads = obj, exc, 0

    def load(self) -> Any:
        self.loads += 1
        if self.exc is not None:
            raise self.exc
        return self.obj


def make_plugin(modname: str, api: str | None = None, **kinds: list[tuple]) -> types.ModuleType:
    """A plugin module whose register_* hooks register ``kind=[(name, target[, override])]``."""
    mod = types.ModuleType(modname)
    if api is not None:
        mod.CORE_PLUGIN_API = api
    for kind, entries in kinds.items():
        setattr(mod, EXTENSION_KINDS[kind], hookimpl(_registering(entries)))
    return mod


def _registering(entries: list[tuple]):
    def impl(register):
        for name, target, *rest in entries:
            register(name, target, override=bool(rest and rest[0]))

    return impl


@pytest.fixture
def installed(monkeypatch):
    """Set the fake installed entry points; returns a setter."""
    monkeypatch.delenv(ALLOW_ENV, raising=False)
    eps: list[FakeEP] = []
    monkeypatch.setattr(plugins, "_entry_points", lambda: list(eps))

    def set_eps(*new: FakeEP) -> list[FakeEP]:
        eps[:] = new
        return eps

    return set_eps


def three(installed):
    return installed(
        FakeEP("a", make_plugin("fa", attention_backend=[("fa", "json:dumps")])),
        FakeEP("b", make_plugin("fb", attention_backend=[("fb", "json:loads")])),
        FakeEP("c", make_plugin("fc", model=[("CModel", "json:JSONDecoder")])),
    )


def test_loads_all_and_records_provenance(installed):
    three(installed)
    m = load_plugins()
    assert [p.name for p in m.plugins] == ["a", "b", "c"]
    assert m.names("attention_backend") == ["fa", "fb"]
    reg = m.get("model", "CModel")
    assert (reg.plugin, reg.distribution, reg.version, reg.override) == ("c", "dist-c", "1.0", False)
    assert m.resolve("attention_backend", "fa") is json.dumps


def test_allowlist_argument_string_and_list(installed):
    three(installed)
    assert [p.name for p in load_plugins("a, c").plugins] == ["a", "c"]
    assert [p.name for p in load_plugins(["b"]).plugins] == ["b"]
    assert load_plugins("a").names("attention_backend") == ["fa"]


def test_unknown_name_hints_at_plugins_the_allowlist_left_out(installed):
    """A name an installed but unloaded plugin would provide: the error says to add that plugin
    (as when --plugins omits gguf for the default GGUF model)."""
    three(installed)
    with pytest.raises(UnknownNameError, match="the installed plugin 'b' provides it: add it to --plugins"):
        load_plugins("a").get("attention_backend", "b")
    with pytest.raises(UnknownNameError, match="left out the installed plugins b, c"):
        load_plugins("a").get("attention_backend", "fb")
    with pytest.raises(UnknownNameError) as e:  # nothing left out: no hint
        load_plugins().get("attention_backend", "nope")
    assert "left out" not in str(e.value) and "--plugins" not in str(e.value)


def test_allowlist_env_var(installed, monkeypatch):
    three(installed)
    monkeypatch.setenv(ALLOW_ENV, "b")
    assert [p.name for p in load_plugins().plugins] == ["b"]
    # An explicit argument wins over the environment.
    assert [p.name for p in load_plugins("c").plugins] == ["c"]


def test_unknown_name_in_allow_lists_installed(installed, monkeypatch):
    three(installed)
    with pytest.raises(PluginError, match=r"plugin 'nope' named in --plugins is not installed; "
                                          r"installed plugins: a, b, c"):
        load_plugins("a,nope")
    monkeypatch.setenv(ALLOW_ENV, "nope")
    with pytest.raises(PluginError, match=f"named in {ALLOW_ENV}.*installed plugins: a, b, c"):
        load_plugins()


def test_named_plugin_import_failure_raises_with_name_and_dist(installed):
    installed(FakeEP("bad", exc=ImportError("no module named torch_npu"), dist="acme-bad"))
    with pytest.raises(PluginError) as ei:
        load_plugins("bad")
    msg = str(ei.value)
    assert "'bad'" in msg and "acme-bad" in msg and "no module named torch_npu" in msg
    assert isinstance(ei.value.__cause__, ImportError)


def test_discovered_failing_plugin_skipped_and_recorded(installed):
    installed(
        FakeEP("bad", exc=RuntimeError("CUDA exploded"), dist="acme-bad"),
        FakeEP("good", make_plugin("fg", tool_parser=[("hermes", "json:loads")])),
    )
    with capture_logs() as logs:
        m = load_plugins()
    bad = m.plugins[0]
    assert bad.name == "bad" and "CUDA exploded" in bad.error and "Traceback" in bad.error
    assert m.names("tool_parser") == ["hermes"]
    warning = [e for e in logs if e["log_level"] == "warning"]
    assert warning and warning[0]["plugin"] == "bad" and "CUDA exploded" in warning[0]["traceback"]
    assert m.describe()[0]["error"] == bad.error
    assert "FAILED" in m.format_table()
    # An unknown name mentions the plugin that failed, since that is the likely cause.
    with pytest.raises(UnknownNameError, match="failed to load: bad"):
        m.get("tool_parser", "qwen")
    with pytest.raises(PluginError, match="acme-bad.*CUDA exploded"):
        load_plugins(strict=True)


def test_hook_raising(installed):
    mod = types.ModuleType("boom")

    @hookimpl
    def register_models(register):
        raise ValueError("boom")

    mod.register_models = register_models
    installed(FakeEP("boom", mod, dist="boom-dist"))
    with pytest.raises(PluginError, match=r"plugin 'boom' \(dist boom-dist\).*register_models.*boom") as ei:
        load_plugins("boom")
    assert isinstance(ei.value.__cause__, ValueError)
    m = load_plugins()  # auto-discovered: skipped, and not left in pluggy for lifecycle hooks
    assert "boom" in m.plugins[0].error and m.pm.get_plugin("boom") is None


@pytest.mark.parametrize("name,target", [
    ("x", 42), ("x", "no_colon"), ("x", ":attr"), ("x", "mod:"), ("", "json:dumps"), (None, "json:dumps"),
])
def test_wrong_registration_types(installed, name, target):
    installed(FakeEP("w", make_plugin("fw", quant_method=[(name, target)]), dist="w-dist"))
    with pytest.raises(PluginError, match=r"plugin 'w' \(dist w-dist\) in register_quant_methods"):
        load_plugins("w")
    assert load_plugins().plugins[0].error  # skipped when auto-discovered


def test_same_plugin_registering_twice(installed):
    installed(FakeEP("d", make_plugin("fd", model=[("M", "json:dumps"), ("M", "json:loads")])))
    with pytest.raises(PluginError, match="registered twice"):
        load_plugins("d")


def test_duplicate_names_error_names_both_distributions(installed):
    installed(
        FakeEP("one", make_plugin("f1", attention_backend=[("flash", "json:dumps")]), dist="dist-one"),
        FakeEP("two", make_plugin("f2", attention_backend=[("flash", "json:loads")]), dist="dist-two"),
    )
    with pytest.raises(PluginError) as ei:
        load_plugins()
    msg = str(ei.value)
    assert "'one'" in msg and "'two'" in msg and "dist-one" in msg and "dist-two" in msg
    assert "override=True" in msg


@pytest.mark.parametrize("override_first", [False, True])
def test_override_wins_and_is_shown(installed, override_first):
    base = make_plugin("fbase", attention_backend=[("flash", "json:dumps", override_first)])
    over = make_plugin("fover", attention_backend=[("flash", "json:loads", not override_first)])
    installed(FakeEP("base", base), FakeEP("over", over))
    m = load_plugins()
    winner = "base" if override_first else "over"
    loser = "over" if override_first else "base"
    assert m.get("attention_backend", "flash").plugin == winner
    desc = {d["name"]: d for d in m.describe()}
    assert desc[winner]["registrations"] == {"attention_backend": ["flash"]}
    assert desc[loser]["registrations"] == {} and desc[loser]["overridden"] == {"attention_backend": ["flash"]}
    json.dumps(m.describe())
    table = m.format_table()
    assert f"flash  {winner}" in table and f"(overrides {loser})" in table
    assert "flash [overridden]" in table


def test_both_override_is_an_error(installed):
    installed(
        FakeEP("p", make_plugin("fp", model=[("M", "json:dumps", True)])),
        FakeEP("q", make_plugin("fq", model=[("M", "json:loads", True)])),
    )
    with pytest.raises(PluginError, match="both pass override=True"):
        load_plugins()


def test_lazy_target_not_imported_until_resolve(installed):
    installed(FakeEP("lazy", make_plugin("fl", grammar_backend=[
        ("ghost", "core_test_no_such_pkg.backend:Backend"), ("js", "json:JSONDecoder"),
        ("fake", "tests.test_plugins:FakeGrammarBackend"),
    ]), dist="lazy-dist"))
    m = load_plugins("lazy")  # succeeds: nothing imported yet
    assert "core_test_no_such_pkg" not in sys.modules
    with pytest.raises(PluginError, match=r"core_test_no_such_pkg.backend:Backend.*'lazy'.*lazy-dist") as ei:
        m.resolve("grammar_backend", "ghost")
    assert isinstance(ei.value.__cause__, ImportError)
    assert m.resolve("grammar_backend", "fake") is FakeGrammarBackend
    assert m.resolve("grammar_backend", "fake") is FakeGrammarBackend  # cached
    # a lazy target that turns out to be the wrong type is reported with its plugin and hook
    with pytest.raises(PluginError, match=r"'lazy' \(dist lazy-dist 1.0\) in register_grammar_backends.*"
                                          r"lacking compile, allocate_bitmask, apply_bitmask"):
        m.resolve("grammar_backend", "js")


class FakeGrammarBackend:
    def compile(self, kind, spec): ...
    def allocate_bitmask(self, batch_size): ...
    def apply_bitmask(self, logits, bitmask): ...


class NotABackend:
    def prepare(self, batch): ...  # no forward


def test_registered_class_of_the_wrong_type_is_refused(installed):
    installed(FakeEP("wt", make_plugin("fwt", attention_backend=[("half", NotABackend)]), dist="wt-dist"))
    with pytest.raises(PluginError, match=r"plugin 'wt' \(dist wt-dist\) in register_attention_backends: "
                                          r"target for attention_backend 'half' .* lacks forward"):
        load_plugins("wt")
    assert "lacks forward" in load_plugins().plugins[0].error  # auto-discovered: skipped
    with pytest.raises(PluginError, match="lacks forward"):
        load_plugins(strict=True)


class StreamingOnlyToolParser:  # a ToolParser from before flush() joined the contract
    def parse(self, text, tools): ...
    def parse_streaming(self, delta, tools): ...


class LogitlessModel:
    def forward(self, batch): ...
    def load_weights(self, weights): ...


def test_required_methods_are_the_protocol_members():
    """Derived from core.interfaces, not a hand-kept list: members added to a Protocol (flush,
    compute_logits) are required; methods documented as optional are not."""
    import core.interfaces as api

    assert plugins.REQUIRED_METHODS["tool_parser"] == ("parse", "parse_streaming", "flush")
    assert plugins.REQUIRED_METHODS["reasoning_parser"] == ("parse", "parse_streaming", "flush")
    assert plugins.REQUIRED_METHODS["model"] == ("forward", "compute_logits", "load_weights")
    assert set(plugins.INTERFACES) == set(EXTENSION_KINDS)
    for kind, proto in plugins.INTERFACES.items():
        declared = {n for n, v in vars(proto).items() if callable(v) and not n.startswith("_")}
        assert set(plugins.REQUIRED_METHODS[kind]) == declared, kind
    assert "structural_tag" not in plugins.REQUIRED_METHODS["tool_parser"]  # optional, looked up with getattr
    assert "configure" not in plugins.REQUIRED_METHODS["reasoning_parser"]

    class Extended(api.ToolParser, typing.Protocol):  # a derived protocol inherits its bases' members
        def reset(self) -> None: ...

    assert plugins.protocol_methods(Extended) == ("parse", "parse_streaming", "flush", "reset")


@pytest.mark.parametrize("kind,target,missing", [("tool_parser", StreamingOnlyToolParser, "flush"),
                                                 ("model", LogitlessModel, "compute_logits")])
def test_class_missing_a_protocol_member_is_refused_naming_it(installed, kind, target, missing):
    installed(FakeEP("old", make_plugin("fold", **{kind: [("old", target)]}), dist="old-dist"))
    with pytest.raises(PluginError, match=rf"plugin 'old' \(dist old-dist\) in {EXTENSION_KINDS[kind]}: "
                                          rf"target for {kind} 'old' .* lacks {missing} \(see docs"):
        load_plugins("old")


def test_callable_target_returned_as_is(installed):
    def factory():
        return "x"

    m = load_plugins(extra_modules=[("local", make_plugin("floc", reasoning_parser=[("think", factory)]))])
    assert m.resolve("reasoning_parser", "think") is factory
    assert m.get("reasoning_parser", "think").distribution == "<local>"


def test_unknown_name_lists_registered(installed):
    three(installed)
    m = load_plugins()
    with pytest.raises(UnknownNameError) as ei:
        m.get("attention_backend", "x")
    assert str(ei.value).startswith("unknown attention_backend 'x'; registered: fa, fb (from plugins a, b)")
    assert isinstance(ei.value, LookupError)
    with pytest.raises(UnknownNameError, match="registered: none"):
        m.get("quant_method", "fp8")
    with pytest.raises(UnknownNameError, match="unknown extension kind"):
        m.names("nonsense")


@pytest.mark.parametrize("declared,ok", [
    ("1", True), ("1.7", True), (1, True), ("2", False), ("0.9", False),
    (">=1.0,<2", True), ("~=1.0", True), ("==1.*", True), (">=1.11", True), (">=1.12", False), (">=2,<3", False),
    ("<1", False),
    ("not a version", False),
])
def test_api_version(installed, declared, ok):
    installed(FakeEP("v", make_plugin("fv", api=declared, model=[("M", "json:dumps")]), dist="vdist"))
    if ok:
        assert load_plugins("v").plugins[0].api_version == str(declared)
        return
    with pytest.raises(PluginError, match=rf"plugin 'v' \(dist vdist\) targets core plugin API {declared}, "
                                          rf"this core provides {re.escape(PLUGIN_API_VERSION)}"):
        load_plugins("v")
    skipped = load_plugins().plugins[0]
    assert "targets core plugin API" in skipped.error and load_plugins().names("model") == []


def test_duplicate_entry_points_deduplicated(installed):
    mod = make_plugin("fdup", model=[("M", "json:dumps")])
    first, second = FakeEP("dup", mod, value="pkg.dup"), FakeEP("dup", mod, value="pkg.dup")
    installed(first, second)
    m = load_plugins()
    assert [p.name for p in m.plugins] == ["dup"] and first.loads + second.loads == 1
    assert m.names("model") == ["M"]


def test_same_plugin_name_from_two_distributions(installed):
    installed(FakeEP("x", value="a.x", dist="dist-a"), FakeEP("x", value="b.x", dist="dist-b"))
    with pytest.raises(PluginError, match="'x' is provided twice.*dist-a.*dist-b"):
        load_plugins()


def test_extra_modules_always_loaded_and_lifecycle_hooks(installed):
    three(installed)
    seen = []
    mod = types.ModuleType("life")

    @hookimpl
    def on_startup(engine):
        seen.append(engine)

    mod.on_startup = on_startup
    m = load_plugins("a", extra_modules=[("life", mod)])
    assert [p.name for p in m.plugins] == ["a", "life"]
    m.pm.hook.on_startup(engine="E")
    assert seen == ["E"]


def test_typo_in_hook_name_is_refused(installed):
    mod = types.ModuleType("typo")

    @hookimpl
    def register_model(register):  # missing "s"
        pass

    mod.register_model = register_model
    installed(FakeEP("typo", mod))
    with pytest.raises(PluginError, match="unknown hook 'register_model'"):
        load_plugins("typo")


def test_register_after_hook_returned_is_refused(installed):
    kept = []
    mod = types.ModuleType("late")

    @hookimpl
    def register_models(register):
        kept.append(register)

    mod.register_models = register_models
    load_plugins(extra_modules=[("late", mod)])
    with pytest.raises(PluginError, match="after the hook returned"):
        kept[0]("M", "json:dumps")


def test_real_entry_points_load(monkeypatch):
    monkeypatch.delenv(ALLOW_ENV, raising=False)
    m = load_plugins()
    assert isinstance(m, PluginManager)
    assert all(p.name for p in m.plugins)
    json.dumps(m.describe())
    assert isinstance(m.format_table(), str)
