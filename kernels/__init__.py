"""Triton kernels (installed as ``core_kernels``), imported only by the backends that use them.

- ``store_kv``: write a forward's new K/V rows into the paged pool.
- ``kv_indices``: flatten the request -> slot table into ``kv_indptr`` / ``kv_indices`` on the device.
- ``decode_attention``: one query per sequence, split-KV with a log-sum-exp merge, a kv head's
  query heads in one program.
- ``extend_attention``: new tokens attend to their cached prefix and causally to each other.
- ``fused_ops``: RMS norm, rotary, gated activation, per-token fp8 quantization, the sampler's two
  routes (plain and filtered rows), one launch each.
- ``wo_gemm``: weight-only fp8 / int8 GEMMs of few rows, the weight dequantized in registers.

Importing this package does not import triton; its submodules do.
"""

from __future__ import annotations

import os


def interpreting() -> bool:
    """True when triton runs kernels in its numpy interpreter (``TRITON_INTERPRET=1``), which
    is how the kernels run on machines without a GPU. Triton reads the variable when a kernel
    module is imported, so set it before that."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() not in ("", "0", "false", "off")
