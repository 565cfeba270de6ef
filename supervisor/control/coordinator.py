"""The checkpoint coordinator: what the controller asks of checkpoints, on top of the recover store.

Loading the last valid recover checkpoint (falling back past damaged ones, cleaning up interrupted saves),
saving one (the ranks write shards into a staging directory, the store publishes and commits it), HF
exports with their retention, and the cleanup after a save that failed on storage. The files themselves
are written by the TrainGroup and published by recovery.py; this module only orders the work and logs it.
"""
from __future__ import annotations

import errno
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from supervisor.checkpoint.durable import file_digest, publish_dir, tmp_name
from supervisor.checkpoint.layout import TMP_PREFIX, TrialLayout
from supervisor.checkpoint.store import (
    REFERENCE_PREFIX,
    RUN_CONFIG,
    Checkpoint,
    CheckpointError,
    RecoverStore,
    compatibility_error,
)
from supervisor.control.events import EventLog
from supervisor.control.step_info import StepInfo
from workers.engines.reference import reference_file, reference_step


@dataclass
class Staged:
    """A recover save that every rank has begun or written, not yet published. A background save's `files`
    lack the ranks' shards until `collect_recover` finds them durable."""
    path: Path
    global_step: int
    files: dict[str, dict]
    world_size: int
    nbytes: int
    secs: float                  # training blocked this long (the whole write, for a synchronous save)
    background: bool = False
    infos: dict | None = None    # the recover_info of the save's step, captured when it was staged
    started: float = 0.0         # time.monotonic() when it began
    checksum: str | None = None  # of the step's weights, for the commit event


@dataclass
class PendingExport:
    """An HF export being written in the background under a temporary name."""
    path: Path
    final: Path
    global_step: int


class CheckpointCoordinator:
    def __init__(self, config, layout: TrialLayout, events: EventLog):
        self.config, self.layout, self.events = config, layout, events
        self.store = RecoverStore(layout, config.recover.keep_last) if config.recover.mode.enabled else None
        self._reference_entries: dict[int, dict] = {}  # reference step -> its manifest entry

    @property
    def enabled(self) -> bool:
        return self.store is not None

    def load_last_valid(self) -> Checkpoint | None:
        """The last valid checkpoint (falling back past damaged ones), after cleaning up interrupted saves.
        Raises CheckpointError when checkpoints were committed but none is valid."""
        if self.store is None:
            return None
        self.store.wait_for_pruning()
        result = self.store.load_latest()
        for reason in result.fallbacks:
            self.events.emit("fallback", reason=reason)
        ckpt = result.checkpoint
        if ckpt is not None:
            problem = compatibility_error(ckpt.manifest, self.config.actor.backend.value,
                                          self.config.cluster.n_train_workers)
            if problem:
                raise CheckpointError(f"{ckpt.path}: {problem}")
        removed = self.store.remove_leftovers(ckpt.global_step if ckpt else None)
        if removed:
            self.events.emit("cleanup", removed=[str(p) for p in removed])
        if ckpt is not None:
            self.store.restore_mirror(ckpt)
            if ckpt.manifest.get("config_hash") != self.config.resume_hash():
                self.events.emit("warning", message="the config that matters for resume changed since this checkpoint")
        return ckpt

    def write_recover(self, trainers, s: StepInfo, infos: dict, background: bool = False) -> Staged:
        """Every rank writes its part of step `s` (rank 0 also the driver state: dataloader and data state)
        into a staging directory; nothing is published yet. With `background`, returns once the ranks have
        staged their state in CPU memory: `collect_recover` tells when the write is durable."""
        started = time.monotonic()
        staging = self.store.staging_dir(s.global_step)
        driver_state = {"dataloader": infos["dataloader_info.pkl"], "global_step": s.global_step}
        (staging / RUN_CONFIG).write_text(self.config.model_dump_json(indent=1))  # before the ranks write
        run_config = {"size": (staging / RUN_CONFIG).stat().st_size, "sha256": file_digest(staging / RUN_CONFIG)}
        if background:
            trainers.begin_save(str(staging), s.global_step, driver_state)
            files = {}
        else:
            files = trainers.save_recover(str(staging), s.global_step, driver_state)
        actor = self.config.actor
        ref_step = reference_step(s.global_step, actor.ref_update_steps) if actor.kl_coef else None
        if ref_step is not None:  # the reference weights this step needs, written on the step they changed
            ref = reference_file(staging.parent, ref_step)
            if not ref.is_file():
                raise OSError(errno.EIO, "rank 0 did not write the reference weights (is cluster.fileroot on "
                                         "storage every node sees?)", str(ref))
            # hashed when it was written (a replayed refresh step rewrites it), not on every save that names it
            if ref_step == s.global_step or ref_step not in self._reference_entries:
                self._reference_entries = {ref_step: {"size": ref.stat().st_size, "sha256": file_digest(ref)}}
            files[REFERENCE_PREFIX + ref.name] = self._reference_entries[ref_step]
        files[RUN_CONFIG] = run_config
        # bytes this save wrote: a reference file written on an earlier step is only named, not rewritten
        nbytes = sum(f["size"] for name, f in files.items()
                     if not name.startswith(REFERENCE_PREFIX) or ref_step == s.global_step)
        return Staged(staging, s.global_step, files, trainers.world_size, nbytes, time.monotonic() - started,
                      background, infos, started)

    def collect_recover(self, trainers, staged: Staged, block: bool) -> bool:
        """For a background save: True once every rank's part is durable and the step is committed; with
        `block`, waits for it. Raises what a rank's write raised."""
        parts = trainers.save_result(staged.global_step, block)
        if parts is None:
            return False
        staged.files.update(parts)
        staged.nbytes += sum(f["size"] for f in parts.values())
        self.commit_recover(staged, staged.checksum)
        return True

    def commit_recover(self, staged: Staged, weights_checksum: str | None) -> None:
        """Publish and commit a fully written save with the recover_info captured at its step."""
        s, started = staged.global_step, time.monotonic()
        path = self.store.commit(staged.path, s, staged.world_size, self.config.resume_hash(),
                                 staged.files, staged.infos, engine=self.config.actor.backend.value)
        secs = (started - staged.started if staged.background else staged.secs) + time.monotonic() - started
        self.events.emit("commit", global_step=s, path=str(path), world_size=staged.world_size,
                         weights_checksum=weights_checksum, bytes=staged.nbytes, secs=round(secs, 3),
                         blocked_secs=round(staged.secs, 3), background=staged.background,
                         mbps=round(staged.nbytes / max(secs, 1e-9) / 1e6, 3))

    def export_hf(self, trainers, s: StepInfo, background: bool = False) -> "PendingExport | None":
        """A HuggingFace directory for this step, appearing complete or not at all; old ones pruned. With
        `background`, returns once rank 0 holds the full weights: `collect_export` publishes it when written."""
        final = self.layout.export_dir(s.epoch, s.epoch_step, s.global_step)
        if final.exists():
            return None  # the same step trained again after a rollback: identical weights, already exported
        final.parent.mkdir(parents=True, exist_ok=True)
        pending = PendingExport(tmp_name(final), final, s.global_step)
        if background:
            trainers.begin_export(str(pending.path), s.global_step)
            return pending
        trainers.export_hf(str(pending.path), s.global_step)
        self._publish_export(pending)
        return None

    def collect_export(self, trainers, pending: "PendingExport", block: bool) -> bool:
        """For a background export: True once rank 0 has written it (then it is published); with `block`,
        waits for it. Raises what the write raised."""
        if not trainers.export_result(pending.global_step, block):
            return False
        self._publish_export(pending)
        return True

    def _publish_export(self, pending: "PendingExport") -> None:
        publish_dir(pending.path, pending.final)
        self.events.emit("export", global_step=pending.global_step, path=str(pending.final))
        keep = self.config.saver.keep_last
        if keep:
            exports = sorted((p for p in pending.final.parent.iterdir()
                              if p.is_dir() and p.name.startswith("epoch") and not p.name.startswith(TMP_PREFIX)),
                             key=lambda p: int(p.name.rsplit("globalstep", 1)[1]))
            for old in exports[:-keep]:
                shutil.rmtree(old, ignore_errors=True)

    def committed_step(self) -> int | None:
        """The step checkpoint_info.json names, read without validating anything (None: no checkpoint)."""
        return self.store.committed_step() if self.store is not None else None

    def discard_failed_save(self, in_flight: tuple[Path, ...] = ()) -> list[Path]:
        """Remove what a save or export that failed left behind, but for the directories of background saves
        and exports still being written (`in_flight`); the last valid checkpoint is untouched."""
        if self.store is not None:
            return self.store.remove_leftovers(self.store.committed_step(), spare=in_flight)
        removed = [p for p in self.layout.export_root.glob(f"{TMP_PREFIX}*") if p not in in_flight] \
            if self.layout.export_root.is_dir() else []
        for p in removed:
            shutil.rmtree(p, ignore_errors=True)
        return removed
