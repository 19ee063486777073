"""Different attention backends for prefill and decode (SGLang's ``--prefill-attention-backend`` and
``--decode-attention-backend``).

Each flag falls back to ``--attention-backend`` (itself, when unset, the device's default from the
``choose_attention_backend`` hook). When the two resolve to the same name the engine builds that one
backend, as before: no wrapper, nothing per step. Otherwise :class:`PhaseAttention` holds one
backend of each name, both over the engine's one KV pool (each writes and reads the same slots),
and hands each forward to one of them by the batch's kind, as SGLang's hybrid backend does by
forward mode:

* a decode step (every sequence adds one token, ``ForwardBatch.is_decode``): the decode backend;
* everything else, prefill, extend and mixed prefill+decode batches (chunked prefill with
  ``--enable-mixed-chunk``), speculative verifies (SGLang's default ``--speculative-attention-mode
  prefill``; core has no such flag) and a draft model's extends: the prefill backend; a draft
  model's one-token steps are decodes.

The runner puts the chosen backend itself in ``ForwardBatch.attn_backend`` (:func:`phase_backend`),
so a model's CPU fast paths (the one-op decoder layers of ``kernels/cpu_decode``, which read
``decode_caches``) see the decode backend on decode steps and the prefill backend on the rest: with
``cpu`` decoding and ``torch_native`` prefilling, decodes run the fused C++ stack and prefills the
torch path. CUDA graphs capture decode steps, so their hooks are the decode backend's; verifies are
not captured (they run eagerly on the prefill backend).

The engine's backend name (``AsyncEngine.attention_backend_name``, what tensor-parallel ranks and
draft models build from) is then ``"prefill=<name>,decode=<name>"``: :func:`build_attention_backend`
builds either form.
"""

from __future__ import annotations

from typing import Any

import structlog

from core.errors import CoreError
from core.interfaces import AttentionConfig, ForwardBatch, cuda_graph_capable

log = structlog.get_logger(__name__)

FLAGS = {"prefill": "--prefill-attention-backend", "decode": "--decode-attention-backend"}


def hybrid_name(prefill: str, decode: str) -> str:
    """The engine's backend name for a pair: the plain name when they are the same."""
    return prefill if prefill == decode else f"prefill={prefill},decode={decode}"


def split_name(name: str) -> tuple[str, str]:
    """(prefill, decode) names of an engine backend name (a plain name: both)."""
    if name.startswith("prefill=") and ",decode=" in name:
        prefill, _, decode = name.removeprefix("prefill=").partition(",decode=")
        return prefill, decode
    return name, name


def attention_backend_name(args: Any, plugins: Any, device: Any, model_config: Any) -> str:
    """The engine's backend name from ``--attention-backend`` and the per-phase flags (each falls
    back to ``--attention-backend``, then to the device's default, as SGLang's do). An unknown name
    is refused here, naming its flag."""
    prefill, decode = args.prefill_attention_backend, args.decode_attention_backend
    base = args.attention_backend
    if base is None and (prefill is None or decode is None):
        base, why, chooser = plugins.choose_attention_backend(device, model_config)
        log.info("attention_backend.chosen", backend=base, reason=why, chosen_by=chooser)
    prefill, decode = prefill or base, decode or base
    if prefill != decode:
        for phase, name in (("prefill", prefill), ("decode", decode)):
            if getattr(args, f"{phase}_attention_backend") is not None:
                try:
                    plugins.get("attention_backend", name)
                except CoreError as e:  # (an unknown name: what is registered, the closest one)
                    raise CoreError(f"{FLAGS[phase]} {name}: {e}") from None
        log.info("attention_backend.phases", prefill=prefill, decode=decode)
    return hybrid_name(prefill, decode)


def build_attention_backend(plugins: Any, name: str, config: AttentionConfig) -> Any:
    """The backend ``name`` (:func:`attention_backend_name`) over ``config``'s KV pool."""
    prefill, decode = split_name(name)
    if prefill == decode:
        return plugins.resolve("attention_backend", name)(config)
    built = []
    for phase, n in (("prefill", prefill), ("decode", decode)):
        try:
            built.append(plugins.resolve("attention_backend", n)(config))
        except CoreError as e:  # e.g. a GPU-only backend on the CPU, a pool dtype it cannot read
            raise CoreError(f"{FLAGS[phase]} {n} cannot serve this engine's {phase} batches: {e}") from None
    return PhaseAttention(built[0], built[1], prefill, decode)


class PhaseAttention:
    """An ``AttentionBackend`` that hands each forward to the prefill or the decode backend (both
    over the same KV pool) by the batch's kind; see the module's docstring."""

    def __init__(self, prefill: Any, decode: Any, prefill_name: str, decode_name: str) -> None:
        self.prefill, self.decode = prefill, decode
        self.prefill_name, self.decode_name = prefill_name, decode_name
        # verifies of draft trees run on the prefill backend: whether it honours tree masks
        self.supports_tree_mask = bool(getattr(prefill, "supports_tree_mask", False))
        self.supports_cuda_graph_verify = False  # (the graphs hold the decode backend; verifies run eagerly)
        if cuda_graph_capable(decode):  # CUDA graphs capture decode steps: the decode backend's hooks
            self.init_cuda_graph = decode.init_cuda_graph
            self.prepare_capture = decode.prepare_capture
            self.prepare_replay = decode.prepare_replay

    def select(self, extend_lens: list[int], tree: bool = False) -> Any:
        """The backend of a batch whose sequences add ``extend_lens`` tokens (``tree``: a verify)."""
        return self.decode if not tree and all(n == 1 for n in extend_lens) else self.prefill

    def prepare(self, batch: ForwardBatch) -> None:
        self.select(batch.extend_lens_cpu, batch.tree_mask is not None).prepare(batch)

    def forward(self, q: Any, k: Any, v: Any, layer: Any, batch: ForwardBatch) -> Any:
        return self.select(batch.extend_lens_cpu, batch.tree_mask is not None).forward(q, k, v, layer, batch)

    def __repr__(self) -> str:
        return f"PhaseAttention(prefill={self.prefill_name}, decode={self.decode_name})"


def phase_backend(backend: Any, extend_lens: list[int], tree: bool = False) -> Any:
    """The backend that runs a batch: ``backend`` itself, or a :class:`PhaseAttention`'s choice."""
    return backend.select(extend_lens, tree) if type(backend) is PhaseAttention else backend


def decode_backend(backend: Any) -> Any:
    """The backend that runs decode steps (``backend`` itself unless it is a :class:`PhaseAttention`)."""
    return backend.decode if type(backend) is PhaseAttention else backend


def verify_backend_name(name: str) -> str:
    """The backend name that runs speculative verifies: the prefill one (SGLang's default
    ``--speculative-attention-mode prefill``)."""
    return split_name(name)[0]
