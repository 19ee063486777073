"""Plugin discovery and the registries built from it, once, at start-up.

Every variable part of core (attention backends, quant methods, models, parsers,
grammar backends) is looked up by name in a registry built here from the
``core.plugins`` entry-point group. Built-ins come through the same group, so they can
be listed, left out with the allowlist and overridden like any third-party plugin.
Each name records which plugin and distribution registered it, so a conflict, an
unknown name or a broken import is reported with something a user can act on.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata
import os
import traceback
import typing
from typing import Any, Callable, Iterable, Sequence

import attrs
import pluggy
import structlog

from core import hookspecs, interfaces
from core.errors import PluginError, UnknownNameError
from core.interfaces import EXTENSION_KINDS, PLUGIN_API_VERSION

ENTRY_POINT_GROUP = "core.plugins"
ALLOW_ENV = "CORE_PLUGINS"  # comma-separated allowlist, same meaning as --plugins
LOCAL_DIST = "<local>"  # distribution recorded for plugins passed as extra_modules


@attrs.define(frozen=True)
class Registration:
    """One name registered by one plugin; a string ``target`` stays unimported until resolved."""

    kind: str
    name: str
    target: str | Callable[..., Any]
    plugin: str
    distribution: str
    version: str
    override: bool = False


@attrs.define
class PluginInfo:
    """What `core plugins` shows about one plugin, including why it was skipped."""

    name: str
    distribution: str
    version: str
    module: str
    registrations: list[Registration] = attrs.Factory(list)
    error: str | None = None  # traceback text when it failed and was skipped
    api_version: str | None = None  # the module's CORE_PLUGIN_API, if declared

    @property
    def label(self) -> str:
        return f"plugin '{self.name}' (dist {self.distribution})"


def _entry_points() -> Iterable[Any]:
    """Seam for tests: the installed entry points of our group."""
    return importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)


class PluginManager:
    """The loaded plugins, the pluggy manager for lifecycle hooks, and the frozen registries."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.plugins: list[PluginInfo] = []
        self.registries: dict[str, dict[str, Registration]] = {kind: {} for kind in EXTENSION_KINDS}
        self.overridden: dict[tuple[str, str], list[Registration]] = {}  # (kind, name) -> losers
        self.left_out: list[str] = []  # installed plugins the allowlist (--plugins) did not load
        self._resolved: dict[tuple[str, str], Any] = {}

    # ------------------------------------------------------------------ lookups

    def _table(self, kind: str) -> dict[str, Registration]:
        if kind not in self.registries:
            raise UnknownNameError(f"unknown extension kind '{kind}'; kinds: {', '.join(self.registries)}")
        return self.registries[kind]

    def names(self, kind: str) -> list[str]:
        return sorted(self._table(kind))

    def get(self, kind: str, name: str) -> Registration:
        """The winning registration; an unknown name lists what is available and what failed."""
        table = self._table(kind)
        if name in table:
            return table[name]
        names = sorted(table)
        providers = sorted({r.plugin for r in table.values()})
        msg = f"unknown {kind} '{name}'; registered: {', '.join(names) or 'none'}"
        if providers:
            msg += f" (from plugins {', '.join(providers)})"
        if close := difflib.get_close_matches(name, names, n=1):
            msg += f"; did you mean '{close[0]}'?"
        if failed := [p.name for p in self.plugins if p.error]:
            msg += f"; plugins that failed to load: {', '.join(failed)} (see `core plugins`)"
        if name in self.left_out:
            msg += f"; the installed plugin '{name}' provides it: add it to --plugins"
        elif self.left_out:
            msg += f"; --plugins left out the installed plugins {', '.join(self.left_out)} (`core plugins` lists what each provides)"
        raise UnknownNameError(msg)

    def resolve(self, kind: str, name: str) -> Any:
        """Import a ``"pkg.mod:attr"`` target on first use, so unused plugins cost nothing."""
        reg = self.get(kind, name)
        key = (kind, name)
        if key not in self._resolved:
            if callable(reg.target):
                self._resolved[key] = reg.target
            else:
                module, _, attr = reg.target.partition(":")
                try:
                    value: Any = importlib.import_module(module)
                    for part in attr.split("."):
                        value = getattr(value, part)
                except Exception as exc:
                    raise PluginError(
                        f"cannot load {kind} '{name}': target '{reg.target}' registered by plugin "
                        f"'{reg.plugin}' (dist {reg.distribution} {reg.version}) failed to import: "
                        f"{type(exc).__name__}: {exc}"
                    ) from exc
                missing = _missing_methods(kind, value)
                if missing:
                    raise PluginError(
                        f"{kind} '{name}': target '{reg.target}' registered by plugin '{reg.plugin}' "
                        f"(dist {reg.distribution} {reg.version}) in {EXTENSION_KINDS[kind]} is a "
                        f"{type(value).__name__} lacking {', '.join(missing)} (see docs/interfaces.md)"
                    )
                self._resolved[key] = value
        return self._resolved[key]

    def choose_attention_backend(self, device: Any, model_config: Any = None) -> tuple[str, str, str]:
        """(backend name, reason, plugin that chose) from the ``choose_attention_backend`` hook.

        The implementations are asked in pluggy's call order until one answers; the answer
        must name a registered backend."""
        available = self.names("attention_backend")
        hook = self.pm.hook.choose_attention_backend
        for impl in reversed(hook.get_hookimpls()):  # pluggy calls the last one first
            answer = impl.function(device=device, model_config=model_config, available=available)
            if answer is None:
                continue
            name, reason = (answer, "") if isinstance(answer, str) else answer
            if name not in available:
                raise PluginError(f"plugin '{impl.plugin_name}' chose attention backend '{name}', which is not "
                                  f"registered (registered: {', '.join(available) or 'none'})")
            return name, reason, impl.plugin_name
        if not available:
            raise PluginError("no attention backend is registered (see `core plugins`)")
        return available[0], "no plugin chose one; the first registered", "core"

    # ------------------------------------------------------------------ loading

    def _add(self, info: PluginInfo, load: Callable[[], object], *, named: bool, strict: bool) -> None:
        """Load one plugin and collect its registrations; a failure stays contained to it."""
        self.plugins.append(info)
        stage, obj, registered = f"import of '{info.module}'", None, False
        regs: list[Registration] = []
        try:
            obj = load()
            if (declared := getattr(obj, "CORE_PLUGIN_API", None)) is not None:
                info.api_version = str(declared)
                if not api_compatible(info.api_version):
                    raise PluginError(
                        f"{info.label} targets core plugin API {info.api_version}, "
                        f"this core provides {PLUGIN_API_VERSION}"
                    )
            stage = "registration with pluggy"
            self.pm.register(obj, name=info.name)
            registered = True
            for caller in self.pm.get_hookcallers(obj) or []:
                optional = all(i.optionalhook for i in caller.get_hookimpls() if i.plugin is obj)
                if not caller.has_spec() and not optional:  # a typo such as register_model would be silent
                    raise PluginError(f"{info.label} implements unknown hook '{caller.name}'")
            for kind, hook in EXTENSION_KINDS.items():
                stage = hook
                for impl in getattr(self.pm.hook, hook).get_hookimpls():
                    if impl.plugin is not obj:
                        continue
                    if impl.hookwrapper or impl.wrapper:
                        raise PluginError(f"{info.label} in {hook}: register hooks cannot be wrappers")
                    register, close = _register_callback(info, kind, hook, regs)
                    impl.function(**{arg: register for arg in impl.argnames})
                    close()
        except Exception as exc:
            if registered:
                self.pm.unregister(obj)  # a skipped plugin must not see lifecycle hooks either
            own = isinstance(exc, PluginError) and str(exc).startswith(info.label)
            err = exc if own else PluginError(f"{info.label} failed in {stage}: {type(exc).__name__}: {exc}")
            if named or strict:
                raise err from (None if own else exc)
            info.error = traceback.format_exc()
            structlog.get_logger("core.plugins").warning(
                "plugin_skipped", plugin=info.name, distribution=info.distribution,
                version=info.version, error=str(err), traceback=info.error,
            )
            return
        info.registrations = regs
        for reg in regs:
            self._merge(reg)

    def _merge(self, reg: Registration) -> None:
        """Two plugins may share a name only if exactly one says override=True; it wins."""
        table = self.registries[reg.kind]
        prev = table.get(reg.name)
        if prev is None:
            table[reg.name] = reg
            return
        if prev.override == reg.override:
            hint = "both pass override=True" if reg.override else "one must pass override=True to replace the other"
            raise PluginError(
                f"{reg.kind} '{reg.name}' is registered by plugin '{prev.plugin}' (dist {prev.distribution}) "
                f"and by plugin '{reg.plugin}' (dist {reg.distribution}); {hint}"
            )
        winner, loser = (reg, prev) if reg.override else (prev, reg)
        table[reg.name] = winner
        self.overridden.setdefault((reg.kind, reg.name), []).append(loser)

    # ------------------------------------------------------------------ listing

    def _by_kind(self, regs: Iterable[Registration]) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for reg in regs:
            out.setdefault(reg.kind, []).append(reg.name)
        return out

    def _won(self, reg: Registration) -> bool:
        return self.registries[reg.kind].get(reg.name) is reg

    def describe(self) -> list[dict]:
        """JSON-able listing for `core plugins --json`; ``registrations`` holds the names each plugin provides."""
        return [
            {
                "name": p.name, "distribution": p.distribution, "version": p.version, "module": p.module,
                "api_version": p.api_version,
                "registrations": self._by_kind(r for r in p.registrations if self._won(r)),
                "overridden": self._by_kind(r for r in p.registrations if not self._won(r)),
                "error": p.error,
            }
            for p in self.plugins
        ]

    def format_table(self) -> str:
        """Human listing for `core plugins`: the plugins, then who provides each name."""
        rows = [("PLUGIN", "DISTRIBUTION", "VERSION", "REGISTERS")]
        for p in self.plugins:
            if p.error:
                what = "FAILED: " + p.error.strip().splitlines()[-1]
            else:
                names = self._by_kind(r if self._won(r) else attrs.evolve(r, name=f"{r.name} [overridden]")
                                      for r in p.registrations)
                what = "; ".join(f"{kind}: {', '.join(ns)}" for kind, ns in names.items()) or "-"
            rows.append((p.name, p.distribution, p.version, what))
        lines = [f"core plugin API {PLUGIN_API_VERSION}", ""] + _columns(rows) + [""]
        for kind, table in self.registries.items():
            lines.append(f"{kind}:" if table else f"{kind}: (none)")
            sub = []
            for name in sorted(table):
                reg = table[name]
                losers = self.overridden.get((kind, name), [])
                note = f"(overrides {', '.join(l.plugin for l in losers)})" if losers else ""
                if kind == "quant_method":
                    note = " ".join(filter(None, (self._devices(name), note)))
                sub.append((f"  {name}", reg.plugin, reg.distribution, note))
            lines.extend(_columns(sub))
        return "\n".join(lines)

    def _devices(self, name: str) -> str:
        """What a quant method declares in its optional ``devices`` (resolving its target)."""
        try:
            devices = getattr(self.resolve("quant_method", name), "devices", None)
        except Exception:
            return "devices: ? (its target failed to import)"
        return f"devices: {', '.join(devices)}" if devices else ""


def _columns(rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))] if rows else []
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


# The interface (a Protocol in core/interfaces.py) a registered class of each kind implements.
INTERFACES: dict[str, type] = {
    "attention_backend": interfaces.AttentionBackend,
    "quant_method": interfaces.QuantMethod,
    "model": interfaces.CausalLM,
    "tool_parser": interfaces.ToolParser,
    "reasoning_parser": interfaces.ReasoningParser,
    "grammar_backend": interfaces.GrammarBackend,
    "speculative_algorithm": interfaces.Drafter,
    "hicache_storage_backend": interfaces.HiCacheStorage,
    "multimodal_processor": interfaces.MultimodalProcessor,
}


def protocol_methods(protocol: type) -> tuple[str, ...]:
    """The public methods a Protocol declares (with its Protocol bases'), in definition order.
    Methods its docstring calls optional are not defined in the class body, so they are not here."""
    names: list[str] = []
    for cls in reversed(protocol.__mro__):
        if cls is typing.Protocol or not cls.__dict__.get("_is_protocol", False):
            continue
        names += [n for n, v in vars(cls).items() if not n.startswith("_") and callable(v) and n not in names]
    return tuple(names)


# What a registered class must define, per kind (checked for classes only: a factory
# function is trusted until it is called).
REQUIRED_METHODS: dict[str, tuple[str, ...]] = {kind: protocol_methods(p) for kind, p in INTERFACES.items()}
# A kind's other interface a class may implement instead (a drafter with a model of its own).
ALTERNATIVE_METHODS: dict[str, tuple[str, ...]] = {"speculative_algorithm": protocol_methods(interfaces.ModelDrafter)}


def _missing_methods(kind: str, target: Any) -> list[str]:
    """The interface methods a registered class lacks; a non-callable resolved target lacks everything."""
    if not callable(target):
        return ["__call__"]
    if not isinstance(target, type):
        return []
    missing = [m for m in REQUIRED_METHODS.get(kind, ()) if not callable(getattr(target, m, None))]
    if missing and (other := ALTERNATIVE_METHODS.get(kind)) and all(callable(getattr(target, m, None)) for m in other):
        return []
    return missing


def api_compatible(declared: str, provided: str = PLUGIN_API_VERSION) -> bool:
    """Whether a plugin's ``CORE_PLUGIN_API`` accepts this core's plugin API version.

    A bare version (``"1"``, ``"1.2"``) names the major version the plugin was written for
    and matches any ``provided`` with that major. Anything else is a PEP 440 specifier set
    (``">=1.0,<2"``, ``"~=1.0"``, ``"==1.*"``) that ``provided`` must satisfy.
    """
    text = str(declared).strip()
    if text[:1].isdigit() and all(part.isdigit() for part in text.split(".")):
        return text.split(".")[0] == provided.split(".")[0]
    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    try:
        spec = SpecifierSet(text)
    except InvalidSpecifier:
        return False
    return spec.contains(provided, prereleases=True)


def _register_callback(
    info: PluginInfo, kind: str, hook: str, out: list[Registration]
) -> tuple[Callable[..., None], Callable[[], None]]:
    """A ``register`` bound to one plugin and hook, so every name records its provenance."""
    closed = False

    def register(name: str, target: str | Callable[..., Any], *, override: bool = False) -> None:
        where = f"{info.label} in {hook}"
        if closed:
            raise PluginError(f"{where}: register() called after the hook returned")
        if not isinstance(name, str) or not name:
            raise PluginError(f"{where}: name must be a non-empty str, got {name!r}")
        if isinstance(target, str):
            module, _, attr = target.partition(":")
            valid = bool(module and attr)
        else:
            valid = callable(target)
        if not valid:
            raise PluginError(
                f"{where}: target for '{name}' must be a 'module:attr' string or a callable, got {target!r}"
            )
        if not isinstance(target, str) and (missing := _missing_methods(kind, target)):
            raise PluginError(
                f"{where}: target for {kind} '{name}' is {target!r}, which lacks {', '.join(missing)} "
                f"(see docs/interfaces.md)"
            )
        if any(r.kind == kind and r.name == name for r in out):
            raise PluginError(f"{where}: {kind} '{name}' registered twice by the same plugin")
        out.append(Registration(kind, name, target, info.name, info.distribution, info.version, bool(override)))

    def close() -> None:
        nonlocal closed
        closed = True

    return register, close


def _parse_allow(allow: Sequence[str] | str | None) -> tuple[list[str] | None, str]:
    source = "--plugins"
    if allow is None:
        if ALLOW_ENV not in os.environ:
            return None, source
        allow, source = os.environ[ALLOW_ENV], ALLOW_ENV
    items = allow.split(",") if isinstance(allow, str) else allow
    return [n.strip() for n in items if n.strip()], source


def load_plugins(
    allow: Sequence[str] | str | None = None,
    *,
    strict: bool = False,
    extra_modules: Sequence[tuple[str, object]] = (),
) -> PluginManager:
    """Discover, load and register plugins; call once at start-up, before serving.

    ``allow`` (or ``$CORE_PLUGINS``) restricts loading to the named plugins, and a named
    plugin that is missing or broken stops start-up. Auto-discovered plugins that fail
    are logged and skipped (recorded in ``PluginInfo.error``) unless ``strict``.
    ``extra_modules`` are (name, module) pairs registered directly, always loaded.
    """
    allowed, source = _parse_allow(allow)
    extra_names = {name for name, _ in extra_modules}
    found: dict[str, list[Any]] = {}
    for ep in _entry_points():
        group = found.setdefault(ep.name, [])
        if all(other.value != ep.value for other in group):  # the same install seen twice
            group.append(ep)
    if allowed is not None:
        if missing := [n for n in allowed if n not in found and n not in extra_names]:
            raise PluginError(
                f"plugin{'s' if len(missing) > 1 else ''} {', '.join(repr(n) for n in missing)} named in "
                f"{source} {'are' if len(missing) > 1 else 'is'} not installed; "
                f"installed plugins: {', '.join(sorted(found)) or 'none'}"
            )
    manager = PluginManager()
    for name, eps in found.items():
        if allowed is not None and name not in allowed:
            manager.left_out.append(name)
            continue
        dists = [(ep.dist.name, ep.dist.version) if ep.dist else ("unknown", "unknown") for ep in eps]
        if len(eps) > 1:
            both = " and ".join(f"'{ep.value}' (dist {d})" for ep, (d, _) in zip(eps, dists))
            raise PluginError(f"plugin name '{name}' is provided twice: {both}; uninstall one")
        info = PluginInfo(name, dists[0][0], dists[0][1], eps[0].value)
        manager._add(info, eps[0].load, named=allowed is not None, strict=strict)
    for name, obj in extra_modules:
        info = PluginInfo(name, LOCAL_DIST, "unknown", getattr(obj, "__name__", type(obj).__name__))
        manager._add(info, lambda obj=obj: obj, named=True, strict=strict)
    return manager
