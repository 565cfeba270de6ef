"""The job log: one line per decision, each saying where the run stands.

Ray forwards the Supervisor's stdout to the driver interleaved with every other actor's, so each line says
on its own which step, which phase and which life of the Supervisor (attempt) it comes from:
`[relaunch] step 9 (train, attempt 0): worker_died: ... -> restart 1/3 after worker_died`.
The full record of the same decisions is events.jsonl; this is for people watching the job.
"""
from __future__ import annotations

import logging
import sys

FORMAT = "[relaunch] step %(step)s (%(phase)s, attempt %(attempt)s): %(message)s"


class RunLog(logging.LoggerAdapter):
    """Adds the attempt to the `step` and `phase` each call passes in `extra`."""

    def process(self, msg, kwargs):
        kwargs["extra"] = {**self.extra, **kwargs.get("extra", {})}
        return msg, kwargs


def run_log(attempt: int) -> RunLog:
    """A logger whose lines carry `attempt`; each call passes `step` and `phase` in `extra`."""
    logger = logging.getLogger("relaunch.run")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter(FORMAT))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False  # Ray's own log setup must not print the line a second time
    return RunLog(logger, {"attempt": attempt})
