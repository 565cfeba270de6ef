"""TrainWorker: one rank of the TrainGroup, a Ray actor around the training engine.

It joins the group's torch.distributed process group (gloo on CPU, nccl on GPU) and answers the
Supervisor's collective calls; every rank is called together. The engine (`actor.backend`) sits behind
workers/engines/base.py: this file imports no FSDP or DeepSpeed code and knows none of their file names.
Fault points at the entry and exit of every method (and between writing the shards and reporting them) let
tests kill or hang a rank at exact moments. On an object store, a rank writes its files on its own node's disk
and uploads them itself (checkpoint/transfer.py), and downloads a step to load it.
"""
from __future__ import annotations

import datetime
import errno
import functools
import logging
import math
import os
import socket
import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import ray
import torch
import torch.distributed as dist

from supervisor.checkpoint.durable import file_digest
from supervisor.checkpoint.layout import as_path, step_of
from supervisor.checkpoint.storage import retry_budget
from supervisor.checkpoint.transfer import RankDir
from supervisor.config import Config, RoleName
from supervisor.testing.fault_points import fault_point, fault_points
from workers import roles
from workers.cuda_weights import open_handle
from workers.gpu import deterministic_cuda, device_uuid
from workers.memory import peak_memory
from workers.memory_tier import DTYPES, Holding, Link, SharedLink, SharedSlots, Slots, peer_name
from workers.shared_weights import attach
from workers.weight_sync import (bucket_elements, join_group, mismatched, op_timeout, send, shard_digest, to_check,
                                 write_shared)


PROBE = "probe"  # the concurrency group of `progress`: it answers while the default group's method waits
# the concurrency group of a holder's methods: a spare holds ranks' copies from its start, while it still warms;
# two threads, so that `holding` answers (a repair asks it) while `hold` allocates a rank's slots (seconds at ~100M)
HOLDER = "holder"
# a rank's end of its side link, to connect and for each send (on the link's own thread: a holder that froze
# stalls the copies, not the rank's steps); the holder, always receiving, waits as long as a step may last
LINK_TIMEOUT = datetime.timedelta(seconds=120)
ABANDON_SECS = 5.0  # how long a rejoining rank waits for its background writes before it leaves them behind
log = logging.getLogger(__name__)


def tracks_phase(cls):
    """Every public method of `cls` records itself as the worker's phase while it runs, for `progress`; the
    holder's methods (HOLDER), which run beside it, do not."""
    def tracked(method):
        @functools.wraps(method)
        def wrapper(self, *args, **kwargs):
            self.phase = (method.__name__, time.monotonic())
            try:
                return method(self, *args, **kwargs)
            finally:
                self.phase = ("idle", time.monotonic())
        return wrapper

    for name, method in list(vars(cls).items()):
        if callable(method) and not name.startswith("_") and name != "progress" \
                and getattr(method, "__ray_concurrency_group__", None) != HOLDER:
            setattr(cls, name, tracked(method))
    return cls


# Methods of the default concurrency group still run one at a time, in the order a caller submitted them: a
# synchronous actor whose max_concurrency is 1 keeps its order (Ray reorders only asyncio actors and those of
# max_concurrency > 1), and every actor already has Ray's own groups beside the default one.
@ray.remote(concurrency_groups={PROBE: 1, HOLDER: 2})
@tracks_phase
class TrainWorker:
    """Started cold as a rank of a new TrainGroup, or ahead of need as a warm spare (supervisor/cluster/spares.py):
    it learns its rank and world size only when it joins a group (`setup`). Beside its rank's work it keeps the
    memory tier (workers/memory_tier.py): a rank stages its state after every step and sends it to its holder;
    a warm spare holds the copies of ranks and takes a dead one's place from them (`adopt`)."""

    def __init__(self, config: Config, role: RoleName = RoleName.ACTOR):
        torch.set_num_threads(1)  # deterministic CPU kernels, and no oversubscription of the node's cores
        if config.cluster.gpus_per_worker > 0:
            deterministic_cuda()  # before any CUDA kernel: exact recovery on GPU (workers/gpu.py)
        self.config = config
        self.role = roles.of(config, role)  # what it trains: the policy, or a critic's value model
        self.rank: int | None = None
        self.world_size: int | None = None
        self.engine = None
        self.saving: Write | None = None    # the last background recover save begun on this rank
        self.exporting: Write | None = None  # rank 0: the last background HF export begun
        self.abandoned: list[Write] = []  # background saves a repair left running on a thread of their own
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="recover-writer")
        self.parts = None  # what warm() built, until setup hands it to the engine
        self.weights_group = None  # rank 0: its member of the weights-update group (workers/weight_sync.py)
        self.weights_backend = "gloo"  # nccl: the buckets live on the GPU
        self.segments: dict[int, torch.Tensor] = {}  # weights rank -> that engine's shared weights, mapped here
        self.memory: Slots | None = None  # a rank's own two copies of its state, allocated when first needed
        self.link: Link | None = None  # a rank's side link to its holder
        self.memory_send: tuple[int, Future] | None = None  # the last send begun: (global step, its future)
        # a new process that took a dead rank's place: (step, flat, meta) of the peer's copy it loaded (read-only in
        # Ray's object store), its own copy of that step until its own slots hold the next two
        self.loaded_copy: tuple[int, torch.Tensor, dict] | None = None
        self.holdings: dict[int, Holding] = {}  # a holder's: rank -> the copies it receives from that rank
        self.holdings_lock = threading.Lock()  # the holder's methods (HOLDER) change them beside setup and adopt
        # the name the Supervisor holds ranks' copies here under: a spare's actor name, then its peer name once it
        # is a rank (buddies.peer_name); a call under an older name (a spare's, before it took a rank's place) is
        # refused, so no copy is held that nobody plans; None once the tier is off (or a cold rank before setup)
        self.holder_as: str | None = ray.get_runtime_context().get_actor_name() or None
        self.allocation_lock = threading.Lock()  # a holder's allocations, one at a time (the node's room)
        self.phase = ("idle", time.monotonic())  # (method running, since when): what `progress` answers

    @fault_points
    def warm(self) -> dict:
        """Everything that needs no process group: imports (transformers, the engine's module) and the
        unsharded model built from the config and seed. Idempotent; returns where this process runs."""
        self._warm()
        return self._where()

    def _warm(self) -> None:
        if self.parts is None and self.engine is None:
            from workers.engines.base import build_parts

            self.parts = build_parts(self.config, self.role)

    @fault_points
    def where(self, rank: int | None = None) -> dict:
        """The node this process runs on, and a free port for the rendezvous (used from rank 0). `rank` is
        the rank it is about to take, so that fault points can name it."""
        return self._where()

    def _where(self) -> dict:
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        gpu = device_uuid() if self.config.cluster.gpus_per_worker > 0 else None  # whether it shares an engine's
        return {"ip": ray.util.get_node_ip_address(), "node_id": ray.get_runtime_context().get_node_id(),
                "pid": os.getpid(), "port": port, "memory": peak_memory(),  # a warm spare's, for the stats
                "gpu": gpu}

    @fault_points
    def shard_digest(self) -> str:
        """This rank's part of the weights, hashed: asked before and after a handoff, it proves the ranks hold what
        they held without gathering them (the engines, which hold them, need nothing pushed)."""
        return shard_digest(self.engine.weight_shard(i) for i in range(len(self.engine.weight_params())))

    @fault_points
    def setup(self, master_addr: str, master_port: int, rank: int, world_size: int) -> None:
        """Join the group as `rank` of `world_size` and build the engine (warming first if not yet warm). A spare
        that held ranks' copies gives them back: it is a rank of a group restarted from disk now."""
        self._hold_as(peer_name(rank, os.getpid()))
        self._setup(master_addr, master_port, rank, world_size)

    def _setup(self, master_addr: str, master_port: int, rank: int, world_size: int) -> None:
        from workers.engines.base import make_engine  # torch.distributed and the chosen engine

        self._warm()
        self.rank, self.world_size = rank, world_size
        parts, self.parts = self.parts, None
        self.engine = make_engine(self.config, rank, world_size, master_addr, master_port, parts, self.role)

    @fault_points
    def train(self, shard: dict, global_step: int) -> dict:
        """The engine's metrics, and this process's peak memory (`memory`) for the step's stats row."""
        return self.engine.train_step(shard, global_step) | {"memory": peak_memory()}

    @fault_points
    def values(self, shard: dict, global_step: int) -> torch.Tensor:
        """A critic's rank: its values of this shard's states before the step's updates (EngineBase.values)."""
        return self.engine.values(shard).cpu()  # to the Supervisor, which has no GPU

    @fault_points
    def logprobs(self, shard: dict, global_step: int) -> dict[str, torch.Tensor]:
        """The policy's rank: this shard's token log-probabilities before the step's updates, and the reference's
        (EngineBase.logprobs)."""
        return {k: v.cpu() for k, v in self.engine.logprobs(shard).items()}

    @fault_points
    def init_weights_update_group(self, master_address: str, master_port: int, world_size: int, group_name: str,
                                  backend: str, memories: list[dict | None]) -> dict:
        """Every rank maps the engines' shared weights (`memories`, one per engine, None where it offers none:
        a memfd segment on this host, or a buffer on this rank's GPU opened through CUDA IPC) if it can; rank 0 also joins a new weights-update group as its rank 0 (the engines join it beside).
        Returns whether this rank mapped every engine's weights, laid out in the stream's order (`shared`);
        rank 0 also the names and full shapes of the parameters it streams, for the engines."""
        self.segments, self.weights_group = {}, None  # the previous group's mappings and connections go first
        spec = self.engine.weight_params()
        names, shapes = zip(*spec)
        layout = [(name, list(shape)) for name, shape in spec]
        for i, memory in enumerate(memories):
            opener = open_handle if memory and "cuda_ipc" in memory else attach
            segment = opener(memory) if memory and memory["layout"] == layout else None
            if segment is None:
                self.segments = {}
                break
            self.segments[1 + i] = segment
        if self.rank != 0:
            return {"shared": bool(self.segments)}
        self.weights_group = join_group(master_address, master_port, 0, world_size, group_name, backend,
                                        op_timeout(self.config))
        self.weights_backend = backend
        return {"names": list(names), "shapes": [list(s) for s in shapes], "shared": bool(self.segments)}

    @fault_points
    def send_weights(self, global_step: int, targets: list[int], dtype: str, shared: bool = False,
                     check_all: bool = False, digest: str = "xxh3") -> dict:
        """Collective: stream the weights the update of `global_step` made (-1: none yet) to the weights ranks
        `targets`, in buckets gathered from every rank's shards as they go, in `dtype` (the engines');
        with no targets, only their digest. With `shared`, every rank writes its shards straight into the
        targets' shared weights instead, and every rank's own part of one parameter (`check_all`: of every
        parameter), placed by the sharding itself, is compared by its hash with what was written
        (workers/weight_sync.py: mismatched). Rank 0 returns the digest (of the kind the engines check with,
        `digest`), the targets that failed and figures; the others {}."""
        numels = [math.prod(shape) for _, shape in self.engine.weight_params()]
        torch_dtype, bucket_bytes = getattr(torch, dtype), self.config.rollout.weight_bucket_mb * 2**20
        timeout, sender = op_timeout(self.config), self.rank == 0
        if not (shared and targets):
            group = self.weights_group if targets else None
            return send(self.engine.full_param, numels, torch_dtype, bucket_bytes, sender, group, targets, timeout,
                        self.engine.device if self.weights_backend == "nccl" else "cpu", digest)
        segments = [self.segments[t] for t in targets]
        sent = write_shared(self.engine.weight_shard, numels, torch_dtype, bucket_bytes, segments, self.rank,
                            self.world_size, self.weights_group, targets, timeout, global_step, digest)
        t0, which = time.monotonic(), to_check(global_step + 1, len(numels), check_all)
        # against the first engine's memory: the digests show the others hold the same
        bad = mismatched(self.engine.placed_part, segments[0].view(torch_dtype) if sender else None, numels,
                         torch_dtype, which, digest, bucket_elements(torch_dtype.itemsize, bucket_bytes))
        return sent | {"checked": len(which), "mismatch": bad[0] if bad else None,
                       "check_secs": time.monotonic() - t0} if sender else {}

    @fault_points
    def save_recover(self, staging: str, global_step: int) -> dict[str, dict]:
        """Collective; returns {file: {size, sha256}} for the files this rank wrote (and, on an object store,
        uploaded)."""
        with self._rank_dir(staging) as target:
            mine = self.engine.save(target.local, global_step)
            fault_point("after_shards", step=global_step, rank=self.rank, role=self.role.name)
            digests = _digests(target.local, mine)
            self._fence(staging)  # after the collective: a rank that raises here leaves no peer waiting in it
            target.upload(mine, global_step, self.rank, self.role.name)
        return digests

    def _rank_dir(self, url: str) -> RankDir:
        return RankDir(url, retry_budget(self.config))

    def _fence(self, staging: str) -> None:
        """No save into a directory that an abandoned save of this rank may still write: on an object store a
        step saved again after a repair from memory is written into the same prefix (there is no rename), and
        a late upload of the abandoned one would replace an object of the new, with the same size and other
        bytes. It gets ABANDON_SECS more to end; then this save fails as a storage error (the run skips it)."""
        self.abandoned = [w for w in self.abandoned if not w.future.done()]
        late = [w for w in self.abandoned if w.target.remote == as_path(staging)]
        if late and wait([w.future for w in late], timeout=ABANDON_SECS).not_done:
            raise OSError(errno.EIO, f"rank {self.rank}: the save of step {late[0].global_step} abandoned at a "
                                     f"repair is still uploading into this directory; this save is skipped",
                          staging)

    @fault_points
    def begin_save(self, staging: str, global_step: int) -> None:
        """This rank's part of a background save that needs no peer: the first of two calls, so that a storage
        error on one rank skips the save on every rank. Only once every rank's `begin_save` succeeded does the
        Supervisor call `start_upload` on all of them."""
        if self.saving is not None and self.saving.future is not None:
            wait([self.saving.future])  # the Supervisor waits for the previous one first; this is a backstop
        elif self.saving is not None:
            self.saving.target.close()  # begun, never started: given up
        self._fence(staging)
        target = self._rank_dir(staging)
        self.saving = Write(global_step, target, self.engine.save_local(target.local, global_step))

    @fault_points
    def start_upload(self, global_step: int) -> None:
        """Collective; returns once this rank's state is staged in CPU memory: the engine writes it in the
        background, and `save_result` reports it when it is durable. One save in flight at a time."""
        save = self.saving
        if save is None or save.global_step != global_step or save.future is not None:
            raise RuntimeError(f"start_upload of step {global_step}, but this rank has not begun that save")
        save.future = Future()  # tracked before anything can raise: save_result reports whatever happens
        try:
            shards = self.engine.save_async(save.target.local, global_step)
        except BaseException as e:
            save.future.set_exception(e)
            save.target.close()
            raise

        def finish() -> None:
            try:
                try:
                    # tests: killed mid-write
                    fault_point("background_write", step=global_step, rank=self.rank, role=self.role.name)
                finally:
                    written = shards.result()  # the write is over before the tracked future is, whatever happened
                digests = _digests(save.target.local, save.files + written)
                save.target.upload(save.files + written, global_step, self.rank, self.role.name)
                save.future.set_result(digests)
            except BaseException as e:  # noqa: BLE001 - the write's error is reported by save_result
                save.future.set_exception(e)
            finally:
                save.target.close()

        self._writer.submit(finish)

    @fault_points
    def save_result(self, global_step: int) -> dict[str, dict] | None:
        """{file: {size, sha256}} of the background save of `global_step` once every file of it is durable;
        None while it is still being written. Raises the write's error if it failed. Asking again gives the
        same answer, so the Supervisor can poll every rank until all are done (it never blocks here: a slow
        write is waited for by polling, so that the rank stays seen alive)."""
        future = Write.running(self.saving, global_step, "recover save")
        return future.result() if future.done() else None

    @fault_points
    def load_recover(self, step_dir: str, saved_world_size: int) -> list[str]:
        with self._rank_dir(step_dir) as source:
            path = source.fetch()
            return self.engine.load(path, step_of(path), same_world_size=saved_world_size == self.world_size)

    @fault_points
    def begin_export(self, directory: str, global_step: int) -> None:
        """Collective; returns once rank 0 holds the full weights on CPU: it writes the HuggingFace files in
        the background (on the writer thread, after any recover save), `export_result` says when done."""
        full = self.engine.full_state_dict()
        if self.rank == 0:
            if self.world_size == 1:  # nothing was gathered: the tensors are the parameters the next step updates
                full = {name: t.clone() for name, t in full.items()}
            target = self._rank_dir(directory)
            self.exporting = Write(global_step, target, future=self._writer.submit(self._export, target, full))

    @fault_points
    def export_result(self, global_step: int) -> bool:
        """Whether the background export of `global_step` is written (polled, like `save_result`); raises the
        write's error if it failed. Ranks other than 0 write nothing: always True."""
        if self.rank != 0:
            return True
        future = Write.running(self.exporting, global_step, "HF export")
        if not future.done():
            return False
        future.result()
        return True

    @fault_points
    def export_hf(self, directory: str, global_step: int) -> None:
        """Collective; rank 0 writes the HuggingFace files into `directory`."""
        full = self.engine.full_state_dict()
        if self.rank == 0:
            self._export(self._rank_dir(directory), full)

    def _export(self, target: RankDir, full: dict) -> None:
        """Rank 0: the HuggingFace files written into `target` (and uploaded from there)."""
        try:
            self.engine.export_hf(target.local, full)
            target.upload_all()
        finally:
            target.close()

    # ---- the memory tier: a rank's side ------------------------------------------------------------
    @fault_points
    def memory_slots(self) -> dict:
        """This rank's two slots, allocated (and touched) now if they are not yet, off any step, once the node
        has the room for them (NoRoom otherwise); what one holds: {"numel", "dtype"} (an index of DTYPES)."""
        if self.memory is None:
            layout = self.engine.memory_layout
            self.memory = Slots.with_room(f"rank {self.rank}'s two copies of its state", layout.numel, layout.dtype,
                                          pin=self.engine.device.type == "cuda")
        return {"numel": self.memory.numel, "dtype": DTYPES.index(self.memory.dtype)}

    @fault_points
    def memory_attach(self, held: dict) -> bool:
        """Link this rank to the holder whose `hold` returned `held`, replacing any earlier link, when it runs on
        this host: its slots mapped here, each copy written straight into them. False where they cannot be
        mapped (another host): then `memory_link`."""
        self._drop_link()
        shared = SharedSlots.attach(held)
        if shared is not None:
            self.link = SharedLink(shared)
        return shared is not None

    @fault_points
    def memory_link(self, holder_ip: str, port: int, key: str) -> None:
        """Link this rank to a holder on another host (whose `listen` hosts the store on `port`), replacing any
        earlier link: the connection is made on the link's thread, before its first send, so this returns at
        once."""
        self._drop_link()
        self.link = Link(holder_ip, port, key, LINK_TIMEOUT)

    @fault_points
    def drop_memory(self) -> None:
        """The tier is off for the run: give its slots back."""
        self._drop_link()
        self.memory = self.memory_send = self.loaded_copy = None

    @fault_points
    def begin_memory_copy(self, global_step: int) -> bool:
        """Right after `train(global_step)` returned on every rank: stage this rank's state into the slot of
        `global_step` (on this thread: the copy is the only part on the step's critical path), then send it to
        the holder on the link's thread, if linked. Unlinked, it still stages: a survivor rolls back from it.
        False (nothing staged) while the rank has no slots (`memory_slots`)."""
        if self.loaded_copy is not None and global_step != self.loaded_copy[0] + 1:
            self.loaded_copy = None  # its slots hold the two steps after it, or it is of a timeline rolled back
        if self.memory is None:
            return False
        if self.memory_send is not None and not self.memory_send[1].done():
            # the Supervisor waited (LINK_SECS at most) for the previous copy before this step's update: one still
            # being sent now is stuck (a holder that froze), so its link is left (after ABANDON_SECS) and this
            # step is staged here only; the Supervisor links the rank again
            self._drop_link()
        slot = self.memory.for_step(global_step)
        self.engine.stage_memory(slot, global_step)
        if self.link is not None:
            self.memory_send = (global_step, self.link.send(slot, self.rank))
        return True

    @fault_points
    def memory_result(self, global_step: int) -> bool | None:
        """True once the send of `global_step` to the holder finished, None while it runs; raises its error
        (RuntimeError when no send of that step was begun here: no link, or a newer one since). The holder's
        `holding()` says when the copy landed there, a moment later: that is the commit's test."""
        if self.memory_send is None or self.memory_send[0] != global_step:
            raise RuntimeError(f"no memory copy of step {global_step} was sent from this rank")
        future = self.memory_send[1]
        if not future.done():
            return None
        future.result()
        return True

    @fault_points
    def rejoin(self, master_addr: str, master_port: int, rank: int, world_size: int, global_step: int) -> None:
        """A survivor of a dead rank: leave its background writes behind (the send, an unfinished recover save,
        whose directory the Supervisor discards), join the new group as the same rank with the built model, and
        restore its own copy of `global_step` in place, always: RNGs and gradients may have moved mid-step. The
        side link is dropped: the Supervisor links the rank again. A new process that loaded a peer's copy of
        `global_step` and has staged no step since restores that copy."""
        flat, meta = self._own_copy(global_step)  # before the collective: fail fast
        self._leave_group(master_addr, master_port, rank, world_size)
        self.engine.load_memory(flat, meta)

    def _own_copy(self, global_step: int) -> tuple[torch.Tensor, dict]:
        if self.loaded_copy is not None and self.loaded_copy[0] == global_step:
            return self.loaded_copy[1:]
        if self.memory is None:
            raise RuntimeError(f"no memory copy of step {global_step} is held here: this rank never staged one")
        slot = self.memory.holding(global_step)
        return slot.flat, slot.meta

    @fault_points
    def regroup(self, master_addr: str, master_port: int, rank: int, world_size: int) -> None:
        """A survivor of a repair from disk: leave its background writes behind and join the new group as the same
        rank with the built model (the new ranks `setup` beside it); `load_recover` then overwrites its whole
        state with the checkpoint's, as it does theirs. Its process, imports and model are kept: about 10 s of
        a core less than a new rank's start (measured: a TrainWorker's start), at every rank fault the memory
        tier does not serve. Refused while a background save or export still runs after ABANDON_SECS (on an
        object store, a late upload could land in the step saved again; and it would hold the writer thread):
        the Supervisor then starts every rank again, and the kill ends that write."""
        export = self.exporting.future if self.exporting is not None else None
        if self._abandon_writes() or (export is not None and not wait([export], timeout=ABANDON_SECS).done):
            raise RuntimeError(f"rank {self.rank}: a background save or export was still being written after "
                               f"{ABANDON_SECS:g}s; this process is not kept")
        self.loaded_copy = None  # the checkpoint's state replaces whatever it held
        self._leave_group(master_addr, master_port, rank, world_size)

    def _leave_group(self, master_addr: str, master_port: int, rank: int, world_size: int) -> None:
        """Leave the background writes (the send, an unfinished recover save, whose directory the Supervisor
        discards) and the old process group, and join the new one with the built model and optimizer."""
        self._abandon_writes()
        # rank 0's weights-update group goes too: closing its connections frees an engine left waiting in a
        # weight sync the fault broke (it would otherwise sit there until the group's timeout)
        self.weights_group, self.segments = None, {}
        self.engine.rejoin(master_addr, master_port, rank, world_size)

    def _drop_link(self) -> None:
        """Leave the side link; a send still running after ABANDON_SECS is abandoned with it (and forgotten:
        the next copy does not wait for it, and its holder has closed that link or died)."""
        if self.link is None:
            return
        if self.memory_send is not None and not wait([self.memory_send[1]], timeout=ABANDON_SECS).done:
            log.warning("rank %s: the memory send of step %d was still running; abandoned", self.rank,
                        self.memory_send[0])
            self.memory_send = None
        self.link.close()
        self.link = None

    def _abandon_writes(self) -> bool:
        """Stop waiting for this rank's background writes: the memory send, and a recover save whose peers
        may be dead. Each gets ABANDON_SECS to end; a save still running keeps its thread, and later saves get
        a writer thread of their own. What they ended with is one log line, never an error. Returns whether a
        save was left running."""
        self._drop_link()
        save, self.saving = self.saving, None
        if save is None or save.future is None:
            return False
        wait([save.future], timeout=ABANDON_SECS)
        if not save.future.done():
            self.abandoned.append(save)
            self._writer.shutdown(wait=False)
            self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="recover-writer")
            log.warning("rank %s: the background recover save of step %d was still running at the rejoin; "
                        "abandoned", self.rank, save.global_step)
            return True
        if save.future.exception() is not None:
            log.warning("rank %s: the background recover save of step %d failed before the rejoin: %s",
                        self.rank, save.global_step, save.future.exception())
        return False

    # ---- the memory tier: a holder's side, answered from the spare's start (HOLDER) ----------------------
    @ray.method(concurrency_group=HOLDER)
    @fault_points
    def located(self) -> dict:
        """Where this process runs and a free port for a side link, answered while `warm` still runs: a spare
        holds copies from its start, before its imports and model are done."""
        return self._where()

    @ray.method(concurrency_group=HOLDER)
    @fault_points
    def hold(self, rank: int, slots: dict, holder: str, keep: int | None = None) -> dict:
        """Hold `rank`'s copies, as `holder` (the name the Supervisor planned it under): two slots of `slots` (the
        rank's `memory_slots()`), allocated in a segment the rank maps if it runs on this host, once this node
        has the room (NoRoom otherwise); returns the segment's handle (`memory_attach`). Holding a rank again
        replaces its old holding, but for `keep` (the rank is linked again after a repair from memory that
        rolled back to step `keep`): then, where the slots fit and nothing receives into them any more, they are
        kept with that step alone (a second fault before the new link's copies land rolls back to it) and
        nothing is allocated again. Allocated outside the lock, so that `holding` answers meanwhile; refused
        under a name this process no longer holds as (`holder_as`)."""
        with self.holdings_lock:
            self._holds_as(holder)
            old = self.holdings.pop(rank, None)
            if keep is not None and old is not None and old.ended(0) and \
                    (old.slots.numel, DTYPES.index(old.slots.dtype)) == (slots["numel"], slots["dtype"]):
                old.closed = True  # a late thread of the old link lands nothing more
                old.slots.keep_only(keep)
                self.holdings[rank] = Holding(old.slots)
                return old.slots.handle
        if old is not None:
            old.close()
        with self.allocation_lock:  # one at a time: each checks the node's room after the one before took its own
            held = SharedSlots.with_room(f"the two copies held for rank {rank}", slots["numel"],
                                         DTYPES[slots["dtype"]])
        with self.holdings_lock:
            if self.holder_as != holder:
                held.close()
                self._holds_as(holder)
            old, self.holdings[rank] = self.holdings.get(rank), Holding(held)
        if old is not None:  # a hold of the same rank that ran beside this one
            old.close()
        return held.handle

    def _holds_as(self, holder: str) -> None:
        if self.holder_as != holder:
            raise RuntimeError(f"this process holds no copies as {holder} (it holds as {self.holder_as}: it "
                               f"became a rank, or the memory tier is off)")

    def _hold_as(self, holder: str | None) -> list[Holding]:
        """From now on hold copies as `holder` only (None: never again); what was held is given back, but for
        the holdings returned."""
        with self.holdings_lock:  # the holder's calls run on a thread of their own, beside setup and adopt's
            holdings, self.holdings, self.holder_as = self.holdings, {}, holder
        for h in holdings.values():
            h.close()
        return list(holdings.values())

    @ray.method(concurrency_group=HOLDER)
    @fault_points
    def listen(self, rank: int, port: int, key: str) -> None:
        """For `rank` on another host: host its side link's store on `port` (a port of this process's `where()`)
        and, on a thread, accept the link and receive its copies into the held slots while the link lives."""
        from workers.engines.base import collective_timeout

        with self.holdings_lock:
            held = self.holdings[rank]
        # the holder waits between a rank's copies for as long as a step may last (its thread blocks nothing)
        held.listen(port, key, collective_timeout(self.config))

    @ray.method(concurrency_group=HOLDER)
    @fault_points
    def unhold(self, rank: int, holder: str) -> None:
        """Give back the slots held for `rank` as `holder` (it is held elsewhere now)."""
        with self.holdings_lock:
            held = self.holdings.pop(rank, None) if self.holder_as == holder else None
        if held is not None:
            held.close()

    @ray.method(concurrency_group=HOLDER)
    @fault_points
    def release(self) -> None:
        """Give back every rank's copies and close their links, and hold none again: the tier is off for the run."""
        self._hold_as(None)

    @fault_points  # outside: Ray reads num_returns from the unwrapped method (functools.wraps copies it out)
    @ray.method(concurrency_group=HOLDER, num_returns=2)
    def held_copy(self, rank: int, global_step: int) -> tuple[np.ndarray, dict]:
        """The copy of `global_step` held for dead `rank`, for the process taking its place (`adopt_copy`): its
        bytes, which Ray carries to that process's node, and its meta (two objects: the Supervisor reads the
        small one to learn that the copy is there). Nothing writes the slot any more: its rank is dead."""
        with self.holdings_lock:
            held = self.holdings.get(rank)
        if held is None:
            raise RuntimeError(f"no memory copy of rank {rank} is held here (held: {sorted(self.holdings)})")
        slot = held.slots.holding(global_step)
        return slot.flat.view(torch.uint8).numpy(), slot.meta

    @ray.method(concurrency_group=HOLDER)
    @fault_points
    def holding(self) -> dict[int, list[int]]:
        """{rank: the steps held whole for it} (at most two per rank)."""
        with self.holdings_lock:
            holdings = dict(self.holdings)
        return {rank: h.landed() for rank, h in holdings.items()}

    @fault_points
    def adopt(self, master_addr: str, master_port: int, rank: int, world_size: int, global_step: int) -> bool:
        """A holder taking dead `rank`'s place: join the group as a spare does, then load the copy of
        `global_step` it holds for `rank`, which becomes this rank's own; what it held for other ranks and its
        links are dropped (it is a rank now). True where its own slots now hold `global_step` (the slots it held,
        once nothing writes them): a second fault before its next copy can roll it back to that step in place."""
        held = self.holdings.get(rank)
        if held is None:
            raise RuntimeError(f"no memory copy of rank {rank} is held here (held: {sorted(self.holdings)})")
        slot = held.slots.holding(global_step)  # before the collective: fail fast
        self._hold_as(peer_name(rank, os.getpid()))
        self._setup(master_addr, master_port, rank, world_size)
        self.engine.load_memory(slot.flat, slot.meta)
        # its own copies now, once nothing writes them (the dead rank's link has ended, or is about to)
        self.memory = held.slots if held.ended(ABANDON_SECS) else None
        return self.memory is not None

    @fault_points
    def adopt_copy(self, master_addr: str, master_port: int, rank: int, world_size: int, global_step: int,
                   data: np.ndarray, meta: dict) -> bool:
        """A new process (started cold, or a spare that held no copy of it) taking dead `rank`'s place, whose
        copy a peer rank held: join the group as a new rank does, then load `global_step` straight from the copy
        (the peer's `held_copy`, which Ray resolved before this call, read-only in its object store). Its own
        slots are allocated beside the next step, as a rank started cold gets them (`memory_slots`); until they
        hold the two steps after it, the copy it loaded is kept as its own copy of `global_step` (nothing copied:
        it stays in the object store), so a second fault before then rolls it back in place. True: it holds it."""
        self._hold_as(peer_name(rank, os.getpid()))
        self._setup(master_addr, master_port, rank, world_size)
        layout = self.engine.memory_layout
        with warnings.catch_warnings():  # read only: load_memory copies out of it
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            flat = torch.from_numpy(data).view(layout.dtype)
        self.engine.load_memory(flat, meta)
        self.loaded_copy = (global_step, flat, meta)
        return True

    @ray.method(concurrency_group=PROBE)
    def progress(self) -> dict:
        """Answered while the default group's method runs (a rank waiting in a collective): what it is doing,
        for how long, and its default group's collective sequence number (None outside a group)."""
        name, since = self.phase
        seq = dist.distributed_c10d._get_default_group()._get_sequence_number_for_group() \
            if dist.is_initialized() else None
        return {"phase": name, "secs": time.monotonic() - since, "seq": seq}


@dataclass
class Write:
    """One background write of a step on this rank (TorchTitan keeps a future per save): begun, then running
    on the writer thread once its `future` is set. `files` were written before it started (the part of a
    recover save that needs no peer), into `target`'s local directory."""

    global_step: int
    target: RankDir
    files: list[str] = field(default_factory=list)
    future: Future | None = None

    @staticmethod
    def running(write: "Write | None", global_step: int, what: str) -> Future:
        """The future of `write` when it is the running write of `global_step`; RuntimeError otherwise."""
        if write is None or write.global_step != global_step or write.future is None:
            raise RuntimeError(f"no {what} of step {global_step} was started on this rank")
        return write.future


def _digests(directory: Path, names: list[str]) -> dict[str, dict]:
    return {name: {"size": (directory / name).stat().st_size, "sha256": file_digest(directory / name)}
            for name in names}
