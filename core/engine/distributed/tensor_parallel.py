"""Tensor parallelism over ``torch.distributed``: the ranks, the per-step broadcast, failure.

Rank 0 is the engine's own process: ``AsyncEngine`` keeps the one scheduler, the sampling
and the KV pool's bookkeeping there. Ranks 1..tp-1 are worker processes
(``core.engine.distributed.tp_worker``, spawned here, or by ``core serve --node-rank N`` on the other
machines) holding the other shards of the weights and of the KV pool. Each step, rank 0's
forward thread broadcasts the step's inputs (``StepInputs``) and then every rank runs the
same forward; the shared layers' all-reduces / all-gathers pair up on the compute group
(NCCL on GPUs, gloo on CPUs).

Two process groups: the compute group (the default group) times out after
``--dist-timeout`` seconds; the control group (gloo, for the broadcast objects) waits as
long as the server is idle. Failure is final: a rank process that exits (watched through
its process sentinel), or a step whose forward raises on rank 0 (its collectives would no
longer pair up), marks the group failed; the engine then fails every request with the
message and stops, and ``core serve`` exits non-zero.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import socket
import threading
import time
from typing import Any, Callable, TypeVar

import attrs
import structlog
import torch

from core.engine.distributed.collectives import DistPlan, KVSpec, agree, broadcast, describe, first_failure, init_rank, process_context
from core.engine.config import EngineArgs
from core.engine.model_runner import StepInputs
from core.errors import CoreError, ModelLoadError
from core.parallel import TensorParallel, building

log = structlog.get_logger("core.engine.distributed.tensor_parallel")
# how long a failure waits for a dead rank's exit code, so that the error names it: the forkserver
# that reaps the rank is slow to report under load (1 s was sometimes too short in the test suite)
REAP_WAIT_S = 5.0

DEFAULT_DIST_TIMEOUT_S = 300.0
STOP_GRACE_S = 10.0
T = TypeVar("T")


class RankFailure(CoreError):
    """A tensor-parallel rank died or a step's collectives failed: the engine cannot go on."""


def plan_for(args: EngineArgs, device: torch.device) -> DistPlan | None:
    """The plan of ``args`` (None for a single rank); a CoreError naming the flag for values
    that cannot work."""
    tp, nnodes, node_rank = args.tp_size, args.nnodes, args.node_rank
    if not isinstance(tp, int) or tp < 1:
        raise CoreError(f"--tp-size must be >= 1, got {tp}")
    if not isinstance(nnodes, int) or nnodes < 1:
        raise CoreError(f"--nnodes must be >= 1, got {nnodes}")
    if not isinstance(node_rank, int) or not 0 <= node_rank < nnodes:
        raise CoreError(f"--node-rank must be in [0, {nnodes}) (--nnodes {nnodes}), got {node_rank}")
    if tp % nnodes:
        raise CoreError(f"--tp-size {tp} must be a multiple of --nnodes {nnodes} (the same number of ranks per machine)")
    if args.dist_timeout is not None and args.dist_timeout <= 0:
        raise CoreError(f"--dist-timeout must be > 0, got {args.dist_timeout}")
    if tp == 1:
        return None
    addr = args.dist_init_addr
    if addr is None:
        if nnodes > 1:
            raise CoreError("--nnodes > 1 needs --dist-init-addr HOST:PORT (where rank 0, on --node-rank 0, listens)")
        addr = f"127.0.0.1:{_free_port()}"
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise CoreError(f"--dist-init-addr must be HOST:PORT, got {addr!r}")
    backend = "nccl" if device.type == "cuda" else "gloo"
    return DistPlan(tp, nnodes, node_rank, addr, float(args.dist_timeout or DEFAULT_DIST_TIMEOUT_S), backend,
                    args.gpu_id_step)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TensorParallelGroup:
    """Rank 0's handle on the group: starts this machine's other ranks, broadcasts each step,
    watches the rank processes and stops them. ``on_failure(message)`` is called once (from a
    watcher or the forward thread) when the group fails."""

    def __init__(self, plan: DistPlan, args: EngineArgs) -> None:
        from core.engine.distributed.tp_worker import rank_main

        self.plan, self.failure = plan, None
        self.on_failure: Callable[[str], None] | None = None
        self._stopped = False
        ctx = process_context()
        self.procs = {r: ctx.Process(target=rank_main, args=(r, args, plan), name=f"core-tp-rank{r}", daemon=True)
                      for r in plan.local_ranks if r != 0}
        for p in self.procs.values():
            p.start()
        log.info("tp.starting", tp_size=plan.tp_size, nnodes=plan.nnodes, init_addr=plan.init_addr, backend=plan.backend)
        self.tp, self.control = self._rendezvous()
        threading.Thread(target=self._watch, name="core-tp-watch", daemon=True).start()

    # ------------------------------------------------------------------ start-up
    def _rendezvous(self) -> tuple[TensorParallel, Any]:
        """``init_rank(0)`` on a helper thread, so that a rank process dying before it joins is
        reported at once instead of after the rendezvous timeout."""
        box: dict[str, Any] = {}

        def join() -> None:
            try:
                box["ok"] = init_rank(self.plan, 0)
            except BaseException as e:  # reported below
                box["error"] = e

        t = threading.Thread(target=join, name="core-tp-rendezvous", daemon=True)
        t.start()
        while t.is_alive():
            t.join(0.1)
            dead = self._dead_ranks()
            if dead and t.is_alive():
                self._kill()
                raise ModelLoadError(f"tensor-parallel {dead[0]} before the ranks met")
        if "error" in box:
            self._kill()
            raise ModelLoadError(f"tensor-parallel ranks could not meet at {self.plan.init_addr}: {describe(box['error'])}")
        return box["ok"]

    def load(self, load: Callable[[], T]) -> T:
        """Run ``load`` (rank 0's model build) under this group, then hear from every rank; a
        failure anywhere stops the group and raises (rank 0's own error as it was raised)."""
        try:
            with building(self.tp):
                model = load()
        except BaseException as e:
            self._settle(describe(e), "load the model")
            if isinstance(e, ValueError):  # e.g. heads that do not split over the ranks
                raise ModelLoadError(f"cannot shard the model over {self.plan.tp_size} tensor-parallel ranks: {e}") from None
            raise
        self._settle(None, "load the model")
        return model

    def setup_kv(self, spec: KVSpec) -> None:
        """Have the other ranks allocate their KV pool shard and attention backend (rank 0 has)."""
        broadcast(self.control, ("kv", spec))
        self._settle(None, "allocate its KV cache")

    def _settle(self, error: str | None, what: str) -> None:
        """Hear every rank's error; on any, stop the group and (unless rank 0's own error is
        about to be raised) raise ModelLoadError naming the rank."""
        try:
            bad = first_failure(agree(self.control, error))
        except Exception as e:
            why = self._dead_message(REAP_WAIT_S) or f"lost contact with the other ranks ({describe(e)})"
            self.stop()
            if error is None:
                raise ModelLoadError(f"tensor-parallel ranks could not {what}: {why}") from None
            return
        if bad:
            self.stop()
            if error is None:
                raise ModelLoadError(f"tensor-parallel rank {bad[0]} could not {what}: {bad[1]}")

    def lora(self, message: tuple, what: str) -> None:
        """Send the other ranks a LoRA message (``core.engine.lora.tp``) and hear from each: a
        LoRAError naming the first that could not ``what``; the group goes on either way."""
        from core.engine.lora.adapter import LoRAError

        broadcast(self.control, message)
        if (bad := first_failure(agree(self.control, None))) is not None:
            raise LoRAError(f"tensor-parallel rank {bad[0]} could not {what}: {bad[1]}")

    def collective(self, message: tuple, run: Callable[[], str | None]) -> str | None:
        """Send the other ranks ``message``, run rank 0's part (``run``: its error or None), hear
        from every rank: the first error (another rank's named), or None. On the forward thread,
        between steps."""
        broadcast(self.control, message)
        if (bad := first_failure(agree(self.control, run()))) is None:
            return None
        return bad[1] if bad[0] == 0 else f"tensor-parallel rank {bad[0]}: {bad[1]}"

    # ------------------------------------------------------------------ serving (forward thread)
    def forward(self, inputs: StepInputs, run: Callable[[], T]) -> T:
        """Broadcast the step, then ``run`` it here. Any failure is final: RankFailure."""
        if self.failure is not None:
            raise RankFailure(self.failure)
        try:
            broadcast(self.control, ("step", _portable(inputs)))
            return run()
        except Exception as e:
            message = self._dead_message(REAP_WAIT_S) or f"a tensor-parallel step failed: {describe(e)}"
            self._fail(message)
            raise RankFailure(self.failure or message) from e

    def reload(self, model_path: str, load: Callable[[], T]) -> T:
        """Every rank loads the weights at ``model_path``; all or none switch (ModelLoadError
        naming the first rank that failed)."""
        broadcast(self.control, ("reload", model_path))
        model, error = None, None
        try:
            with building(self.tp):
                model = load()
        except Exception as e:
            error = describe(e)
        if (bad := first_failure(agree(self.control, error))) is not None:
            raise ModelLoadError(f"tensor-parallel rank {bad[0]}: {bad[1]}")
        return model  # type: ignore[return-value]

    # ------------------------------------------------------------------ failure and shutdown
    def _dead_ranks(self) -> list[str]:
        return [f"rank {r} exited with code {p.exitcode}" for r, p in self.procs.items() if p.exitcode is not None]

    def _dead_message(self, wait_s: float) -> str | None:
        """Which local rank died, waiting up to ``wait_s`` for the process to be reaped (a
        collective usually notices a dead peer a moment before its process is reaped)."""
        deadline = time.monotonic() + wait_s
        while True:
            dead = self._dead_ranks()
            if dead or not self.procs or time.monotonic() >= deadline:
                return f"tensor-parallel {dead[0]}" if dead else None
            time.sleep(0.02)

    def _watch(self) -> None:
        sentinels = {p.sentinel: r for r, p in self.procs.items()}
        while sentinels and not self._stopped:
            ready = multiprocessing.connection.wait(list(sentinels), timeout=0.5)
            if ready and not self._stopped:
                self._fail(self._dead_message(REAP_WAIT_S) or f"tensor-parallel rank {sentinels[ready[0]]} exited")
                return

    def _fail(self, message: str) -> None:
        if self.failure is not None or self._stopped:
            return
        self.failure = message
        log.error("tp.failed", error=message)
        if self.on_failure is not None:
            self.on_failure(message)

    def stop(self) -> None:
        """Tell the ranks to exit, wait for them (killing stragglers), leave the group."""
        if self._stopped:
            return
        self._stopped = True
        if self.failure is None:
            try:
                broadcast(self.control, ("stop",))
            except Exception:  # a rank already gone: nothing to tell
                pass
        deadline = time.monotonic() + STOP_GRACE_S
        for p in self.procs.values():
            p.join(max(0.0, deadline - time.monotonic()))
        self._kill()
        try:
            import torch.distributed as dist

            dist.destroy_process_group()
        except Exception:
            pass

    def _kill(self) -> None:
        for p in self.procs.values():
            if p.is_alive():
                p.kill()
                p.join(5)


def _portable(inputs: StepInputs) -> StepInputs:
    """The step with its tensors on the CPU (what the broadcast pickles)."""
    moved = {f.name: v.cpu() for f in attrs.fields(StepInputs) if isinstance(v := getattr(inputs, f.name), torch.Tensor)
             and v.device.type != "cpu"}
    return attrs.evolve(inputs, **moved) if moved else inputs


def start_tensor_parallel(args: EngineArgs, device: torch.device) -> TensorParallelGroup | None:
    """Rank 0's group for ``args`` (None with one rank)."""
    plan = plan_for(args, device)
    if plan is None:
        return None
    if plan.node_rank != 0:
        raise CoreError(f"--node-rank {plan.node_rank} runs tensor-parallel ranks only (`core serve` on that machine "
                        "serves no HTTP); the engine runs on --node-rank 0")
    if args.is_embedding:
        raise CoreError("--is-embedding is not supported with --tp-size > 1 yet")
    return TensorParallelGroup(plan, args)


def serve_node(args: EngineArgs) -> int:
    """``core serve --node-rank N`` with N > 0: run this machine's ranks (no HTTP, no
    scheduler) until rank 0 stops them or a signal arrives; 0 when they all exited cleanly."""
    import signal

    from core.engine.device import placed_device
    from core.engine.distributed.tp_worker import rank_main

    plan = plan_for(args, placed_device(args))
    if plan is None or plan.node_rank == 0:
        raise CoreError("only --node-rank > 0 of a --tp-size > 1 group runs ranks without serving")
    ctx = process_context()
    procs = [ctx.Process(target=rank_main, args=(r, args, plan), name=f"core-tp-rank{r}", daemon=True)
             for r in plan.local_ranks]
    for p in procs:
        p.start()
    log.info("tp.node_started", node_rank=plan.node_rank, ranks=list(plan.local_ranks), init_addr=plan.init_addr)
    signalled = threading.Event()

    def on_signal(signum, frame) -> None:
        signalled.set()
        for p in procs:
            if p.is_alive():
                p.terminate()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    for p in procs:
        p.join()
    codes = [p.exitcode for p in procs]
    log.info("tp.node_stopped", node_rank=plan.node_rank, exit_codes=codes)
    return 0 if signalled.is_set() or all(c == 0 for c in codes) else 1
