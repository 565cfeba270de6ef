"""The fleet: the TrainGroup, the critic's group (PPO), the engines, and the weights between them, in one owner.

The weight stream (cluster/weights.py) joins these trainers to these engines; the digest of the trainer's weights
at a version, and the version every engine holds, are facts about that pair of groups and are forgotten with
either. The controller replaces groups in the fleet (a repair), the step runner steps on it (rollouts, updates,
the sync after each commit); neither reaches into the other's state for them. An engine kind plugs in behind
RolloutGroup (cluster/groups.py) and the workers' sync (workers/weight_sync.py): nothing here knows which it is.
"""
from __future__ import annotations

from supervisor.cluster.errors import Group, GroupError
from supervisor.config import RoleName
from supervisor.control.events import Event, EventLog
from workers.errors import StaleWeights

KEPT_DIGESTS = 4  # versions whose digest is remembered: a repair from memory rolls back one or two steps


class RestoredWeightsDiffer(RuntimeError):
    """Weights restored from memory that do not hash to what the trainers held at that version before the fault."""


class Fleet:
    def __init__(self, events: EventLog):
        self.events = events
        self.trainers = None  # the TrainGroup, once started
        self.critics = None   # the critic's TrainGroup (PPO), once started; None in a GRPO job
        self.engines = None   # the RolloutGroup, once started
        self.stream = None    # the weights-update group of these trainers and engines
        self.digest: tuple[int, str] | None = None  # (version, digest) of the trainer's weights, from a sync
        self.digests: dict[int, str] = {}  # version -> the digest the trainers had at it, for the last few versions
        self.engine_version: int | None = None      # the version every engine holds, when known

    def group(self, role: RoleName):
        """`role`'s TrainGroup, or None while it is not running."""
        return self.trainers if role is RoleName.ACTOR else self.critics

    def weights_checksum(self, version: int) -> str:
        """The digest of the trainer's weights at `version`: the one its last sync computed, or (after a repair
        that pushed nothing) a pass that only computes it."""
        if self.digest is None or self.digest[0] != version:
            self._hashed(version, self._stream().sync(version - 1, only=[])["digest"])
        return self.digest[1]

    def _hashed(self, version: int, digest: str) -> None:
        self.digest, self.digests[version] = (version, digest), digest
        self.digests = {v: d for v, d in self.digests.items() if v > version - KEPT_DIGESTS}

    def restored_from_memory(self, version: int) -> None:
        """The TrainGroup rolled back to a copy in memory, at `version`: its weights are hashed again at the next
        resync and must match what they were at that version before the fault (a copy that does not restore them
        exactly is a failed repair, not a run that drifts). The later versions' digests go: they are hashed again."""
        self.digest = None
        self.digests = {v: d for v, d in self.digests.items() if v <= version}

    def sync_engines(self, version: int, gate: bool) -> dict:
        """Bring every engine to the trainer's `version`; returns the sync's figures. With `gate` (after a repair,
        over a new group), stream only to the engines that do not hold that version and digest already, and
        require every engine to report the trainer's version and digest."""
        self.engine_version = None
        if gate:
            self.close_stream()
        try:
            if not gate:
                sent = self._stream().sync(version - 1)
            else:
                known = self.digest[1] if self.digest and self.digest[0] == version else None
                stale = [i for i, (v, d) in enumerate(self.engines.weight_status())
                         if v != version or (known is not None and d != known)]
                sent = self._stream().sync(version - 1, only=stale) if stale or known is None else None
            if sent is not None:
                expected = self.digests.get(version)
                if gate and expected is not None and sent["digest"] != expected:
                    raise RestoredWeightsDiffer(f"the trainers' weights at version {version} hash to "
                                                f"{sent['digest']} after the repair, not {expected} as before it")
                self._hashed(version, sent["digest"])
        except Exception:
            self.close_stream()
            raise
        if gate:
            want = (version, self.digest[1])
            status = [tuple(st) for st in self.engines.weight_status()]
            if any(st != want for st in status):
                raise GroupError(Group.ROLLOUT, StaleWeights(f"engines disagree with the trainer after resync: "
                                                             f"{status} != {want}"))
            self.events.emit(Event.RESYNC, version=version, checksum=self.digest[1], engines=len(status),
                             pushed=len(stale))
        self.engine_version = version
        return sent or {}

    def _stream(self):
        if self.stream is None:
            self.stream = self.engines.connect(self.trainers)
        return self.stream

    def close_stream(self) -> None:
        """Forget the weights-update group: the next sync makes a new one (after a repair, or a failed sync)."""
        if self.stream is not None:
            self.stream.close()
        self.stream = None

    def drop_trainers(self, keep: bool = False) -> None:
        """Kill the TrainGroup (survivors may be stuck in a collective), or with `keep` leave it to a regroup: its
        weights stream to the engines and the digest of its weights go (the next weights are a checkpoint's)."""
        if self.trainers is not None and not keep:
            self.trainers.shutdown()
            self.trainers = None
        self.digest, self.digests = None, {}
        self.close_stream()

    def drop_critics(self) -> None:
        """Kill the critic's group (its ranks may be stuck in a collective); its weights go nowhere."""
        if self.critics is not None:
            self.critics.shutdown()
            self.critics = None

    def shutdown(self) -> None:
        """End every group, best effort: the run is ending."""
        self.close_stream()
        for group in (self.trainers, self.critics, self.engines):
            try:
                if group is not None:
                    group.shutdown()
            except Exception:  # noqa: BLE001 - best effort at the end of the run
                pass
        self.trainers = self.critics = self.engines = None
