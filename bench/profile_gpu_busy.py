"""Is a GPU decode step bound by the device or by the host? One engine (the CUDA default: overlap
scheduling, CUDA graphs), ``bs`` streams decoding ``--steps`` tokens after their prompts were cached
(so the profiled run is decode, not prefill), under ``torch.profiler``: per decode step the wall
time, the device's busy time (the union of its kernels' intervals) and so its idle time, then
the kernels that take the most device time a step.

    python bench/profile_gpu_busy.py bench/shapes/llama-3.1-8b 256
    python bench/profile_gpu_busy.py bench/shapes/smollm2-135m 1,256 --disable-overlap-schedule
"""

from __future__ import annotations

import argparse
import collections
import time

import torch
from torch.profiler import ProfilerActivity, profile

from core import Engine
from core.log import configure_logging


def busy_us(spans: list[tuple[float, float]]) -> float:
    """The length of the union of ``spans`` (start, end)."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(spans):
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_path")
    ap.add_argument("streams", help="comma-separated stream counts")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--disable-overlap-schedule", action="store_true")
    args = ap.parse_args()
    configure_logging("warning")
    levels = [int(x) for x in args.streams.split(",")]
    eng = Engine(model_path=args.model_path, load_format="dummy", skip_tokenizer_init=True, log_level="warning",
                 max_running_requests=max(levels), max_total_tokens=max(levels) * 320 + 64,
                 disable_overlap_schedule=args.disable_overlap_schedule)
    runner = eng.engine.runner
    decodes = []
    orig = runner.run

    def run(batch):
        if not batch.is_prefill:
            decodes.append(time.perf_counter())
        return orig(batch)

    runner.run = run
    eng.generate(input_ids=[[5, 6, 7, 8]] * 4, sampling_params={"max_new_tokens": 8, "ignore_eos": True})
    for bs in levels:
        prompts = [[100 + (i * 7 + j) % 20000 for j in range(128)] for i in range(bs)]
        eng.generate(input_ids=prompts, sampling_params={"max_new_tokens": 1, "ignore_eos": True})  # cache them
        params = {"temperature": 0, "max_new_tokens": args.steps, "ignore_eos": True}
        eng.generate(input_ids=prompts, sampling_params=params)  # warm the graphs of this size
        decodes.clear()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            eng.generate(input_ids=prompts, sampling_params=params)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        kern = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        steps = max(len(decodes), 1)
        if len(decodes) > 2:  # the decode phase: from the second decode launch to the last
            period = (decodes[-1] - decodes[1]) / (len(decodes) - 2) * 1e3
        else:
            period = float("nan")
        spans = [(e.time_range.start, e.time_range.end) for e in kern]
        busy = busy_us(spans) / 1e3
        span = (max(e for _, e in spans) - min(s for s, _ in spans)) / 1e3 if spans else 0.0
        print(f"bs={bs} overlap={not args.disable_overlap_schedule}: {steps} decode steps, wall {wall * 1e3:.1f} ms, "
              f"{bs * args.steps / wall:.0f} tok/s; launch period {period:.2f} ms a step; device busy "
              f"{busy / steps:.2f} ms a step ({busy:.1f} of the {span:.1f} ms its kernels span: "
              f"{100 * busy / max(span, 1e-9):.0f} %)", flush=True)
        per = collections.Counter()
        count = collections.Counter()
        for e in kern:
            per[e.name] += e.time_range.elapsed_us()
            count[e.name] += 1
        for name, us in per.most_common(12):
            print(f"   {us / steps / 1e3:7.3f} ms/step  {count[name] / steps:6.1f}/step  {name[:110]}")
    eng.shutdown()


if __name__ == "__main__":
    main()
