"""The process exit codes of every relaunch command, in one place (documented in docs/cli.md)."""
from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    OK = 0
    FAILED = 1        # the job failed: retries exhausted, or a user-code error
    BAD_INPUT = 2     # bad usage or input: config, checkpoint, file; nothing was started or lost
    INTERRUPTED = 130  # Ctrl-C: the last valid checkpoint is kept
    TERMINATED = 143  # SIGTERM: stopped at a step boundary, saved there (or, past recover.term_grace_secs, abandoned)
