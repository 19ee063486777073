"""Per-decode-step host (Python) time of the engine at 1 / 64 / 256 streams with a near-null model
(issue 42): TPOT, then one decode step split by function, from perf_counter wrappers put on the
engine's objects from here (nothing under core/ is edited).

    python bench/profile_host.py                                  # bench/shapes/null-tiny, 1,64,256 streams
    python bench/profile_host.py --streams 1,64,256 --input-len 128 --output-len 128 --cpu-threads 2
    python bench/profile_host.py --cprofile 256                   # + cProfile of the loop and forward threads
    python bench/profile_host.py --isolate --plain-only           # runner's part replayed alone (+ its cProfile)
    python bench/profile_host.py --plain-only [--overlap]         # TPOT, forward and exposed host time per step
    python bench/profile_host.py --stream                         # consumers: async_generate(stream=True) (bench_offline)
    python bench/profile_host.py --inline-rows 1024               # experiment: every decode on the loop thread
    python bench/profile_host.py --switch-interval 0.0002         # experiment: shorter GIL switch interval

The model: ``bench/shapes/null-tiny`` (Llama, 1 layer, hidden 64, vocab 1024), dummy weights,
no tokenizer (``skip_tokenizer_init``: the detokenizer is None, so ``detokenizer.add`` costs 0 here).
Requests: greedy, ignore_eos, all submitted at once through the offline ``Engine.generate`` (the
consumers are ``frontend.stream``/``drain`` on the engine loop, woken through ``Req.notify``).

For each stream count: (1) a plain run (only the start time of each decode forward recorded):
TPOT = median time between consecutive decode steps; (2) a timed run with every component wrapped;
the table shows microseconds per decode step (prefill steps excluded) and, for the per-request
ones, the cost per request per step. Each wrapper adds ~``overhead`` µs per call (measured, printed;
not subtracted in the table, subtracted per call in the per-request slopes). Wall time on the loop thread
while the forward runs on the executor thread (batches > 8 rows) is shown as ``await_fwd_wall``
(hop + forward) and the loop thread's CPU time during it (``loop_cpu_during_fwd``: the consumers and
the event loop machinery, running concurrently with the forward, competing for the GIL).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import cProfile
import io
import pstats
import statistics
import threading
import time

import core  # noqa: F401
from core import Engine
import core.engine.async_engine as ae

PC = time.perf_counter
TT = time.thread_time


class Rec:
    """Accumulates per decode step: name -> [seconds, calls]."""

    def __init__(self) -> None:
        self.cur: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
        self.steps: list[tuple[int, dict]] = []  # (batch size, dict) of decode steps
        self.on = False

    def add(self, name: str, dt: float) -> None:
        c = self.cur[name]
        c[0] += dt
        c[1] += 1


R = Rec()


def wrap(obj, name, label=None):
    fn = getattr(obj, name)
    label = label or name

    def w(*a, **k):
        t = PC()
        try:
            return fn(*a, **k)
        finally:
            R.add(label, PC() - t)
    setattr(obj, name, w)
    return fn


def wrap_overhead() -> float:
    """µs one wrapper adds around a no-op call."""
    class O:
        def f(self):
            return None
    o = O()
    n = 200000
    t = PC()
    for _ in range(n):
        o.f()
    base = PC() - t
    wrap(o, "f", "_cal")
    t = PC()
    for _ in range(n):
        o.f()
    R.cur.clear()
    return (PC() - t - base) / n * 1e6


def instrument(eng) -> None:
    c = eng.engine
    s, r = c.scheduler, c.runner
    for n in ("schedule", "_reap_aborted", "_get_prefill", "_ensure_decode_memory", "_continuous_steps", "_build",
              "_build_decode", "process", "_check_finish", "_free"):
        wrap(s, n, f"sched.{n}")
    for n in ("run", "step_inputs", "_forward"):
        wrap(r, n, f"runner.{n}")
    wrap(r.sampler, "sample", "sampler.sample")
    wrap(r.sampler, "_output", "sampler._output")
    wrap(c.watchdog, "begin", "watchdog.begin")
    wrap(c.watchdog, "running", "watchdog.running")
    wrap(c, "_finished", "engine._finished")
    wrap(c, "output", "consumer.output(req)")
    for i, lst in enumerate(c.step_listeners):
        def lw(batch, sec, _l=lst):
            t = PC()
            _l(batch, sec)
            R.add("step_listeners", PC() - t)
        c.step_listeners[i] = lw

    orig_fwd = c._on_forward_thread

    async def on_fwd(fn, *a):
        t, tc = PC(), TT()
        try:
            return await orig_fwd(fn, *a)
        finally:
            R.add("await_fwd_wall", PC() - t)
            R.add("loop_cpu_during_fwd", TT() - tc)
    c._on_forward_thread = on_fwd

    orig_drain = ae._drain_loop

    async def drain(*a):
        t = PC()
        try:
            return await orig_drain(*a)
        finally:
            R.add("_drain_loop(inline)", PC() - t)
    ae._drain_loop = drain

    class TQ(asyncio.Queue):
        def put_nowait(self, item):
            t = PC()
            super().put_nowait(item)
            R.add("req.queue.put_nowait", PC() - t)

    from core.engine.request import Req
    if hasattr(Req, "notify"):  # update delivery through Req.notify (no per-request queue)
        orig_notify = Req.notify

        def notify(self):
            t = PC()
            orig_notify(self)
            R.add("req.notify", PC() - t)
        Req.notify = notify
    else:
        orig_submit = c.submit

        def submit(reqs):
            for q in reqs:
                q.queue = TQ()
            return orig_submit(reqs)
        c.submit = submit

    orig_step = c._step
    last = {"end": None, "end_cpu": None}

    async def step():
        t, tc = PC(), TT()
        gap = None if last["end"] is None else (t - last["end"], tc - last["end_cpu"])
        R.cur.clear()
        await orig_step()
        e = PC()
        d = R.cur
        d["_step wall"] = [e - t, 1]
        if gap is not None:
            d["gap between steps (wall)"] = [gap[0], 1]
            d["gap between steps (loop cpu)"] = [gap[1], 1]
        last["end"], last["end_cpu"] = e, TT()
        if R.on and d.get("runner.run") and not d.get("is_prefill"):
            R.steps.append((R.bs, dict(d)))
        R.cur = collections.defaultdict(lambda: [0.0, 0])
    c._step = step

    orig_sched = s.schedule

    def sched():
        out = orig_sched()
        if out[0] is not None and out[0].is_prefill:
            R.cur["is_prefill"] = [1, 1]
        return out
    s.schedule = sched


def prompts(bs, n):
    return [[10 + (i * 7 + j) % 1000 for j in range(n)] for i in range(bs)]


def go(eng, bs, args):
    """One run of ``bs`` requests: blocking ``generate``, or with ``--stream`` the caller consuming
    ``async_generate(stream=True)`` on its own loop (bench_offline's way: the pump and the
    cross-thread hand-off of every chunk included)."""
    sp = {"temperature": 0, "max_new_tokens": args.output_len, "ignore_eos": True}
    if not args.stream:
        return eng.generate(input_ids=prompts(bs, args.input_len), sampling_params=sp)

    async def consume():
        n = 0
        async for _ in await eng.async_generate(input_ids=prompts(bs, args.input_len), sampling_params=sp, stream=True):
            n += 1
        return n
    return asyncio.run(consume())


def plain_tpot(eng, bs, args):
    """(TPOT median ms, mean ms, wall s, decode steps, forward ms per decode step): the forward is
    ``runner.run`` on its thread, so TPOT - forward is the host time a step leaves exposed (the rest
    of the host's work, with overlap scheduling, ran while the forward did)."""
    r = eng.engine.runner
    orig = r.run
    starts, busy = [], []

    def run(batch):
        t = PC()
        try:
            return orig(batch)
        finally:
            if not batch.is_prefill:
                starts.append(t)
                busy.append(PC() - t)
    r.run = run
    t = PC()
    go(eng, bs, args)
    wall = PC() - t
    r.run = orig
    d = [b - a for a, b in zip(starts, starts[1:])][2:]
    return statistics.median(d) * 1e3, statistics.mean(d) * 1e3, wall, len(starts), statistics.median(busy[2:]) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-path", default="bench/shapes/null-tiny")
    ap.add_argument("--streams", default="1,64,256")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--cpu-threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--cprofile", type=int, default=0, help="also cProfile the decode of this many streams")
    ap.add_argument("--inline-rows", type=int, default=None,
                    help="experiment: AsyncEngine.inline_decode_rows (decodes of up to this many rows run on the loop thread)")
    ap.add_argument("--switch-interval", type=float, default=None, help="experiment: sys.setswitchinterval (s; default 0.005)")
    ap.add_argument("--isolate", action="store_true",
                    help="also replay one captured decode batch per level through step_inputs/_forward/sample alone "
                         "(no loop, no consumers, no second thread) and cProfile that replay")
    ap.add_argument("--stream", action="store_true", help="consume through async_generate(stream=True) on the caller's loop")
    ap.add_argument("--plain-only", action="store_true", help="TPOT only, no timed run")
    ap.add_argument("--overlap", action="store_true", help="overlap scheduling on (--enable-overlap-schedule)")
    args = ap.parse_args()
    if args.switch_interval is not None:
        import sys
        sys.setswitchinterval(args.switch_interval)
    levels = [int(x) for x in args.streams.split(",")]
    eng = Engine(model_path=args.model_path, load_format="dummy", skip_tokenizer_init=True, log_level="warning",
                 max_running_requests=max(levels), max_total_tokens=max(levels) * (args.input_len + args.output_len + 16),
                 cpu_threads=args.cpu_threads, enable_overlap_schedule=args.overlap)
    if args.inline_rows is not None:
        eng.engine.inline_decode_rows = args.inline_rows
    eng.generate(input_ids=prompts(4, 16), sampling_params={"max_new_tokens": 8, "ignore_eos": True})
    print(f"wrapper overhead: {wrap_overhead():.3f} us/call")
    ovh = wrap_overhead()
    tp = {}
    for bs in levels:
        res = [plain_tpot(eng, bs, args) for _ in range(args.reps)]
        med = min(x[0] for x in res)
        tp[bs] = med
        print(f"plain bs={bs}: TPOT median {[round(x[0], 3) for x in res]} ms, mean {[round(x[1], 3) for x in res]} ms, "
              f"wall {[round(x[2], 3) for x in res]} s, decode steps {res[0][3]}; forward {[round(x[4], 3) for x in res]} "
              f"ms, host time exposed (TPOT - forward) {[round(x[0] - x[4], 3) for x in res]} ms", flush=True)
    if args.cprofile:
        run_cprofile(eng, args.cprofile, args)
    if args.isolate:
        isolate(eng, levels, args)
    if args.plain_only:
        print("\nplain TPOT ms:", {b: round(v, 3) for b, v in tp.items()})
        eng.shutdown()
        return
    instrument(eng)
    table = {}
    for bs in levels:
        R.bs, R.on = bs, True
        R.steps.clear()
        for _ in range(args.reps):
            go(eng, bs, args)
        R.on = False
        steps = [d for b, d in R.steps if b == bs][2:]
        names = sorted({k for d in steps for k in d})
        table[bs] = {k: (sum(d.get(k, [0, 0])[0] for d in steps) / len(steps) * 1e6,
                         sum(d.get(k, [0, 0])[1] for d in steps) / len(steps)) for k in names}
    order = ["_step wall", "gap between steps (wall)", "gap between steps (loop cpu)", "watchdog.begin", "sched.schedule",
             "sched._reap_aborted", "sched._get_prefill", "sched._ensure_decode_memory", "sched._continuous_steps",
             "sched._build", "sched._build_decode", "watchdog.running", "await_fwd_wall", "loop_cpu_during_fwd", "runner.run", "runner.step_inputs",
             "runner._forward", "sampler.sample", "sampler._output", "step_listeners", "sched.process", "sched._check_finish",
             "sched._free", "req.queue.put_nowait", "req.notify", "engine._finished", "_drain_loop(inline)", "consumer.output(req)"]
    names = order + sorted({k for t in table.values() for k in t} - set(order) - {"is_prefill"})
    hdr = "".join(f"{'bs=' + str(b) + ' us':>14}{'calls':>8}" for b in levels)
    print(f"\nper decode step (timed run; wrapper overhead {ovh:.2f} us/call, not subtracted)")
    print(f"{'component':34}{hdr}")
    for k in names:
        print(f"{k:34}" + "".join(f"{table[b].get(k, (0, 0))[0]:14.1f}{table[b].get(k, (0, 0))[1]:8.1f}" for b in levels))
    derived = {}
    for b in levels:
        t = table[b]
        g = lambda k: t.get(k, (0, 0))[0]
        derived[b] = {
            "schedule: filter+rest (self)": g("sched.schedule") - sum(g(k) for k in ("sched._reap_aborted", "sched._get_prefill",
                                                                                   "sched._ensure_decode_memory", "sched._continuous_steps", "sched._build",
                                                                                   "sched._build_decode")),
            "runner.run: SamplingRow list etc (self)": g("runner.run") - g("runner.step_inputs") - g("runner._forward") - g("sampler.sample"),
            "process: per-req loop (self)": g("sched.process") - g("sched._check_finish") - g("sched._free"),
            "fwd thread hop (await - run)": g("await_fwd_wall") - g("runner.run") if g("await_fwd_wall") else 0.0,
            "_step self (notify loop etc)": g("_step wall") - sum(g(k) for k in ("watchdog.begin", "sched.schedule", "watchdog.running",
                                                                             "step_listeners", "sched.process", "req.queue.put_nowait", "req.notify",
                                                                             "engine._finished", "_drain_loop(inline)"))
            - (g("await_fwd_wall") or g("runner.run")),
        }
    print("\nderived (µs per step)")
    for k in derived[levels[0]]:
        print(f"{k:40}" + "".join(f"{derived[b][k]:14.1f}" for b in levels))
    if len(levels) >= 2:
        lo, hi = levels[0], levels[-1]
        print(f"\nper-request slope (µs per request per step, between bs={lo} and bs={hi}; wrapper overhead subtracted per call)")
        allk = names + list(derived[lo])
        for k in allk:
            if k in table[hi] or k in derived[hi]:
                v = lambda b: table[b].get(k, (derived[b].get(k, 0.0), 0))
                (a, ca), (z, cz) = v(lo), v(hi)
                a -= ca * ovh
                z -= cz * ovh
                print(f"{k:40}{(z - a) / (hi - lo):10.3f}")
    print("\nplain TPOT ms:", {b: round(v, 3) for b, v in tp.items()})


def isolate(eng, levels, args, n=60):
    """The runner's part of a decode step with nothing else running: one decode batch per level is
    captured mid-run and replayed ``n`` times after it (its KV slots are free by then: harmless)."""
    import copy
    import torch
    r = eng.engine.runner
    orig = r.run
    for bs in levels:
        got = []

        def run(batch):
            if not batch.is_prefill and len(got) < 1 and batch.reqs and len(batch.reqs[0].output_ids) > 60:
                got.append((copy.copy(batch), [(q, q.kv_len, list(q.output_ids), q.row) for q in batch.reqs]))
            return orig(batch)
        r.run = run
        eng.generate(input_ids=prompts(bs, args.input_len),
                     sampling_params={"temperature": 0, "max_new_tokens": args.output_len, "ignore_eos": True})
        r.run = orig
        batch, saved = got[0]
        for q, kv, out, row in saved:  # the requests as they were at that step
            q.kv_len, q.row = kv, row
            q.output_ids[:] = out
        from core.engine.model_runner import SamplingRow
        acc = collections.defaultdict(float)
        with torch.inference_mode():
            for i in range(n + 5):
                t0 = PC()
                inputs, live, _ = r.step_inputs(batch)
                t1 = PC()
                hidden, logits, am = r._forward(inputs, batch.reqs)
                t2 = PC()
                rows = [SamplingRow(q.params, q.prompt_ids, q.output_ids, q.generator, r.eos_ids, q.return_logprob,
                                    q.top_logprobs_num, q.row) for q in batch.reqs]
                t3 = PC()
                r.sampler.sample(logits[0], rows, am)
                t4 = PC()
                if i >= 5:
                    for k, v in (("step_inputs", t1 - t0), ("_forward", t2 - t1), ("SamplingRow list", t3 - t2), ("sample", t4 - t3)):
                        acc[k] += v
            prof = cProfile.Profile()
            prof.enable()
            for i in range(20):
                inputs, live, _ = r.step_inputs(batch)
                hidden, logits, am = r._forward(inputs, batch.reqs)
                rows = [SamplingRow(q.params, q.prompt_ids, q.output_ids, q.generator, r.eos_ids, q.return_logprob,
                                    q.top_logprobs_num, q.row) for q in batch.reqs]
                r.sampler.sample(logits[0], rows, am)
            prof.disable()
        for q, *_ in saved:
            q.row = -1
        print(f"isolated runner step bs={bs} (us): " + ", ".join(f"{k} {v / n * 1e6:.1f}" for k, v in acc.items()), flush=True)
        st = io.StringIO()
        pstats.Stats(prof, stream=st).sort_stats("tottime").print_stats(14)
        print(f"--- cProfile of 20 isolated replays, bs={bs}, by tottime (per-call columns are per replay x calls)")
        print("\n".join(l for l in st.getvalue().splitlines() if l.strip() and not l.startswith("   Ordered") and "List reduced" not in l))


def run_cprofile(eng, bs, args):
    """cProfile both the engine loop thread and the forward thread over one decode run."""
    c = eng.engine
    profs = {"loop": cProfile.Profile(), "fwd": cProfile.Profile()}
    ev = threading.Event()

    def en(p):
        p.enable()
        ev.set()
    for name, target in (("loop", lambda f: eng._loop.call_soon_threadsafe(f)), ("fwd", lambda f: c._executor.submit(f))):
        ev.clear()
        target(lambda p=profs[name]: en(p))
        ev.wait()
    eng.generate(input_ids=prompts(bs, args.input_len),
                 sampling_params={"temperature": 0, "max_new_tokens": args.output_len, "ignore_eos": True})
    for name, target in (("loop", lambda f: eng._loop.call_soon_threadsafe(f)), ("fwd", lambda f: c._executor.submit(f))):
        ev.clear()

        def dis(p=profs[name]):
            p.disable()
            ev.set()
        target(dis)
        ev.wait()
        s = io.StringIO()
        pstats.Stats(profs[name], stream=s).sort_stats("tottime").print_stats(30)
        print(f"\n=== cProfile {name} thread, bs={bs} (incl. prefill), by tottime ===\n{s.getvalue()}")


if __name__ == "__main__":
    main()
