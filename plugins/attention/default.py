"""The built-in choice of attention backend per device (the ``choose_attention_backend`` hook).

On CUDA: triton, then flashinfer where it works, then torch_native. Triton came out ahead
of FlashInfer on an H100 at most batch sizes (docs/benchmarks.md) and needs no minutes of
nvcc on first use; ``--attention-backend flashinfer`` selects FlashInfer. On CPU: the cpu
kernel where it builds, else torch_native.

Marked ``trylast`` so that any installed plugin that answers for its hardware wins."""

from __future__ import annotations

from typing import Any

import torch

from core import hookimpl


@hookimpl(trylast=True)
def choose_attention_backend(device: Any, model_config: Any, available: list[str]) -> tuple[str, str] | None:
    if device.type == "cuda":
        if "triton" in available:
            return "triton", "CUDA: the Triton kernels with CUDA graphs (faster than flashinfer in our H100 runs)"
        dtype = getattr(model_config, "dtype", None)
        if "flashinfer" in available and dtype in (None, torch.float16, torch.bfloat16):
            from core_plugins.attention.flashinfer import flashinfer_status

            ok, why = flashinfer_status()
            if ok:
                return "flashinfer", "CUDA, no triton backend installed, and FlashInfer works here"
            if "torch_native" in available:
                return "torch_native", f"cuda: the torch-native reference backend (flashinfer is not usable: {why})"
    if device.type == "cpu" and "cpu" in available:
        from core_plugins.attention.cpu import kernel_status

        # `core plugins` (no model) never compiles; an engine start builds the kernel once per machine (~10 s)
        ok, why = kernel_status(build=model_config is not None)
        if ok:
            return "cpu", f"cpu: the in-place C++ paged-attention kernel ({why})"
        if "torch_native" in available:
            return "torch_native", f"cpu: the torch-native reference backend (the cpu kernel is not usable: {why})"
    if "torch_native" in available:
        return "torch_native", f"{device.type}: the torch-native reference backend"
    return None
