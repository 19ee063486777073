"""Reading a peft LoRA adapter folder into host tensors keyed by the layers of our model.

peft names each tensor after the module of the *checkpoint* model it adapts
(``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``); our models pack some of
those modules into one layer (q/k/v into ``qkv_proj``). The same ``packed_modules`` map that
weight loading uses (:func:`core.layers.checkpoint_target`) turns each name into (our layer,
shard), so the pool never needs to know a checkpoint's naming.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, Mapping

import attrs
import torch

from core.errors import CoreError
from core.layers import checkpoint_target

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
EMBEDDING_MODULES = frozenset({"embed_tokens", "lm_head", "wte", "word_embeddings", "embed_in", "embed_out"})

# ``<module>.lora_A.weight`` or, with an adapter-name segment, ``<module>.lora_A.default.weight``
_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>A|B)(?:\.[^.]+)?\.weight$")
_PREFIX = "base_model.model."


class LoRAError(CoreError):
    """An adapter that cannot be loaded or served: the message names the adapter, the problem and the fix."""


@attrs.frozen
class LoRAAdapter:
    """One adapter's weights on the host, in float32, keyed like our model's layers.

    ``weights[(module, shard)] = (A [rank, in], B [out, rank])``: ``module`` is the dotted
    name of a :class:`core.layers.Linear` of our model, ``shard`` the packed part it adapts
    (``"q"`` of ``qkv_proj``) or None for the whole layer. B is *not* scaled: the pool folds
    ``scaling`` in when it copies the adapter into a slot."""

    name: str
    path: str
    rank: int
    scaling: float
    base_model: str | None
    weights: dict[tuple[str, object], tuple[torch.Tensor, torch.Tensor]] = attrs.field(eq=False, repr=False)

    @property
    def modules(self) -> set[str]:
        """The names of our layers this adapter changes."""
        return {m for m, _ in self.weights}


def packed_modules_of(model: torch.nn.Module) -> dict[str, tuple[str, object]]:
    """The model's map of checkpoint module names to (its packed layer, part), keyed by the last
    name component only (what ``read_adapter`` and the pool resolve peft's names through)."""
    return {k: v for k, v in getattr(model, "packed_modules", {}).items() if "." not in k}


def read_adapter(name: str, path: str, packed_modules: Mapping[str, tuple[str, object]]) -> LoRAAdapter:
    """The adapter saved by peft's ``save_pretrained`` in folder ``path``, mapped through the
    model's ``packed_modules``. Raises :class:`LoRAError` for a missing folder or file and for
    every peft feature the pool does not serve (DoRA, biases, ``modules_to_save``, per-module
    ranks, embedding or LM-head targets), rather than serving something else."""
    folder = Path(path)
    if not folder.is_dir():
        raise LoRAError(f"LoRA adapter {name!r}: {path!r} is not a folder; pass the folder peft's save_pretrained wrote")
    config = _read_config(name, folder)
    rank = config.get("r")
    if not isinstance(rank, int) or rank <= 0:
        raise LoRAError(f"LoRA adapter {name!r}: {CONFIG_FILE} has no positive integer 'r' (rank): {rank!r}")
    alpha = config.get("lora_alpha", rank)
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    tensors = _read_tensors(name, folder)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        module, ab = _parse_key(name, key)
        pairs.setdefault(module, {})[ab] = tensor
    weights: dict[tuple[str, object], tuple[torch.Tensor, torch.Tensor]] = {}
    for module, pair in pairs.items():
        if len(pair) != 2:
            have, lacks = ("A", "B") if "A" in pair else ("B", "A")
            raise LoRAError(f"LoRA adapter {name!r}: module {module!r} has lora_{have} but no lora_{lacks}; "
                            "the weights file is incomplete: save the adapter again")
        a, b = pair["A"].float(), pair["B"].float()
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise LoRAError(f"LoRA adapter {name!r}: module {module!r} has lora_A {tuple(a.shape)} and lora_B "
                            f"{tuple(b.shape)}, expected [{rank}, in] and [out, {rank}] for r={rank}")
        target, shard = checkpoint_target(module + ".", packed_modules)
        weights[(target[:-1], shard)] = (a.contiguous(), b.contiguous())
    if not weights:
        raise LoRAError(f"LoRA adapter {name!r}: the weights file in {path!r} holds no lora_A/lora_B tensors")
    return LoRAAdapter(name, str(path), rank, float(scaling), config.get("base_model_name_or_path"), weights)


def _read_config(name: str, folder: Path) -> dict[str, Any]:
    """``adapter_config.json``, refused where it asks for something the pool does not serve."""
    file = folder / CONFIG_FILE
    if not file.is_file():
        raise LoRAError(f"LoRA adapter {name!r}: {folder} has no {CONFIG_FILE}; pass a folder saved by peft")
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise LoRAError(f"LoRA adapter {name!r}: cannot read {file}: {e}") from None
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise LoRAError(f"LoRA adapter {name!r}: peft_type {peft_type!r} is not supported; only LoRA adapters are")
    refusals = [
        (config.get("use_dora"), "use_dora (DoRA)"),
        (config.get("bias", "none") not in (None, "none"), f"bias={config.get('bias')!r}"),
        (config.get("lora_bias"), "lora_bias"),
        (config.get("modules_to_save"), "modules_to_save"),
        (config.get("fan_in_fan_out"), "fan_in_fan_out"),
        (config.get("rank_pattern"), "rank_pattern (per-module ranks)"),
        (config.get("alpha_pattern"), "alpha_pattern (per-module alphas)"),
    ]
    for bad, what in refusals:
        if bad:
            raise LoRAError(f"LoRA adapter {name!r}: {what} is not supported; train the adapter without it "
                            "(or merge it into the base model)")
    targets = config.get("target_modules") or []
    if not isinstance(targets, str) and (embedding := sorted(EMBEDDING_MODULES.intersection(targets))):
        raise LoRAError(f"LoRA adapter {name!r}: targets {', '.join(embedding)}; embedding and LM-head adapters "
                        "are not supported: train it on the linear projections only")
    return config


def _read_tensors(name: str, folder: Path) -> dict[str, torch.Tensor]:
    """The adapter's tensors from its safetensors file, else its ``.bin`` (tensors only)."""
    for fname in WEIGHT_FILES:
        file = folder / fname
        if not file.is_file():
            continue
        try:
            if fname.endswith(".safetensors"):
                from safetensors.torch import load_file

                return load_file(str(file), device="cpu")
            return torch.load(file, map_location="cpu", weights_only=True)
        except Exception as e:  # a truncated or foreign file: say which
            raise LoRAError(f"LoRA adapter {name!r}: cannot read {file}: {e}") from None
    raise LoRAError(f"LoRA adapter {name!r}: {folder} has neither {' nor '.join(WEIGHT_FILES)}; "
                    "save the adapter with peft's save_pretrained")


def _parse_key(name: str, key: str) -> tuple[str, str]:
    """(base-model module name, "A" or "B") of a peft tensor name."""
    key = key.removeprefix(_PREFIX)
    if ".lora_embedding_" in key or EMBEDDING_MODULES.intersection(key.split(".")):
        raise LoRAError(f"LoRA adapter {name!r}: tensor {key!r} belongs to an embedding or LM head; embedding "
                        "and LM-head adapters are not supported: train it on the linear projections only")
    m = _KEY.match(key)
    if m is None:
        raise LoRAError(f"LoRA adapter {name!r}: tensor {key!r} is not a lora_A/lora_B weight (DoRA magnitudes, "
                        "biases and modules_to_save are not supported); save the adapter without it")
    return m["module"], m["ab"]
