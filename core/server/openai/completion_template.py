"""Fill-in-the-middle prompts for /v1/completions' ``suffix`` (SGLang's ``--completion-template``).

A code model trained for FIM reads the code before and after the cursor between its own marker
tokens and generates the middle. ``--completion-template`` names the markers: one of SGLang's
built-in names, or a JSON file ``{"name", "fim_begin_token", "fim_middle_token",
"fim_end_token", "fim_position": "MIDDLE" | "END"}`` in SGLang's format. With ``MIDDLE`` the
prompt reads ``begin + prefix + middle + suffix + end``; with ``END``
``begin + prefix + end + suffix + middle`` (the model's generation follows the last marker).
"""

from __future__ import annotations

import json
import os

import attrs

from core.errors import CoreError


@attrs.frozen
class CompletionTemplate:
    name: str
    fim_begin_token: str
    fim_middle_token: str
    fim_end_token: str
    fim_position: str  # "MIDDLE" or "END"

    def prompt(self, prefix: str, suffix: str) -> str:
        """The FIM prompt around the cursor."""
        if self.fim_position == "MIDDLE":
            return f"{self.fim_begin_token}{prefix}{self.fim_middle_token}{suffix}{self.fim_end_token}"
        return f"{self.fim_begin_token}{prefix}{self.fim_end_token}{suffix}{self.fim_middle_token}"


# SGLang's built-in templates (the models' own marker tokens)
BUILTIN = {t.name: t for t in (
    CompletionTemplate("deepseek_coder", "<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>", "MIDDLE"),
    CompletionTemplate("star_coder", "<fim_prefix>", "<fim_middle>", "<fim_suffix>", "END"),
    CompletionTemplate("qwen_coder", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "END"),
)}


def load_completion_template(arg: str | None) -> CompletionTemplate | None:
    """``--completion-template``: a built-in name or a JSON file; CoreError naming the problem."""
    if not arg:
        return None
    if arg in BUILTIN:
        return BUILTIN[arg]
    path = os.path.expanduser(arg)
    if not os.path.isfile(path):
        raise CoreError(f"--completion-template {arg}: neither a built-in template ({', '.join(BUILTIN)}) nor a file")
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
        fields = {a.name: d[a.name] for a in attrs.fields(CompletionTemplate)}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CoreError(f"--completion-template {arg}: not a completion template file ({type(e).__name__}: {e}); it "
                        "needs name, fim_begin_token, fim_middle_token, fim_end_token and fim_position") from None
    if fields["fim_position"] not in ("MIDDLE", "END") or not all(isinstance(v, str) for v in fields.values()):
        raise CoreError(f"--completion-template {arg}: fim_position must be MIDDLE or END and every field a string")
    return CompletionTemplate(**fields)
