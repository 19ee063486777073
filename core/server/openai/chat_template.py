"""``--chat-template`` files that are not Jinja, and a sanity check of those that are.

SGLang's JSON conversation template (``--chat-template my_template.json``; keys ``name``,
``system``, ``user``, ``assistant``, ``sep_style``, ``sep``, ``stop_str``, optional
``system_message``) is turned into an equivalent Jinja template at load, so chats, /tokenize and
/tokenizer_info keep one rendering path, and its ``stop_str`` becomes stop strings of every chat
request. The prompt follows SGLang's conversation rules: the last system message replaces
``system_message``; user and assistant turns are framed by their role prefixes; the system
prefix is ``system + "\\n" + system_message``; an empty message renders as an open turn. Hugging
Face's ``chat_template.json`` (``{"chat_template": "<jinja>"}``) is read too. A sep_style not
implemented here is refused with a message naming the file, the key and what is supported —
never read as Jinja, which used to make every prompt the JSON text itself.
"""

from __future__ import annotations

import json
from typing import Any

import attrs
import structlog

from core.errors import CoreError

log = structlog.get_logger("core.server.openai.chat_template")

_SEP2 = "__sep2__"  # placeholder in a style's turn expression: the separator after an assistant turn

# sep_style -> (prompt head, a finished turn, an open turn): Jinja expressions over ``system_prompt``,
# ``system_message``, ``role``, ``msg``, ``i`` (the turn's index), ``sep`` and ``__sep2__`` (sep for
# even turns, sep2 for odd ones). ``system_prompt`` is never empty: it is ``system ~ "\n" ~ ...``.
_LLAMA3 = ('"<|start_header_id|>" ~ role ~ "<|end_header_id|>\\n\\n"', '"<|eot_id|>"')
_LLAMA4 = ('"<|header_start|>" ~ role ~ "<|header_end|>\\n\\n"', '"<|eot|>"')
STYLES: dict[str, tuple[str, str, str]] = {
    "ADD_COLON_SINGLE": ('system_prompt ~ sep', 'role ~ ": " ~ msg ~ sep', 'role ~ ":"'),
    "ADD_COLON_SPACE_SINGLE": ('system_prompt ~ sep', 'role ~ ": " ~ msg ~ sep', 'role ~ ": "'),
    "ADD_COLON_TWO": ('system_prompt ~ sep', 'role ~ ": " ~ msg ~ __sep2__', 'role ~ ":"'),
    "NO_COLON_SINGLE": ('system_prompt', 'role ~ msg ~ sep', 'role'),
    "NO_COLON_TWO": ('system_prompt', 'role ~ msg ~ __sep2__', 'role'),
    "ADD_NEW_LINE_SINGLE": ('(system_prompt ~ sep) if system_message else ""', 'role ~ "\\n" ~ msg ~ sep', 'role ~ "\\n"'),
    "CHATML": ('system_prompt ~ sep ~ "\\n"', 'role ~ "\\n" ~ msg ~ sep ~ "\\n"', 'role ~ "\\n"'),
    "LLAMA3": ('system_prompt if system_message else ""', f'{_LLAMA3[0]} ~ (msg | trim) ~ {_LLAMA3[1]}', _LLAMA3[0]),
    "LLAMA4": ('system_prompt if system_message else ""', f'{_LLAMA4[0]} ~ (msg | trim) ~ {_LLAMA4[1]}', _LLAMA4[0]),
    # the role tag goes by position (user, assistant, user, ...); the first user turn has none
    "LLAMA2": ('system_prompt if system_message else "[INST] "',
               '(msg ~ " ") if i == 0 else (roles[i % 2] ~ " " ~ msg ~ __sep2__)', 'roles[i % 2]'),
    "FALCON_CHAT": ('(system_prompt ~ sep) if system_message else ""', 'role ~ ": " ~ msg ~ sep', 'role ~ ":"'),
    "ROBIN": ('system_prompt ~ sep', 'role ~ ":\\n" ~ msg ~ sep', 'role ~ ":\\n"'),
    "MPT": ('system_prompt ~ sep', 'role ~ msg ~ sep', 'role'),
    "CHATGLM3": ('system_prompt if system_message else ""', 'role ~ "\\n" ~ msg', 'role'),
    "DEEPSEEK_CHAT": ('system_prompt', 'role ~ ": " ~ msg ~ __sep2__', 'role ~ ":"'),
}
REQUIRED_KEYS = ("name", "system", "user", "assistant", "sep_style", "stop_str")


@attrs.frozen
class ChatTemplate:
    """A loaded ``--chat-template``: the Jinja source and the stop strings it brings."""

    jinja: str
    stop: tuple[str, ...] = ()


def _lit(s: str) -> str:
    """``s`` as a Jinja string literal (Jinja unescapes literals with Python's unicode-escape)."""
    return '"' + s.encode("unicode_escape").decode("ascii").replace('"', '\\"') + '"'


def _text(data: dict, key: str, where: str, default: str | None = None) -> str:
    value = data.get(key, default)
    if not isinstance(value, str):
        raise CoreError(f"--chat-template {where}: key {key!r} must be a string, got {type(value).__name__}")
    return value


def sglang_to_jinja(data: dict, where: str) -> ChatTemplate:
    """SGLang's JSON conversation template as an equivalent Jinja template plus its stop strings;
    ``where`` (the file) names it in errors."""
    missing = [k for k in REQUIRED_KEYS if k not in data]
    if missing:
        raise CoreError(f"--chat-template {where}: missing key(s) {', '.join(map(repr, missing))} of SGLang's JSON "
                        f"chat template (required: {', '.join(REQUIRED_KEYS)})")
    style = data["sep_style"]
    if style not in STYLES:
        raise CoreError(f"--chat-template {where}: sep_style {style!r} is not supported; supported: "
                        f"{', '.join(STYLES)} (or use a Jinja template file)")
    stop = data["stop_str"]
    stops = [stop] if isinstance(stop, str) else [] if stop is None else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise CoreError(f"--chat-template {where}: key 'stop_str' must be a string, a list of strings or null")
    user, assistant = _text(data, "user", where), _text(data, "assistant", where)
    head, done, open_turn = STYLES[style]
    if "sep2" in data:  # not read by SGLang's loader; lets the two-separator styles render multi-turn chats
        sep2 = _lit(_text(data, "sep2", where))
    else:
        sep2 = ('raise_exception("--chat-template: sep_style ' + style +
                ' needs the key \'sep2\' after an assistant turn, which the JSON template does not set")')
    done = done.replace(_SEP2, f"(sep if i % 2 == 0 else {sep2})")
    jinja = "".join((
        "{#- SGLang JSON chat template ", json.dumps(str(data["name"]))[1:-1].replace("#}", "# }"), " (", style, ") -#}\n",
        "{%- set roles = [", _lit(user), ", ", _lit(assistant), "] -%}\n",
        "{%- set sep = ", _lit(_text(data, "sep", where, "\n")), " -%}\n",
        "{%- set ns = namespace(system_message=", _lit(_text(data, "system_message", where, "")), ", turns=[]) -%}\n",
        "{%- for m in messages -%}\n",
        "  {%- if m.role == 'system' -%}{%- set ns.system_message = m.content -%}\n",
        "  {%- elif m.role == 'user' -%}{%- set ns.turns = ns.turns + [(roles[0], m.content)] -%}\n",
        "  {%- elif m.role == 'assistant' -%}{%- set ns.turns = ns.turns + [(roles[1], m.content)] -%}\n",
        "  {%- else -%}{{- raise_exception('this SGLang JSON chat template has no ' ~ m.role ~ ",
        "' role: only system, user and assistant messages') -}}\n",
        "  {%- endif -%}\n",
        "{%- endfor -%}\n",
        "{%- if add_generation_prompt -%}{%- set ns.turns = ns.turns + [(roles[1], '')] -%}{%- endif -%}\n",
        "{%- set system_message = ns.system_message -%}\n",
        "{%- set system_prompt = ", _lit(_text(data, "system", where)), " ~ '\\n' ~ system_message -%}\n",
        "{{- ", head, " -}}\n",
        "{%- for role, msg in ns.turns -%}{%- set i = loop.index0 -%}\n",
        "  {%- if msg -%}{{- ", done, " -}}{%- else -%}{{- ", open_turn, " -}}{%- endif -%}\n",
        "{%- endfor -%}\n",
    ))
    log.info("chat_template.sglang_json", file=where, style=style, stop=stops)
    return ChatTemplate(jinja, tuple(stops))


def from_json_file(text: str, where: str) -> ChatTemplate:
    """A ``.json`` ``--chat-template``: SGLang's conversation template, or Hugging Face's
    ``{"chat_template": "<jinja>"}``; anything else is refused."""
    try:
        data = json.loads(text)
    except ValueError as e:
        raise CoreError(f"--chat-template {where}: not valid JSON ({e}); a .json chat template is SGLang's "
                        "format (name, system, user, assistant, sep_style, sep, stop_str)") from None
    if not isinstance(data, dict):
        raise CoreError(f"--chat-template {where}: a JSON chat template must be an object")
    if "sep_style" not in data and isinstance(data.get("chat_template"), str):
        return ChatTemplate(data["chat_template"])
    return sglang_to_jinja(data, where)


PROBE_TEXT = "core-chat-template-probe-7f3a"


def check_renders_messages(template: str, where: str) -> None:
    """Refuse a Jinja template that drops the messages: a one-user-message chat is rendered
    and must contain the message. A template that cannot render that chat (it wants a system
    message first, a tokenizer-specific variable, ...) is left for requests to report."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        text = _compile_jinja_template(template).render(
            messages=[{"role": "user", "content": PROBE_TEXT}], add_generation_prompt=True,
            bos_token="", eos_token="", pad_token="", unk_token="", tools=None, documents=None)
    except Exception as e:  # noqa: BLE001 - the probe only refuses what it proved wrong
        log.debug("chat_template.probe_skipped", template=where, error=str(e))
        return
    if PROBE_TEXT not in text:
        raise CoreError(f"--chat-template {where}: the template drops the messages (a user message's text does "
                        f"not appear in its output {text[:80]!r}); is it a chat template?")


# ----------------------------------------------------------------------------- serve flags
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")  # the Responses API's
# chat_template_kwargs keys the server sets from the request itself (a 400 in a request, refused as a default)
RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "messages", "tools", "documents", "chat_template",
                                      "add_generation_prompt", "continue_final_message", "tokenize", "return_dict",
                                      "return_tensors", "padding", "truncation"})


def check_default_template_kwargs(kwargs: dict[str, Any] | None) -> None:
    """``--default-chat-template-kwargs``: refuse at start-up what would make every chat request a 400."""
    kwargs = kwargs or {}
    if reserved := sorted(kwargs.keys() & RESERVED_TEMPLATE_KWARGS - {"add_generation_prompt", "continue_final_message"}):
        raise CoreError(f"--default-chat-template-kwargs: {reserved[0]} is set by the server from each request "
                        "(messages, tools, documents; the template is --chat-template); remove it")
    if kwargs.get("add_generation_prompt", True) is not True:
        raise CoreError("--default-chat-template-kwargs: add_generation_prompt false is not supported: the prompt "
                        "always ends where the assistant's answer starts")
    if (effort := kwargs.get("reasoning_effort")) is not None and effort not in REASONING_EFFORTS:
        raise CoreError(f"--default-chat-template-kwargs: reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, "
                        f"got {effort!r}")


def pick_named_template(tok: Any, name: str | None, overridden: bool) -> None:
    """``--hf-chat-template-name``: a tokenizer with several named chat templates (a dict; a list in
    tokenizer_config.json) keeps the one named, else a name it lacks stops start-up listing its names.
    Without a name, one with a ``default`` is left to choose per request (``tool_use`` with tools),
    one without renders with its first, as SGLang's. The name has no effect (a warning) on a single
    template or under ``--chat-template`` (``overridden``), as in SGLang."""
    templates = getattr(tok, "chat_template", None) if tok is not None else None
    if name and (overridden or not isinstance(templates, dict)):
        log.warning("chat_template.name_unused", hf_chat_template_name=name,
                    why="--chat-template replaces the tokenizer's" if overridden else "the tokenizer has no named templates")
        return
    if not isinstance(templates, dict) or overridden or not templates:
        return
    if name and name not in templates:
        raise CoreError(f"--hf-chat-template-name {name!r}: the tokenizer has no such chat template; its templates: "
                        f"{', '.join(templates)}")
    if name or "default" not in templates:
        name = name or next(iter(templates))
        tok.chat_template = templates[name]
        log.info("chat_template.named", name=name, available=list(templates))
