"""Every failure classified: whatever comes out of a worker call becomes one fault kind. Pure.

The worker groups wrap what a call raised in `GroupError`, naming the group, the actor and its node; the
controller turns it into a `Fault` here and routes it to the group it came from. Only an error that is none
of the known kinds (a bug in relaunch itself) is an internal error.
"""
from __future__ import annotations

import enum
import errno
import sys
from dataclasses import dataclass
from typing import Optional

from ray import exceptions as rex

from supervisor.cluster.errors import Group, GroupError, first_line
from workers.errors import StaleWeights, UserCodeError, WeightSyncError


class FaultKind(str, enum.Enum):
    WORKER_DIED = "worker_died"              # a TrainWorker process or its node is gone
    ENGINE_DIED = "engine_died"              # a RolloutWorker process or its node is gone
    HANG = "hang"                            # no answer within recover.step_timeout_secs
    COLLECTIVE_FAILED = "collective_failed"  # gloo/NCCL raised because a peer died inside a collective (the weight
                                             # stream's included)
    DEVICE_ERROR = "device_error"            # a CUDA error or out of device memory: the device is unusable
    OBJECT_LOST = "object_lost"              # an object (a call's result) was lost with its node
    STALE_WEIGHTS = "stale_weights"          # an engine refused a call for another weights version
    STORAGE_ERROR = "storage_error"          # disk full, permissions, I/O: a save or export failed
    USER_ERROR = "user_error"                # the reward function or dataset raised
    RUNTIME_ENV = "runtime_env_failed"       # Ray could not set up a worker's runtime env (pip, working dir)
    START_FAILED = "start_failed"            # a worker's constructor raised (an engine its config cannot build)
    SUPERVISOR_DIED = "supervisor_died"      # Ray restarted the Supervisor actor
    INTERNAL_ERROR = "internal_error"        # a bug in relaunch itself


@dataclass(frozen=True)
class Fault:
    kind: FaultKind
    message: str
    group: Group = Group.TRAIN
    actors: tuple[str, ...] = ()     # the actors at fault (the dead or hung ones), when known
    node: Optional[str] = None
    detect_secs: Optional[float] = None
    settled: bool = False            # the failed call's peers all finished: the group is not stuck
    in_save: bool = False            # it struck while the step was saving (a recover save or an HF export)
    node_lost: bool = False          # the actor died and Ray has its node dead

    @property
    def actor(self) -> Optional[str]:
        return self.actors[0] if self.actors else None


# Ray's ways of saying an actor, its process or its node is gone (or unusable: its object store is full)
_DEATHS = (rex.ActorDiedError, rex.ActorUnavailableError, rex.RayActorError, rex.WorkerCrashedError,
           rex.NodeDiedError, rex.OutOfMemoryError, rex.LocalRayletDiedError, rex.RaySystemError,
           rex.ObjectStoreFullError)
_STORAGE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS, errno.EIO, errno.ESTALE}
_PEER_MARKERS = ("connection reset by peer", "connection closed by peer", "broken pipe", "connection refused")
# torch.save reports a full disk as a RuntimeError from its zip writer
_STORAGE_MARKERS = ("no space left", "disk quota", "unexpected pos", "pytorchstreamwriter failed", "read-only file")
_DEVICE_MARKERS = ("cuda error", "cudnn", "cublas", "device-side assert", "ecc error")
# a constructor's errors that a new try on another port or another moment can cure
_TRANSIENT_START_MARKERS = _PEER_MARKERS + ("address already in use", "timed out", "temporarily unavailable")


def _is_torch(error: BaseException, module: str, name: str) -> bool:
    """Whether `error` is torch's `module.name`, without importing torch here (seconds, for every CLI command
    that reads events): an error of that type exists in this process only if its module was loaded already."""
    kind = getattr(sys.modules.get(module), name, None)
    return kind is not None and isinstance(error, kind)


def root_cause(error: BaseException) -> BaseException:
    """The exception a worker raised, unwrapped from Ray's RayTaskError (nested calls included)."""
    while isinstance(error, rex.RayTaskError) and error.cause is not None and error.cause is not error:
        error = error.cause
    return error


def storage_cause(error: BaseException, in_dcp: bool = False) -> Optional[OSError]:
    """The OSError behind a storage failure: a plain OSError, or one wrapped by DCP's CheckpointException
    (inside which a missing file or directory is the storage's fault too, not a bug)."""
    if _is_torch(error, "torch.distributed.checkpoint.api", "CheckpointException"):
        for failure in error.failures.values():
            inner = failure[0] if isinstance(failure, tuple) else failure
            found = storage_cause(inner, in_dcp=True) if isinstance(inner, BaseException) else None
            if found is not None:
                return found
        return None
    errnos = _STORAGE_ERRNOS | {errno.ENOENT} if in_dcp else _STORAGE_ERRNOS
    if isinstance(error, OSError) and (error.errno in errnos or "No space left" in str(error)):
        return error
    if isinstance(error, RuntimeError) and any(m in str(error).lower() for m in _STORAGE_MARKERS):
        return OSError(errno.ENOSPC, first_line(error))
    return None


def classify(err: GroupError | BaseException) -> Fault:
    """One fault kind for what a call raised; bare exceptions come from the Supervisor's own code."""
    if not isinstance(err, GroupError):
        err = GroupError(Group.SUPERVISOR, err, settled=True)
    group, actors, node, waited = err.group, err.actors, err.node, err.waited
    cause = root_cause(err.error)
    who = actors[0] if actors else group.value

    def fault(kind: FaultKind, message: str) -> Fault:
        return Fault(kind, message, group, actors, node, waited, err.settled, node_lost=err.node_lost)

    if isinstance(cause, UserCodeError):
        return fault(FaultKind.USER_ERROR, first_line(cause))
    if isinstance(cause, rex.RuntimeEnvSetupError):  # the policy decides: the user's env, or a transient failure
        return fault(FaultKind.RUNTIME_ENV, f"{who}: {first_line(cause)}")
    if isinstance(cause, rex.OutOfDiskError):
        return fault(FaultKind.STORAGE_ERROR, f"{who}: {first_line(cause)}")
    if isinstance(cause, rex.GetTimeoutError) or isinstance(err.error, rex.GetTimeoutError):
        return fault(FaultKind.HANG, f"no answer from {', '.join(actors) or who} after {waited or 0:.0f}s")
    if isinstance(cause, rex.ObjectLostError):  # OwnerDiedError, ObjectReconstructionFailedError, ...
        return fault(FaultKind.OBJECT_LOST, f"{who}: {first_line(cause)}")
    if isinstance(cause, rex.RayActorError) and cause.actor_init_failed:
        raised = last_line(cause)  # Ray keeps the constructor's exception as text only: its last line names it
        if not any(m in raised.lower() for m in _TRANSIENT_START_MARKERS):
            return fault(FaultKind.START_FAILED, f"{who} failed to start: {raised}")
    if isinstance(cause, _DEATHS):
        kind = FaultKind.ENGINE_DIED if group is Group.ROLLOUT else FaultKind.WORKER_DIED
        return fault(kind, f"{who} died: {first_line(cause)}")
    if isinstance(cause, StaleWeights):
        return fault(FaultKind.STALE_WEIGHTS, f"{who}: {first_line(cause)}")
    stored = storage_cause(cause)
    if stored is not None:
        return fault(FaultKind.STORAGE_ERROR, f"{who}: {stored.strerror or first_line(stored)}"
                                              f"{f' ({stored.filename})' if stored.filename else ''}")
    text = str(cause).lower()
    if _is_torch(cause, "torch", "OutOfMemoryError") or \
            (isinstance(cause, RuntimeError) and any(m in text for m in _DEVICE_MARKERS)):
        return fault(FaultKind.DEVICE_ERROR, f"{who}: {first_line(cause)}")
    if _is_torch(cause, "torch.distributed", "DistError") or isinstance(cause, WeightSyncError) or \
            (isinstance(cause, RuntimeError) and any(m in text for m in _PEER_MARKERS)):
        return fault(FaultKind.COLLECTIVE_FAILED, f"{who}: {first_line(cause)}")
    return fault(FaultKind.INTERNAL_ERROR, f"{who}: {type(cause).__name__}: {first_line(cause)}")


def last_line(error: BaseException) -> str:
    """The last non-empty line of an error's text (a traceback's: the exception and its message)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__
