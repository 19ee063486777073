"""Hook specifications: the public contract between core and its plugins.

A plugin is a module (named by an entry point in the ``core.plugins`` group) that
implements some of these hooks with ``@core.hookimpl``. Every ``register_*`` hook is
called exactly once at start-up, before serving, with a ``register`` callback::

    register(name: str, target: str | Callable, *, override: bool = False) -> None

``target`` is either a lazy ``"package.module:attribute"`` string (imported only when
that name is selected, so a GPU-only plugin costs nothing on a CPU machine) or a
callable factory. Core records which plugin and distribution registered each name;
two plugins registering the same name is a start-up error naming both, unless one
passes ``override=True``. The results are frozen into registries before serving,
so hooks are never called per request or per token.

One hook chooses rather than registers: ``choose_attention_backend`` (first answer wins).
Lifecycle hooks (``add_cli_options``, ``on_startup``, ``on_shutdown``) are the only
others; all hooks are synchronous.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import pluggy

if TYPE_CHECKING:
    import argparse

PROJECT = "core"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

Register = Callable[..., None]


@hookspec
def register_attention_backends(register: Register) -> None:
    """Register attention backends, selected with ``--attention-backend NAME``.

    Called once at start-up. ``register(name, target)`` where ``target`` resolves to
    a class (or factory) called as ``target(config: core.interfaces.AttentionConfig)``
    that returns an object satisfying :class:`core.interfaces.AttentionBackend`.

    Example::

        @hookimpl
        def register_attention_backends(register):
            register("torch_native", "core_plugins.attention.torch_native:TorchNativeBackend")
    """


@hookspec
def register_quant_methods(register: Register) -> None:
    """Register quantization methods, selected with ``--quantization NAME``.

    Called once at start-up. ``target`` resolves to a class (or factory) called with no
    arguments that returns an object satisfying :class:`core.interfaces.QuantMethod`.
    The name ``"none"`` is the unquantized method used when ``--quantization`` is unset.

    Example::

        @hookimpl
        def register_quant_methods(register):
            register("int8_weight", "my_plugin.int8:Int8WeightOnly")
    """


@hookspec
def register_models(register: Register) -> None:
    """Register model architectures, keyed by the Hugging Face architecture name.

    Called once at start-up. The name is what appears in ``config.json``'s
    ``architectures`` list (e.g. ``"LlamaForCausalLM"``). ``target`` resolves to a
    class (or factory) called as ``target(config, ctx: core.interfaces.ModelContext)``
    returning a ``torch.nn.Module`` satisfying :class:`core.interfaces.CausalLM`.

    Example::

        @hookimpl
        def register_models(register):
            register("LlamaForCausalLM", "core_plugins.models.llama:LlamaForCausalLM")
            register("MistralForCausalLM", "core_plugins.models.llama:LlamaForCausalLM")
    """


@hookspec
def register_tool_parsers(register: Register) -> None:
    """Register tool-call parsers, selected with ``--tool-call-parser NAME``.

    Called once at start-up. ``target`` resolves to a class (or factory) called with no
    arguments per request that returns a :class:`core.interfaces.ToolParser`.

    Example::

        @hookimpl
        def register_tool_parsers(register):
            register("qwen25", "my_plugin.hermes:HermesToolParser")
    """


@hookspec
def register_reasoning_parsers(register: Register) -> None:
    """Register reasoning parsers, selected with ``--reasoning-parser NAME``.

    Called once at start-up. ``target`` resolves to a class (or factory) called with no
    arguments per request that returns a :class:`core.interfaces.ReasoningParser`.

    Example::

        @hookimpl
        def register_reasoning_parsers(register):
            register("deepseek-r1", "my_plugin.think:ThinkTagParser")
    """


@hookspec
def register_grammar_backends(register: Register) -> None:
    """Register constrained-decoding grammar backends, selected with ``--grammar-backend``.

    Called once at start-up. ``target`` resolves to a class (or factory) called as
    ``target(tokenizer, vocab_size: int)`` returning a :class:`core.interfaces.GrammarBackend`.

    Example::

        @hookimpl
        def register_grammar_backends(register):
            register("xgrammar", "core_plugins.grammar.xgrammar_backend:XGrammarBackend")
    """


@hookspec
def register_speculative_algorithms(register: Register) -> None:
    """Register speculative decoding drafters, selected with ``--speculative-algorithm``.

    Called once at start-up. ``target`` resolves to a class (or factory) called as
    ``target(args)`` (the engine's ``EngineArgs``) returning either a
    :class:`core.interfaces.Drafter` (``propose``: a chain per request, from the tokens alone) or,
    since plugin API 1.3, a :class:`core.interfaces.ModelDrafter` (one with ``propose_batch``):
    the engine calls its ``load(ctx)`` once the target is loaded (the drafter loads its model with
    ``ctx.load_model(path)``, whose KV pool mirrors the target's: a request's draft KV lives at the
    target's slots, and which of those positions hold valid draft KV is the drafter's to track in
    the request's ``state``), then ``propose_batch(reqs)`` on the forward thread right before each
    verify, for exactly ``req.room`` tokens per request, in chains of up to
    ``--speculative-num-steps``. Built-in: ``NGRAM`` (a Drafter) and ``STANDALONE`` (a ModelDrafter,
    ``--speculative-draft-model-path PATH``).

    Example::

        @hookimpl
        def register_speculative_algorithms(register):
            register("NGRAM", "core_plugins.speculative.ngram:NgramDrafter")
            register("STANDALONE", "core_plugins.speculative.standalone:StandaloneDrafter")
    """


@hookspec
def register_hicache_storage_backends(register: Register) -> None:
    """Register HiCache storage backends, selected with ``--hicache-storage-backend NAME``
    (with ``--enable-hierarchical-cache``).

    Called once at start-up (plugin API 1.5). ``target`` resolves to a class (or factory) called as
    ``target(config)`` (a :class:`core.interfaces.HiCacheStorageConfig`: the key namespace, the
    folder or URI, the page size in bytes) returning a :class:`core.interfaces.HiCacheStorage`:
    ``get``/``set``/``exists``/``clear`` over KV pages keyed by prefix hashes. Built-in: ``file``
    (one file per page under ``$SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR``).

    Example::

        @hookimpl
        def register_hicache_storage_backends(register):
            register("file", "core_plugins.hicache.file:FileStorage")
    """


@hookspec
def register_multimodal_processors(register: Register) -> None:
    """Register multimodal processors, keyed by the Hugging Face architecture name of the
    vision-language model they prepare requests for (as ``register_models``).

    Called once at start-up (plugin API 1.7). Used when the server runs that architecture with
    ``--enable-multimodal`` (or SGLang's auto-detection of a vision-language model). ``target``
    resolves to a class (or factory) called once as ``target(model_path: str, hf_config,
    tokenizer)`` returning a :class:`core.interfaces.MultimodalProcessor`: ``image_token_id``,
    ``max_images`` and ``process(prompt, images) -> core.engine.multimodal.ImageInputs`` (the
    prompt's token ids with each image placeholder expanded to the image's tokens, the pixel
    tensors, each image's span and content hash). Built-in: ``Qwen2VLForConditionalGeneration``
    and ``Qwen2_5_VLForConditionalGeneration`` (transformers' Qwen2-VL image processor).

    Example::

        @hookimpl
        def register_multimodal_processors(register):
            register("Qwen2VLForConditionalGeneration", "core_plugins.multimodal.qwen2_vl:Qwen2VLInputProcessor")
    """


@hookspec(firstresult=True)
def choose_attention_backend(device: Any, model_config: Any, available: list[str]) -> str | tuple[str, str] | None:
    """Pick the attention backend used when ``--attention-backend`` is not given.

    Called once at start-up, after the registries are built. ``device`` is the
    ``torch.device`` the engine runs on; ``model_config`` is the engine's
    ``ModelConfig`` (``hf_config``, ``dtype``, ...; ``None`` when ``core plugins``
    asks without a model); ``available`` lists the registered backend names. Return a
    backend name, or ``(name, reason)`` to say why in the start-up log and in
    ``core plugins``; return ``None`` to let the next plugin answer. The first answer
    wins: plugins are asked in pluggy's order (the most recently loaded first), and
    the built-in policy (flashinfer on CUDA when it works, else triton; cpu on CPU when
    its C++ kernel builds; torch_native elsewhere) is marked ``trylast``, so any
    installed plugin that answers comes first.

    Example::

        @hookimpl
        def choose_attention_backend(device, model_config, available):
            if device.type == "xpu" and "my_xpu_attention" in available:
                return "my_xpu_attention", "Intel GPU"
            return None
    """


@hookspec
def add_cli_options(parser: argparse.ArgumentParser) -> None:
    """Add plugin-specific options to ``core serve`` / ``core generate``.

    Called once while the command-line parser is built, after core's own options.
    Options must be namespaced with the plugin's name (``--myplugin-foo``) so that
    they never collide with core's or another plugin's. Parsed values reach the
    plugin through ``on_startup(engine)`` as ``engine.args.extra``.

    Example::

        @hookimpl
        def add_cli_options(parser):
            parser.add_argument("--myplugin-scale", type=float, default=1.0)
    """


@hookspec
def on_startup(engine: Any) -> None:
    """Called once after the engine is built (model loaded, KV pool allocated) and
    before it accepts requests. Receives the :class:`core.engine.AsyncEngine`.

    Example::

        @hookimpl
        def on_startup(engine):
            engine.log.info("myplugin.ready", model=engine.model_config.architecture)
    """


@hookspec
def on_shutdown(engine: Any) -> None:
    """Called once when the engine shuts down, after running requests ended.

    Example::

        @hookimpl
        def on_shutdown(engine):
            release_my_resources()
    """
