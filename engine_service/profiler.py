"""``start_profile`` / ``stop_profile``: a torch profiler trace of the engine's steps.

The trace (Chrome trace JSON, readable by Perfetto or chrome://tracing) is written to
``--profiler-dir`` as ``engine<index>-<time>.pt.trace.json`` when the profile stops.
Profiling runs on the engine's step thread, so it records exactly the steps run
between the two calls.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch


class ProfilerNotConfiguredError(RuntimeError):
    """start_profile without a profiler directory."""


class Profiler:
    def __init__(self, directory: str | None, engine_index: int) -> None:
        self.directory = directory
        self.engine_index = engine_index
        self._profile: Any = None

    @property
    def running(self) -> bool:
        return self._profile is not None

    def start(self) -> None:
        if not self.directory:
            raise ProfilerNotConfiguredError(
                "profiling is off: start the engine with --profiler-dir DIR (TANDEM_ENGINE_PROFILER_DIR)"
            )
        if self._profile is not None:
            return
        os.makedirs(self.directory, exist_ok=True)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profile = torch.profiler.profile(activities=activities, record_shapes=True)
        self._profile.__enter__()

    def stop(self) -> str:
        """Stop and write the trace; returns its path ('' when no profile was running)."""
        if self._profile is None:
            return ""
        profile, self._profile = self._profile, None
        profile.__exit__(None, None, None)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path = os.path.join(str(self.directory), f"engine{self.engine_index}-{stamp}.pt.trace.json")
        profile.export_chrome_trace(path)
        return path
