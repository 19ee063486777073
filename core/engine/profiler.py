"""The torch profiler over the engine's forward steps, behind SGLang's /start_profile and /stop_profile.

The profiler starts and stops on the forward thread (the engine's one-thread executor), between
two steps, so a trace holds whole steps; with ``num_steps`` it stops by itself after that many
forwards. The trace is a Chrome trace, ``<output_dir>/<prefix>-<time>.trace.json.gz`` (open it in
Perfetto or chrome://tracing); ``output_dir`` defaults to ``$SGLANG_TORCH_PROFILER_DIR``, else /tmp,
as in SGLang.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import time
from typing import Any

import structlog
import torch

from core.errors import InvalidRequest

log = structlog.get_logger("core.engine.profiler")

ACTIVITIES = ("CPU", "GPU", "MEM")


class StepProfiler:
    """One engine's profiler: at most one trace at a time."""

    def __init__(self, executor: concurrent.futures.Executor, device: torch.device) -> None:
        self.executor, self.device = executor, device
        self.prof: Any = None
        self.path: str | None = None
        self.steps_left: int | None = None
        self.started = False  # the profiler runs (not only reserved by a start still in progress)
        self._stopping: asyncio.Future | None = None

    @property
    def active(self) -> bool:
        return self.prof is not None

    async def start(self, output_dir: str | None = None, num_steps: int | None = None,
                    activities: list[str] | None = None, with_stack: bool = False, record_shapes: bool = False,
                    prefix: str | None = None) -> str:
        """Start a trace; returns the file it will be written to. Bad options are InvalidRequest."""
        if self.active:
            raise InvalidRequest("a profile is already running; POST /stop_profile first")
        if num_steps is not None and (isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1):
            raise InvalidRequest(f"num_steps must be a positive integer, got {num_steps!r}", param="num_steps")
        asked = list(activities) if activities is not None else ["CPU", "GPU"]
        unknown = [a for a in asked if a not in ACTIVITIES]
        if unknown or not asked:
            raise InvalidRequest(f"activities must be a non-empty list of {', '.join(ACTIVITIES)}; got {activities!r}",
                                 param="activities")
        kinds = [torch.profiler.ProfilerActivity.CPU]
        if "GPU" in asked and self.device.type == "cuda":
            kinds.append(torch.profiler.ProfilerActivity.CUDA)
        elif "GPU" in asked and activities is not None:  # asked for explicitly; the default just means "what there is"
            raise InvalidRequest(f"GPU activity needs a CUDA device; the engine runs on {self.device.type}",
                                 param="activities")
        if prefix is not None and (not prefix or len(prefix) > 100 or prefix in (".", "..")
                                   or any(c in prefix for c in "/\\\0")):
            raise InvalidRequest("profile_prefix must be a plain file-name part (1-100 characters, no '/', '\\' or NUL)",
                                 param="profile_prefix")
        directory = output_dir or os.environ.get("SGLANG_TORCH_PROFILER_DIR") or "/tmp"
        try:
            os.makedirs(directory, exist_ok=True)
        except (OSError, ValueError) as e:  # ValueError: a NUL byte in the path
            raise InvalidRequest(f"cannot create output_dir {directory!r}: {getattr(e, 'strerror', None) or e}",
                                 param="output_dir") from None
        if not os.access(directory, os.W_OK):
            raise InvalidRequest(f"output_dir {directory!r} is not writable", param="output_dir")
        name = f"{prefix or 'core'}-{time.strftime('%Y%m%d-%H%M%S')}-{time.time_ns() % 10**6:06d}.trace.json.gz"
        prof = torch.profiler.profile(activities=kinds, record_shapes=bool(record_shapes), with_stack=bool(with_stack),
                                      profile_memory="MEM" in asked)
        # taken before the await: a second /start_profile meanwhile sees it running
        self.prof, self.path, self.steps_left, self._stopping = prof, os.path.join(directory, name), num_steps, None
        self.started = False
        try:
            await asyncio.get_running_loop().run_in_executor(self.executor, prof.start)
        except BaseException:
            self.prof = self.path = self.steps_left = None
            raise
        self.started = True
        log.info("profile.started", path=self.path, num_steps=num_steps, activities=asked)
        return self.path

    def on_step(self, batch: Any, seconds: float) -> None:
        """A step listener: counts forwards, and stops the trace after ``num_steps`` of them."""
        if self.prof is None or not self.started or self.steps_left is None or self._stopping is not None:
            return
        self.steps_left -= 1
        if self.steps_left <= 0:
            self._stopping = asyncio.get_running_loop().run_in_executor(self.executor, self._finish)
            self._stopping.add_done_callback(lambda f: f.cancelled() or f.exception())  # logged in _finish

    async def stop(self) -> str:
        """Stop the running trace (or wait for one that is stopping by itself) and return its file."""
        if self.prof is None or not self.started:
            raise InvalidRequest("no profile is running; POST /start_profile first")
        if self._stopping is None:
            self._stopping = asyncio.get_running_loop().run_in_executor(self.executor, self._finish)
        return await self._stopping

    def _finish(self) -> str:
        """Stop and write the trace (on the forward thread). A failure to write is logged (an
        automatic stop has nobody to tell) and raised to a waiting /stop_profile."""
        prof, path = self.prof, self.path
        assert prof is not None and path is not None
        try:
            prof.stop()
            prof.export_chrome_trace(path)
            log.info("profile.written", path=path)
        except Exception as e:
            log.error("profile.write_failed", path=path, error=f"{type(e).__name__}: {e}")
            raise
        finally:
            self.prof, self.steps_left = None, None
        return path
