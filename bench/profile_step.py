"""Where a decode step's time goes on a GPU: the wall time of ``ModelRunner.run`` per decode step
against the GPU time of the CUDA-graph replay and the LM head (CUDA events), with graphs on and
off, then a torch.profiler table of one eager run (kernels per step).

    python bench/profile_step.py bench/shapes/smollm2-135m triton 1,64
    python bench/profile_step.py bench/shapes/smollm2-135m triton 1,64 '{"temperature": 1, "top_p": 0.9}'

The optional fourth argument: sampling parameters (JSON) for the timed requests (default greedy).
"""

from __future__ import annotations

import collections
import json
import sys
import time

import torch

from core import Engine
from core.log import configure_logging

configure_logging("warning")
path, backend = sys.argv[1], sys.argv[2]
levels = [int(x) for x in sys.argv[3].split(",")] if len(sys.argv) > 3 else [1, 64]
sampling = {"temperature": 0, **(json.loads(sys.argv[4]) if len(sys.argv) > 4 else {})}
for graphs in (True, False):
    eng = Engine(model_path=path, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
                 max_total_tokens=max(levels) * 300 + 64, max_running_requests=max(levels), attention_backend=backend,
                 disable_cuda_graph=not graphs, log_level="warning")
    core = eng.engine
    runner = core.runner
    acc = collections.defaultdict(list)
    ev = []

    def timed(name, fn, gpu=True):
        def w(*a, **k):
            if gpu:
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record(); out = fn(*a, **k); e.record(); ev.append((name, s, e))
            else:
                t = time.perf_counter(); out = fn(*a, **k); acc[name].append(time.perf_counter() - t)
            return out
        return w

    orig_run = runner.run
    def run(batch):
        if batch.is_prefill:
            return orig_run(batch)
        t = time.perf_counter(); out = orig_run(batch); acc["step_wall"].append(time.perf_counter() - t)
        return out
    runner.run = run
    if runner.graphs is not None:
        runner.graphs.replay = timed("graph_replay_gpu", runner.graphs.replay)
    core.model.compute_logits = timed("logits_gpu", core.model.compute_logits)
    runner.sampler.sample = timed("sample_total_wall", runner.sampler.sample, gpu=False)
    eng.generate(input_ids=[1, 2, 3, 4], sampling_params={"max_new_tokens": 4, "ignore_eos": True})
    for bs in levels:
        acc.clear(); ev.clear()
        prompts = [[100 + (i * 7 + j) % 30000 for j in range(128)] for i in range(bs)]
        t0 = time.perf_counter()
        eng.generate(input_ids=prompts, sampling_params=[{**sampling, "max_new_tokens": 64, "ignore_eos": True}] * bs)
        wall = time.perf_counter() - t0
        torch.cuda.synchronize()
        for name, s, e in ev:
            acc[name].append(s.elapsed_time(e) / 1e3)
        n = len(acc["step_wall"])
        parts = ", ".join(f"{k} {sum(v) / max(n, 1) * 1e3:.3f} ms" for k, v in acc.items())
        print(f"graphs={graphs} bs={bs}: {bs * 64 / wall:.0f} tok/s; per decode step ({n}): {parts}", flush=True)
    if not graphs:  # kernels per eager decode step
        from torch.profiler import profile, ProfilerActivity
        pbs = max(levels)
        ps = [[7 + i] * 128 for i in range(pbs)]
        eng.generate(input_ids=ps, sampling_params={"max_new_tokens": 2, "ignore_eos": True})
        ps = [[9 + i] * 128 for i in range(pbs)]
        eng.generate(input_ids=ps, sampling_params={"max_new_tokens": 1, "ignore_eos": True})  # prefill outside the profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            eng.generate(input_ids=ps, sampling_params={"max_new_tokens": 9, "ignore_eos": True})
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25), flush=True)
        kern = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        print(f"bs={pbs}: cuda kernels total", len(kern), "over ~9 steps (1 prefill, cached prefix)")
    eng.shutdown()
    del eng, core, runner
    torch.cuda.empty_cache()
