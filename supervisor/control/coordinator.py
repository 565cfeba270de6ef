"""The checkpoint coordinator: what the controller asks of checkpoints, on top of the recover store.

Loading the last valid recover checkpoint (falling back past damaged ones, cleaning up interrupted saves),
saving one (the ranks write shards into a staging directory, the store publishes and commits it), HF
exports with their retention, the writes still in flight in the background (at most one recover save and
one export, like TorchTitan's staging and upload futures), and the cleanup after a save that failed on
storage. The files themselves are written by the TrainGroup and published by checkpoint/store.py; this
module only orders the work and logs it.
"""
from __future__ import annotations

import enum
import errno
import hashlib
import time
from dataclasses import dataclass, field
from typing import Callable, TypeVar

from supervisor.checkpoint.durable import tmp_name
from supervisor.checkpoint.exports import export_temporaries, prune_exports, publish_export, restore_cut_short
from supervisor.checkpoint.layout import (
    REFERENCE_PREFIX,
    RUN_CONFIG,
    StoragePath,
    TrialLayout,
    reference_file,
)
from supervisor.checkpoint.storage import StoreUnavailable, retry_budget, storage_for
from supervisor.checkpoint.store import Checkpoint, CheckpointError, RecoverStore, RolePart, compatibility_error
from supervisor.config import Config, RoleName
from supervisor.control.events import Event, EventLog
from supervisor.control.step_info import StepInfo
from supervisor.control.watchdog import Waits
from workers.engines.reference import reference_step


@dataclass
class Staged:
    """A recover save that every rank has begun or written, not yet published. A background save's `files`
    lack the ranks' shards until `collect_save` finds them durable."""
    path: StoragePath
    global_step: int
    files: dict[str, dict]
    world_size: int
    nbytes: int
    secs: float                  # training blocked this long (the whole write, for a synchronous save)
    background: bool = False
    infos: dict | None = None    # the recover_info of the save's step, captured when it was staged
    started: float = 0.0         # time.monotonic() when it began
    checksum: str | None = None  # of the step's weights, for the commit event
    roles: dict[str, RolePart] = field(default_factory=dict)  # the other roles' parts (PPO's critic), written


@dataclass
class PendingExport:
    """An HF export being written in the background under a temporary name."""
    path: StoragePath
    final: StoragePath
    global_step: int


class WriteKind(str, enum.Enum):
    SAVE = "save"      # a recover save
    EXPORT = "export"  # an HF export


@dataclass
class InFlight:
    """The background writes not yet published, and which of them just failed (the controller decides)."""
    save: Staged | None = None
    export: PendingExport | None = None
    failed: WriteKind | None = None

    @property
    def idle(self) -> bool:
        return self.save is None and self.export is None

    def failed_step(self) -> int | None:
        """The global step of the write that failed, if one did."""
        if self.failed is None:
            return None
        return (self.save if self.failed is WriteKind.SAVE else self.export).global_step

    def live_paths(self) -> tuple[StoragePath, ...]:
        """The directories of writes still going on (not the one that failed)."""
        live = [(self.save, WriteKind.SAVE), (self.export, WriteKind.EXPORT)]
        return tuple(w.path for w, kind in live if w is not None and self.failed is not kind)


T = TypeVar("T")
CLEANUP_RETRY_SECS = 1.0  # how long the cleanup after a failed save retries a storage call


class CheckpointCoordinator:
    def __init__(self, config: Config, layout: TrialLayout, events: EventLog, waits: Waits | None = None,
                 fence: Callable[[], None] | None = None):
        self.config, self.layout, self.events = config, layout, events
        self.fence = fence  # raises LockLost when the trial's lock is no longer surely this run's
        # the Supervisor's own file work, each bounded for the driver's watchdog (a hung mount blocks in the kernel)
        self.waits = waits or Waits()
        self.fs = storage_for(layout.checkpoint_root, retry_budget(config))  # a local directory or an object store
        self.store = RecoverStore(layout, config.recover.keep_last, self.fs) if config.recover.mode.enabled else None
        self._reference_entries: dict[int, dict] = {}  # reference step -> its manifest entry
        self.in_flight = InFlight()
        self.last_commit: int | None = None  # the newest step committed or loaded by this Supervisor

    @property
    def enabled(self) -> bool:
        return self.store is not None

    def load_last_valid(self) -> Checkpoint | None:
        """The last valid checkpoint (falling back past damaged ones), after cleaning up interrupted saves.
        Raises CheckpointError when checkpoints were committed but none is valid."""
        if self.store is None:
            return None
        # reading back (and hashing) a checkpoint is bounded like writing one
        with self.waits.on("the validation of the last checkpoint", self.config.recover.write_timeout_secs):
            self.store.wait_for_pruning()
            result = self.store.load_latest()
        for reason in result.fallbacks:
            self.events.emit(Event.FALLBACK, reason=reason)
        ckpt = result.checkpoint
        self.last_commit = ckpt.global_step if ckpt is not None else None
        for role, section in self.config.trained.items() if ckpt is not None else ():
            problem = compatibility_error(ckpt.manifest, section.backend.value, self.config.workers_of(role), role,
                                          self.config.workers_key(role))
            if problem:
                raise CheckpointError(f"{ckpt.path}: {problem}")
        removed, set_aside = self.store.remove_leftovers(ckpt.global_step if ckpt else None)
        if removed or set_aside:
            self.events.emit(Event.CLEANUP, removed=[str(p) for p in removed], set_aside=[str(p) for p in set_aside])
        if ckpt is not None:
            self.store.restore_mirror(ckpt)
            if ckpt.manifest.get("config_hash") != self.config.resume_hash():
                self.events.emit(Event.WARNING,
                                 message="the config that matters for resume changed since this checkpoint")
        return ckpt

    def write_recover(self, trainers, s: StepInfo, infos: dict, background: bool = False, critics=None) -> Staged:
        """Every rank writes its part of step `s` into a staging directory (the Supervisor's own state goes into
        meta/ at the commit); nothing is published yet. With `background`, returns once the ranks have
        staged their state in CPU memory (their uploads start only once every file the Supervisor checks is
        written): `collect_save` commits it once durable. `critics` (PPO; never in the background): the critic's
        ranks write their part into a staging directory of its own first, published under the same commit."""
        started = time.monotonic()
        roles = {}
        if critics is not None:
            part = self.store.staging_dir(s.global_step, RoleName.CRITIC)
            critic_files = critics.save_recover(str(part), s.global_step)
            roles[RoleName.CRITIC] = RolePart(part, critic_files, critics.world_size, self.config.critic.backend.value)
        staging = self.store.staging_dir(s.global_step)
        data = self.config.model_dump_json(indent=1).encode()
        self.fs.write_bytes(staging / RUN_CONFIG, data)  # before the ranks write
        run_config = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        if background:
            trainers.begin_save(str(staging), s.global_step)
            files = {}
        else:
            files = trainers.save_recover(str(staging), s.global_step)
        actor = self.config.actor
        ref_step = reference_step(s.global_step, actor.ref_update_steps) if actor.kl_coef else None
        if ref_step is not None:  # the reference weights this step needs, written on the step they changed
            ref = reference_file(staging.parent, ref_step)
            if not self.fs.is_file(ref):
                raise OSError(errno.EIO, "rank 0 did not write the reference weights (is cluster.fileroot on "
                                         "storage every node sees?)", str(ref))
            # hashed when it was written (a replayed refresh step rewrites it), not on every save that names it
            if ref_step == s.global_step or ref_step not in self._reference_entries:
                self._reference_entries = {ref_step: {"size": self.fs.size(ref), "sha256": self.fs.digest(ref)}}
            files[REFERENCE_PREFIX + ref.name] = self._reference_entries[ref_step]
        files[RUN_CONFIG] = run_config
        if background:  # every rank's part that needs no peer is written, and checked: now the uploads start
            trainers.start_upload(s.global_step)
        # bytes this save wrote: a reference file written on an earlier step is only named, not rewritten
        nbytes = sum(f["size"] for name, f in files.items()
                     if not name.startswith(REFERENCE_PREFIX) or ref_step == s.global_step)
        nbytes += sum(f["size"] for part in roles.values() for f in part.files.values())
        return Staged(staging, s.global_step, files, trainers.world_size, nbytes, time.monotonic() - started,
                      background, infos, started, roles=roles)

    def begin_background_save(self, staged: Staged, weights_checksum: str | None) -> None:
        """A save every rank has staged: committed by `collect_save` once it is durable. One in flight."""
        staged.checksum = weights_checksum
        self.in_flight.save = staged

    def collect_save(self, trainers, block: bool) -> None:
        """Commit the background save once every rank's part is durable (with `block`, wait for it). Its step's
        export, if still being written, is published first: the save's recover_info says it is done."""
        staged, export = self.in_flight.save, self.in_flight.export
        if staged is None:
            return
        if export is not None and export.global_step <= staged.global_step:
            self.collect_export(trainers, block)
            if self.in_flight.export is not None:
                return
        def commit() -> bool:
            parts = trainers.save_result(staged.global_step, block)
            if parts is None:
                return False
            staged.files.update(parts)
            staged.nbytes += sum(f["size"] for f in parts.values())
            self.commit_recover(staged, staged.checksum)
            return True

        if self._watch(WriteKind.SAVE, commit):
            self.in_flight.save = None

    def collect_export(self, trainers, block: bool) -> None:
        """Publish the background export once rank 0 has written it (with `block`, wait for it)."""
        pending = self.in_flight.export

        def publish() -> bool:
            if not trainers.export_result(pending.global_step, block):
                return False
            self._publish_export(pending)
            return True

        if pending is not None and self._watch(WriteKind.EXPORT, publish):
            self.in_flight.export = None

    def collect(self, trainers, block: bool) -> None:
        """Publish the background writes that are done; with `block` (after the last step), wait for them and for
        the retention they started, so a finished run leaves `recover.keep_last` steps (on an object store,
        where deleting takes a while, too)."""
        self.collect_export(trainers, block)
        self.collect_save(trainers, block)
        if block and self.store is not None and self.in_flight.idle:
            self.store.wait_for_pruning()

    def _watch(self, kind: WriteKind, result: Callable[[], T]) -> T:
        """A background write's result and its publication; if either raises (a rank's write, or the
        Supervisor's own commit on a full disk), that write is marked failed for the controller."""
        try:
            return result()
        except Exception:
            self.in_flight.failed = kind
            raise

    def skip_failed_write(self) -> str | None:
        """After a background write failed on storage: give it up; returns what was skipped."""
        kind, self.in_flight.failed = self.in_flight.failed, None
        if kind is WriteKind.SAVE:
            self.in_flight.save = None
        elif kind is WriteKind.EXPORT:
            self.in_flight.export = None
        return f"{'recover' if kind is WriteKind.SAVE else 'export'} (background)" if kind else None

    def drop_in_flight(self, keep_export: bool = False) -> None:
        """The ranks writing them are gone: background writes die unpublished (the run falls back). With
        `keep_export`, rank 0 lives on (a repair from memory): its export is still written and published."""
        self.in_flight = InFlight(export=self.in_flight.export if keep_export else None)

    def commit_recover(self, staged: Staged, weights_checksum: str | None) -> None:
        """Publish and commit a fully written save with the recover_info captured at its step."""
        s, started = staged.global_step, time.monotonic()
        with self.waits.on(f"the commit of step {s}", self.config.recover.step_timeout_secs):
            if self.fence is not None:
                self.fence()
            path = self.store.commit(staged.path, s, staged.world_size, self.config.resume_hash(),
                                     staged.files, staged.infos, engine=self.config.actor.backend.value,
                                     roles=staged.roles)
        self.last_commit = s
        secs = (started - staged.started if staged.background else staged.secs) + time.monotonic() - started
        self.events.emit(Event.COMMIT, global_step=s, path=str(path), world_size=staged.world_size,
                         weights_checksum=weights_checksum, bytes=staged.nbytes, secs=round(secs, 3),
                         blocked_secs=round(staged.secs, 3), background=staged.background,
                         mbps=round(staged.nbytes / max(secs, 1e-9) / 1e6, 3))

    def export_hf(self, trainers, s: StepInfo, background: bool = False, critics=None) -> None:
        """A HuggingFace directory for this step, appearing complete or not at all; old ones pruned. With
        `background`, returns once rank 0 holds the full weights: `collect_export` publishes it when written.
        One export in flight: the previous one is waited for first. A replayed step is exported again: its
        weights may differ from the abandoned timeline's (checkpoint/exports.py). `critics` (PPO): the critic's
        value model is exported too, first and in the step, into critic/ beside the policy's default/ (a
        token-classification model of one label), published and pruned as the policy's are."""
        self.collect_export(trainers, block=True)
        if critics is not None:
            final = self.layout.export_dir(s.epoch, s.epoch_step, s.global_step, RoleName.CRITIC)
            self.fs.mkdir(final.parent)
            pending = PendingExport(tmp_name(final), final, s.global_step)
            critics.export_hf(str(pending.path), s.global_step)
            self._publish_export(pending, RoleName.CRITIC)
        final = self.layout.export_dir(s.epoch, s.epoch_step, s.global_step)
        self.fs.mkdir(final.parent)
        pending = PendingExport(tmp_name(final), final, s.global_step)
        if background:
            trainers.begin_export(str(pending.path), s.global_step)
            self.in_flight.export = pending
            return
        trainers.export_hf(str(pending.path), s.global_step)
        self._publish_export(pending)

    def _publish_export(self, pending: "PendingExport", role: RoleName = RoleName.ACTOR) -> None:
        with self.waits.on(f"the publication of step {pending.global_step}'s export",
                           self.config.recover.step_timeout_secs):
            outcome = publish_export(self.fs, pending.path, pending.final)
        self.events.emit(Event.EXPORT, global_step=pending.global_step, path=str(pending.final),
                         outcome=outcome.value, **({"group": role.value} if role is not RoleName.ACTOR else {}))
        if self.config.saver.keep_last:
            prune_exports(self.fs, pending.final.parent, self.config.saver.keep_last)

    def committed_step(self) -> int | None:
        """The step checkpoint_info.json names, read without validating anything (None: no checkpoint)."""
        return self.store.committed_step() if self.store is not None else None

    def committed_already(self, global_step: int) -> bool:
        """Whether `global_step` or a later step is committed: a step trained again after a rollback from memory
        to a step older than the last commit (its copy had not landed when a rank died). Its checkpoint stands,
        since the redo is bitwise the step it saved, and a published step directory is never written again."""
        return self.last_commit is not None and self.last_commit >= global_step

    def discard_failed_save(self) -> list[StoragePath]:
        """Remove the temporaries a save or export that failed left behind, but for the directories of background
        saves and exports still being written; no step directory is touched, whatever the pointer says. Best
        effort, its calls retried for CLEANUP_RETRY_SECS only: a temporary is never loaded, and the next failed
        save or start removes what is left. (A store that is down already spent a retry budget failing the save;
        a second one, here, would hold the step up as long again.)"""
        live = self.in_flight.live_paths()
        fs = storage_for(self.layout.checkpoint_root, CLEANUP_RETRY_SECS)
        try:
            if self.store is not None:
                return RecoverStore(self.layout, self.config.recover.keep_last, fs).remove_temporaries(spare=live)
            for root in self.layout.export_roots:
                restore_cut_short(fs, root)
            removed = [p for root in self.layout.export_roots for p in export_temporaries(fs, root) if p not in live]
            for p in removed:
                fs.remove(p)
            return removed
        except StoreUnavailable:
            return []
