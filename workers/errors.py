"""What a worker raises on purpose, for the Supervisor's classifier to read (supervisor/control/classify.py)."""
from __future__ import annotations


class UserCodeError(RuntimeError):
    """The user's reward function or dataset failed: not an infrastructure fault, never retried."""


class StaleWeights(RuntimeError):
    """Raised by an engine asked to generate with weights of another version than it holds."""


class WeightSyncError(RuntimeError):
    """A weight sync that did not complete (a transfer broke, or a bucket's digest disagreed): the engine
    holds no version until a new sync completes."""


class TransferTimedOut(WeightSyncError):
    """An engine waited a transfer's whole timeout and its sender sent nothing: the error of one left waiting,
    not of the one at fault (a stopped engine holds up the sender, and the others time out). The Supervisor
    blames those that never answered first (supervisor/cluster/blame.py)."""


class ShardWriteError(RuntimeError):
    """A trainer rank could not write its shards into an engine's shared weights (workers/weight_sync.py). Every
    rank raises it together. Nothing of the infrastructure fails there (the memory is mapped and sealed): it
    is a bug in relaunch that a retry would only repeat, so it is classified an internal error (fail fast)."""
