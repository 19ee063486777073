"""Overlap scheduling (issue 42): the engine suites again, with overlap on and each decode's tokens
left on the device until the next batch is launched (``ModelRunner.defer_results``, as on a GPU;
the CPU stands in for the device). ``CORE_TEST_OVERLAP=1`` makes ``tests.conftest.make_engine``
build such engines unless a test pins the mode; every test keeps its own expectations, so the
outputs are those of the plain loop: greedy and seeded samples, stop conditions, grammars,
logprobs, penalties, chunked prefill, retraction, continuous steps, abort, TP and DP, LoRA,
images, the host cache tier and speculative decoding."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SUITES = ["test_engine.py", "test_sampler.py", "test_structured_output.py", "test_chunked_prefill.py",
          "test_retraction.py", "test_continuous_decode.py", "test_step_safety.py", "test_tp.py", "test_dp.py",
          "test_lora_engine.py", "test_vlm_engine.py", "test_hicache.py", "test_speculative.py",
          "test_speculative_tree.py", "test_speculative_draft_model.py", "test_speculative_eagle.py"]


@pytest.mark.slow
def test_the_engine_suites_pass_with_overlap_and_device_side_tokens() -> None:
    here = Path(__file__).parent
    if os.environ.get("CORE_TEST_OVERLAP") == "1":
        pytest.skip("already the overlap run")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "--timeout", "600",
                           *(str(here / s) for s in SUITES)], cwd=here.parent, capture_output=True, text=True,
                          env={**os.environ, "CORE_TEST_OVERLAP": "1"}, timeout=1500)
    tail = "\n".join(proc.stdout.splitlines()[-30:])
    assert proc.returncode == 0, tail
    assert " passed" in tail and "failed" not in tail, tail
