"""The scheduler's own cost per decode step (issue 42: a host path that does not grow with the
batch), without a model, a runner or a loop: ``--streams`` requests decode in one batch, each
step ``schedule()`` then ``process()`` with a token per request, as the engine calls them (plain
loop; ``--overlap``: the next batch is scheduled before the last one is processed, as overlap
scheduling does). Prints the median and best microseconds per step and per request over
``--steps`` steps (CPU time of this thread: other processes on the VM barely move it).

    python bench/bench_scheduler.py --streams 1,64,256
"""

from __future__ import annotations

import argparse
import statistics
import time

import core  # noqa: F401
import torch

from core.engine.device import cpu_model_name
from core.engine.mem_cache.kv_cache import PageAllocator, ReqToTokenTable
from core.engine.mem_cache.radix_cache import RadixCache
from core.engine.request import Req
from core.engine.sampler import SampleOutput
from core.engine.sampling_params import SamplingParams
from core.engine.scheduler import Scheduler, StepResult


def decode_steps(streams: int, steps: int, input_len: int, overlap: bool) -> list[float]:
    """Thread CPU seconds of each decode step (schedule + process) at ``streams`` requests."""
    ctx = input_len + steps + 64
    pages = streams * ctx + 1
    alloc = PageAllocator(pages, 1)
    table = ReqToTokenTable(streams, ctx + 1, torch.device("cpu"))
    sched = Scheduler(alloc, table, max_running_requests=streams, max_prefill_tokens=16384, context_len=ctx,
                      eos_ids=(2,), tree_cache=RadixCache(1), chunked_prefill_size=16384)
    params = SamplingParams(max_new_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    for i in range(streams):
        sched.add(Req(f"r{i}", [10 + (i * 31 + j) % 900 for j in range(input_len)], params))
    while True:  # the prefills
        batch, _ = sched.schedule()
        sched.process(batch, StepResult(SampleOutput([7] * len(batch.reqs), None, None)))
        if all(r.output_ids for r in sched.running) and len(sched.running) == streams:
            break
    times = []
    inflight = None
    for s in range(steps):
        tokens = [100 + s % 500] * streams
        t = time.thread_time()
        if overlap:
            batch, _ = sched.schedule()  # (before the last batch's results, its tokens as future ids)
            if inflight is not None:
                sched.process(inflight, StepResult(SampleOutput(tokens, None, None)))
            inflight = batch
        else:
            batch, _ = sched.schedule()
            sched.process(batch, StepResult(SampleOutput(tokens, None, None)))
        times.append(time.thread_time() - t)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", default="1,64,256")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--overlap", action="store_true")
    args = ap.parse_args()
    print(f"# {cpu_model_name()}, {'overlap order' if args.overlap else 'plain loop'}, {args.input_len}-token prompts, "
          f"{args.steps} decode steps; thread CPU time of schedule() + process()")
    print(f"{'streams':>8}{'median us/step':>16}{'best us/step':>14}{'us/request':>12}")
    for n in (int(x) for x in args.streams.split(",")):
        t = decode_steps(n, args.steps, args.input_len, args.overlap)[args.steps // 10:]
        med = statistics.median(t) * 1e6
        print(f"{n:>8}{med:>16.1f}{min(t) * 1e6:>14.1f}{med / n:>12.2f}")


if __name__ == "__main__":
    main()
