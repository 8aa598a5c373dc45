"""profile.enabled=true: torch.profiler over a few training steps.

Steps profile.start_step .. start_step + steps - 1 are recorded (the step before them warms the
profiler up and is thrown away), with CPU activity, CUDA kernels on a GPU, tensor memory and
the Python stack. Every rank writes its own trace, <run>/profile/rank<N>.<time>.pt.trace.json:
open it in https://ui.perfetto.dev or chrome://tracing, or see them all with TensorBoard
(`tensorboard --logdir <run>/profile`, with the torch-tb-profiler plugin). Rank 0 prints the
operations that took the most time.
"""

import logging
import re
from pathlib import Path

import torch
from omegaconf import DictConfig

log = logging.getLogger("ddp")
TRACE_DIR = "profile"
PYTHON_FRAME = re.compile(r"(.*\.py\(\d+\): |<built-in )")


class StepProfiler:
    """Call step() after every optimizer step and close() after the loop; does nothing when
    profiling is off."""

    def __init__(self, cfg: DictConfig, run_dir: Path, rank: int, device: torch.device,
                 steps_done: int):
        self.profiler = None
        if not cfg.profile.enabled:
            return
        first, active = cfg.profile.start_step, cfg.profile.steps
        if first <= steps_done:  # a resumed run already past it
            log.warning("profile: step %d is already done (resumed at step %d): nothing is "
                        "recorded; set profile.start_step after %d", first, steps_done,
                        steps_done)
            return
        from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

        self.top_ops, self.cuda = cfg.profile.top_ops, device.type == "cuda"
        self.profile_memory = cfg.profile.memory
        self.trace_dir = run_dir / TRACE_DIR
        self.rank = rank
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        handler = tensorboard_trace_handler(str(self.trace_dir), worker_name=f"rank{rank}")

        def ready(prof) -> None:
            handler(prof)  # every rank its own trace file
            self._print_table(prof)

        # Numbered as training steps: the profiler's step k (ProfilerStep#k in the trace) is
        # optimizer step k. Step first - 1 warms up (unless a resume began at `first`).
        self.profiler = profile(
            activities=activities,
            schedule=schedule(skip_first=first - 1, wait=0, warmup=1, active=active, repeat=1),
            on_trace_ready=ready, record_shapes=True, profile_memory=cfg.profile.memory,
            with_stack=cfg.profile.with_stack)
        self.profiler.step_num = steps_done + 1
        self.profiler.current_action = self.profiler.schedule(self.profiler.step_num)
        self.profiler.start()
        log.info("profile: recording steps %d-%d into %s", first, first + active - 1,
                 self.trace_dir)

    def step(self) -> None:
        if self.profiler is not None:
            self.profiler.step()

    def close(self) -> None:
        """Stop; a recording cut short by the end of training is written as it is."""
        if self.profiler is not None:
            self.profiler.stop()
            self.profiler = None

    def _print_table(self, prof) -> None:
        if self.rank != 0:
            return
        from torch.autograd.profiler_util import EventList

        sort = "self_cuda_time_total" if self.cuda else "self_cpu_time_total"
        # Operations only: with_stack also records Python frames, which would crowd them out.
        ops = EventList([event for event in prof.key_averages() if not PYTHON_FRAME.match(
            event.key)], use_device="cuda" if self.cuda else None,
            profile_memory=self.profile_memory)
        table = ops.table(sort_by=sort, row_limit=self.top_ops)
        log.info("profile: the top %d operations of rank 0 by %s (traces of every rank in "
                 "%s)\n%s", self.top_ops, sort, self.trace_dir, table)
