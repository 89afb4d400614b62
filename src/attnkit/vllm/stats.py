"""vLLM's own scheduler statistics of one engine, as its engine loop records them (no vLLM import).

``vllm.LLM.get_metrics()`` reads Prometheus' registry, which is one per process: with several engines in one process
(a benchmark comparing them side by side, a test module) the latest engine's collectors replace the others'.
:class:`SchedulerWatch` reads the same numbers (``SchedulerStats.num_running_reqs``, ``kv_cache_usage``,
``IterationStats.num_preempted_reqs``) where the engine hands them to its stat loggers.
"""

from __future__ import annotations

from dataclasses import dataclass

from attnkit.errors import AttnkitError


@dataclass
class SchedulerWatch:
    """The latest running requests and KV-cache usage of one engine, the peak and the mean over engine steps of the
    former since :meth:`reset`, and preemptions. The mean is the fairer figure of capacity: vLLM admits requests while
    their prompts fit and preempts later, so an engine short of KV space may still reach a high peak for a moment."""

    running: int = 0
    peak_running: int = 0
    kv_cache_usage: float = 0.0
    preemptions: int = 0
    running_sum: int = 0
    steps: int = 0

    @property
    def mean_running(self) -> float:
        return self.running_sum / max(self.steps, 1)

    @classmethod
    def attach(cls, llm) -> SchedulerWatch:
        """Watch the engine of ``vllm.LLM`` `llm` (made with ``disable_log_stats=False``) from now on."""
        manager = llm.llm_engine.logger_manager
        if manager is None:
            raise AttnkitError("the engine keeps no statistics; build it with disable_log_stats=False")
        watch, record = cls(), manager.record

        def recording(*args, **kwargs):
            scheduler, iteration = kwargs.get("scheduler_stats"), kwargs.get("iteration_stats")
            if scheduler is not None:
                watch.running, watch.kv_cache_usage = scheduler.num_running_reqs, scheduler.kv_cache_usage
                watch.peak_running = max(watch.peak_running, watch.running)
                watch.running_sum, watch.steps = watch.running_sum + watch.running, watch.steps + 1
            if iteration is not None:
                watch.preemptions += iteration.num_preempted_reqs
            return record(*args, **kwargs)

        manager.record = recording
        return watch

    def reset(self) -> None:
        """Start the peak and the mean anew."""
        self.peak_running, self.running_sum, self.steps = self.running, 0, 0
