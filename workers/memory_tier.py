"""The memory tier of the recover checkpoint: one rank's recover state, kept in memory that outlives the rank.

After each optimizer step a rank copies its state (its local shard of every parameter and of AdamW's two
moments) into one of two preallocated flat slots, the slot of step G being G % 2, with a small meta dict
beside it (the step, AdamW's per-parameter step, the param groups with their lr, the LR scheduler, the RNGs).
A background thread then copies the slot to the rank's holder (a warm spare on another node), which keeps two
slots of its own for that rank in a memfd segment: a holder on the same host (Ray nodes sharing a machine) is
written straight into, one memcpy; one on another host receives it over a side link, a gloo group of two
processes of its own.
Two slots, so that a failure during a copy or a send leaves the previous step whole: a slot is landed only
once its whole buffer and its meta arrived. The rank's own slots are what a surviving rank rolls back from;
the holder's are what a spare taking a dead rank's place loads. Which step is committed (every rank's copy
landed) is the Supervisor's business.
"""
from __future__ import annotations

import datetime
import io
import mmap
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import psutil
import torch
import torch.distributed as dist

from supervisor.testing.fault_points import fault_point
from workers.shared_weights import create_segment, map_segment

SLOTS = 2
PAGE = 4096
# Of a node's memory, the share the tier leaves free beside its copies: the job's own peaks (the gathered model of
# a push or an export, a background save's staging copy) come after the copies are allocated.
HEADROOM = 0.15
KINDS = ("param", "exp_avg", "exp_avg_sq")  # the order of the parts in a slot, each over every parameter
DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # a slot's dtype, sent as its index here
RANK, HOLDER = 0, 1  # the two ends of a side link


def peer_name(rank: int, pid: int | None) -> str:
    """A rank's name as a holder of other ranks' copies: its rank and process, so that a rank's new process is a
    new holder."""
    return f"rank {rank} (pid {pid})"


def slot_index(global_step: int) -> int:
    return global_step % SLOTS


@dataclass(frozen=True)
class StateLayout:
    """Where a rank's local tensors lie in a flat slot: every parameter's local shard, then every exp_avg, then
    every exp_avg_sq, each parameter in the engine's order. The same on every step of a group."""

    numels: tuple[int, ...]  # of each parameter's local shard
    dtype: torch.dtype

    @classmethod
    def of(cls, shards: list[torch.Tensor]) -> "StateLayout":
        dtypes = {t.dtype for t in shards}
        if len(dtypes) != 1:
            raise ValueError(f"the memory tier needs one dtype for every parameter, not {sorted(map(str, dtypes))}")
        return cls(tuple(t.numel() for t in shards), dtypes.pop())

    @property
    def numel(self) -> int:
        return len(KINDS) * sum(self.numels)

    def parts(self, flat: torch.Tensor) -> dict[str, list[torch.Tensor]]:
        """Flat views into `flat`, per kind, one per parameter."""
        if flat.numel() != self.numel or flat.dtype != self.dtype:
            raise ValueError(f"a slot of {flat.numel()} {flat.dtype} does not fit the layout "
                             f"({self.numel} {self.dtype})")
        views, offset = {}, 0
        for kind in KINDS:
            views[kind] = []
            for n in self.numels:
                views[kind].append(flat[offset:offset + n])
                offset += n
        return views


@dataclass
class Slot:
    flat: torch.Tensor
    meta: dict | None = None  # None while the slot holds no whole step (never filled, or being overwritten)
    pending: object = None  # a GPU rank's copy still in flight into `flat` (a CUDA event), until `wait`

    @property
    def step(self) -> int | None:
        return None if self.meta is None else self.meta["global_step"]

    def wait(self) -> "Slot":
        """The slot once its bytes are all there: a copy queued from the GPU has landed."""
        pending = self.pending  # read once: the sender's thread and a rejoin may wait on the same slot
        if pending is not None:
            pending.synchronize()
            self.pending = None
        return self


class NoRoom(RuntimeError):
    """A node without the memory for the tier's copies: the Supervisor turns the tier off for the run, before
    anything is allocated that the job's own peaks would then miss."""


def check_room(what: str, nbytes: int, available: int, total: int) -> None:
    """NoRoom unless `nbytes` fit in `available` with HEADROOM of `total` left free."""
    if nbytes > available - HEADROOM * total:
        raise NoRoom(f"{what} need {nbytes / 2**30:.2f} GiB; the node has {available / 2**30:.2f} GiB available "
                     f"and keeps {HEADROOM:.0%} of its {total / 2**30:.1f} GiB free")


class Slots:
    """Two flat buffers, allocated and touched at once: the first copy into untouched pages costs seconds of
    page faults at ~100M (0.3 to 3.6 s measured), and it must not fall on a step. A rank on a GPU `pin`s them
    (page-locked host memory): its state is copied from the device at full bandwidth, asynchronously, in one
    pass, where pageable memory is copied through a staging buffer of the driver's."""

    def __init__(self, numel: int, dtype: torch.dtype, pin: bool = False):
        self.slots = [Slot(torch.empty(numel, dtype=dtype, pin_memory=pin).zero_()) for _ in range(SLOTS)]

    @classmethod
    def with_room(cls, what: str, numel: int, dtype: torch.dtype, **options) -> "Slots":
        """Two slots (`options`: the class's own, `pin` for these), after checking this node has the room for them
        (NoRoom otherwise)."""
        memory = psutil.virtual_memory()
        check_room(what, SLOTS * numel * dtype.itemsize, memory.available, memory.total)
        return cls(numel, dtype, **options)

    @property
    def numel(self) -> int:
        return self.slots[0].flat.numel()

    @property
    def dtype(self) -> torch.dtype:
        return self.slots[0].flat.dtype

    def for_step(self, global_step: int) -> Slot:
        """The slot step `global_step` is written into (whatever it holds now)."""
        return self.slots[slot_index(global_step)]

    def holding(self, global_step: int) -> Slot:
        """The slot holding the whole of `global_step`; RuntimeError when none does."""
        slot = self.for_step(global_step)
        if slot.step != global_step:
            raise RuntimeError(f"no memory copy of step {global_step} is held here (held: {self.landed()})")
        return slot.wait()

    def landed(self) -> list[int]:
        return sorted(s.step for s in self.slots if s.step is not None)

    def keep_only(self, global_step: int) -> None:
        """Forget every step but `global_step` (a slot holds no whole step until it is written again)."""
        for slot in self.slots:
            if slot.step != global_step:
                slot.meta = None


class SharedSlot:
    """A slot in a segment two processes map: its flat buffer, and its step and meta in the segment's header,
    so that the process that wrote it and the one that holds it see the same slot. Setting `meta` writes the
    meta bytes and then the step (None: the step to -1 first), so a slot is whole once its step is set."""

    wait = Slot.wait  # a spare that took a rank's place copies its own steps into the slots it held

    def __init__(self, flat: torch.Tensor, control: torch.Tensor, meta_area: torch.Tensor):
        self.flat, self.control, self.meta_area = flat, control, meta_area  # control: [step, meta bytes]
        self.pending = None

    @property
    def step(self) -> int | None:
        step = int(self.control[0])
        return None if step < 0 else step

    @property
    def meta(self) -> dict | None:
        return None if self.step is None else unpack_meta(self.meta_area[:int(self.control[1])])

    @meta.setter
    def meta(self, meta: dict | None) -> None:
        self.control[0] = -1
        if meta is None:
            return
        packed = pack_meta(meta)
        if packed.numel() > self.meta_area.numel():
            raise ValueError(f"a slot's meta of {packed.numel()} bytes exceeds its {self.meta_area.numel()}")
        self.meta_area[:packed.numel()].copy_(packed)
        self.control[1] = packed.numel()
        self.control[0] = meta["global_step"]


class SharedSlots(Slots):
    """A holder's two slots for one rank in a memfd segment (workers/shared_weights.py's), which the rank maps
    when it runs on the same host: it then copies each step straight into the holder's slot, one memcpy on its
    sender thread, no socket and no receiving thread (the side link is for ranks on other hosts). The header
    page holds the nonce and each slot's step and meta length, then each slot's meta area, then the slots."""

    NAME = "relaunch-memory-tier"
    META_BYTES = 256 * 1024  # a slot's meta (RNG states, param groups, scheduler): a few KiB at any size

    def __init__(self, numel: int, dtype: torch.dtype, mapped: tuple[mmap.mmap, dict] | None = None):
        size = self.size(numel, dtype)
        self.fd = -1  # the holder's: what a rank on its host opens the segment through, until `close`
        if mapped is None:
            self.fd, segment, nonce = create_segment(self.NAME, size)
            self.handle = {"path": f"/proc/{os.getpid()}/fd/{self.fd}", "nonce": nonce.hex(), "numel": numel,
                           "dtype": DTYPES.index(dtype)}
        else:
            segment, self.handle = mapped
        self.segment = segment  # the tensors below are views of it: it lives as long as they do
        data = torch.frombuffer(segment, dtype=torch.uint8)
        control = data[:PAGE].view(torch.int64)
        if mapped is None:
            control[8:8 + 2 * SLOTS:2] = -1  # no slot holds a step
        flats = data[self.header_bytes():].view(dtype)
        self.slots = [SharedSlot(flats[i * numel:(i + 1) * numel], control[8 + 2 * i:10 + 2 * i],
                                 data[PAGE + i * self.META_BYTES:PAGE + (i + 1) * self.META_BYTES])
                      for i in range(SLOTS)]

    def close(self) -> None:
        """No rank opens the segment any more: its fd goes, and its memory with the last view of it (a spare that
        took the rank's place keeps its slots as its own; a holding given back or replaced frees them)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    @classmethod
    def header_bytes(cls) -> int:
        return PAGE + SLOTS * cls.META_BYTES

    @classmethod
    def size(cls, numel: int, dtype: torch.dtype) -> int:
        return cls.header_bytes() + SLOTS * numel * dtype.itemsize

    @classmethod
    def attach(cls, handle: dict) -> "SharedSlots | None":
        """The holder's slots mapped into this process, or None where they cannot be (another host)."""
        numel, dtype = handle["numel"], DTYPES[handle["dtype"]]
        segment = map_segment(handle["path"], cls.NAME, cls.size(numel, dtype), handle["nonce"])
        return None if segment is None else cls(numel, dtype, (segment, handle))


def pack_meta(meta: dict) -> torch.Tensor:
    """A meta dict as bytes in a uint8 tensor, for the side link (torch.save: tensors, numbers, strings)."""
    buffer = io.BytesIO()
    torch.save(meta, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def unpack_meta(packed: torch.Tensor) -> dict:
    """The meta dict back, through weights_only loading: bytes from another process run no code here."""
    return torch.load(io.BytesIO(packed.numpy().tobytes()), weights_only=True)


def link_group(store: dist.Store, key: str, end: int, timeout: datetime.timedelta) -> dist.ProcessGroup:
    """One end of a side link: a gloo group of two processes of its own, under `key` in the holder's store
    (blocks until the other end joins)."""
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [dist.ProcessGroupGloo.create_default_device()]
    return dist.ProcessGroupGloo(dist.PrefixStore(f"{key}/", store), end, 2, opts)


def send_slot(group: dist.ProcessGroup, slot: Slot) -> None:
    """The rank's end: a header (step, meta bytes, elements, dtype), the meta, then the flat buffer."""
    slot.wait()
    meta = pack_meta(slot.meta)
    header = torch.tensor([slot.step, meta.numel(), slot.flat.numel(), DTYPES.index(slot.flat.dtype)])
    for tag, tensor in enumerate((header, meta, slot.flat)):
        group.send([tensor], HOLDER, tag).wait()


class Holding:
    """The holder's end for one rank: its two slots, which a rank on this host maps and writes itself
    (SharedSlots), and for a rank on another host (`listen`) the store it hosts and a thread that accepts the
    rank's link and then receives its slots for as long as the link lives (an error, the rank's death
    included, ends it)."""

    def __init__(self, slots: SharedSlots):
        self.slots = slots
        self.closed = False
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None

    def listen(self, port: int, key: str, timeout: datetime.timedelta) -> None:
        if self.thread is not None:
            raise RuntimeError("this holding already listens for its rank's side link")
        self.store = dist.TCPStore("0.0.0.0", port, 2, is_master=True, timeout=timeout, wait_for_workers=False)
        self.thread = threading.Thread(target=self._receive, args=(key, timeout), daemon=True,
                                       name=f"memory-holder-{key}")
        self.thread.start()

    def landed(self) -> list[int]:
        return self.slots.landed()

    def close(self) -> None:
        """Take no more steps from this link (its thread ends when the link does), and let the segment go."""
        self.closed = True
        self.slots.close()

    def ended(self, timeout: float) -> bool:
        """Whether nothing receives into the slots any more, waiting up to `timeout` for the thread."""
        if self.thread is not None:
            self.thread.join(timeout)
        return self.thread is None or not self.thread.is_alive()

    def _receive(self, key: str, timeout: datetime.timedelta) -> None:
        try:
            group = link_group(self.store, key, HOLDER, timeout)
            while not self.closed:
                header = torch.zeros(4, dtype=torch.int64)
                group.recv([header], RANK, 0).wait()
                step, meta_bytes, numel, dtype = header.tolist()
                meta = torch.empty(meta_bytes, dtype=torch.uint8)
                group.recv([meta], RANK, 1).wait()
                if (self.slots.numel, self.slots.dtype) != (numel, DTYPES[dtype]):
                    raise ValueError(f"a copy of {numel} {DTYPES[dtype]} does not fit the slots held for it "
                                     f"({self.slots.numel} {self.slots.dtype})")
                slot = self.slots.for_step(step)
                slot.meta = None  # no longer the step it held; landed again only when the whole buffer is here
                group.recv([slot.flat], RANK, 2).wait()
                if not self.closed:
                    slot.meta = unpack_meta(meta)
        except BaseException as e:  # noqa: BLE001 - a link that ended (its rank died or re-linked): kept, not raised
            self.error = e


def copy_slot(target: SharedSlot, slot: Slot) -> None:
    """The rank's end on the holder's host: its slot copied straight into the holder's, then the meta."""
    slot.wait()
    target.meta = None
    target.flat.copy_(slot.flat)
    target.meta = slot.meta


class Link:
    """The rank's end of its side link to a holder on another host; the connection, then the sends, run one at
    a time on a thread of its own, so that a holder that froze after it began listening stalls the copies (a
    send that never lands, which the Supervisor sees), never the rank's own calls."""

    def __init__(self, holder_ip: str, port: int, key: str, timeout: datetime.timedelta):
        self.sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix="memory-sender")
        self.connected = self.sender.submit(self._connect, holder_ip, port, key, timeout)

    def _connect(self, holder_ip: str, port: int, key: str, timeout: datetime.timedelta) -> None:
        self.store = dist.TCPStore(holder_ip, port, 2, is_master=False, timeout=timeout)
        self.group = link_group(self.store, key, RANK, timeout)

    def send(self, slot: Slot, rank: int) -> Future:
        return self.sender.submit(self._send, slot, rank)

    def _send(self, slot: Slot, rank: int) -> None:
        fault_point("memory_send", step=slot.step, rank=rank)  # tests: a copy that does not land
        self._write(slot)

    def _write(self, slot: Slot) -> None:
        self.connected.result()  # raises why the link could not be made
        send_slot(self.group, slot)

    def close(self) -> None:
        """Stop using the link: a send still running is abandoned (its thread ends with the link's error)."""
        self.sender.shutdown(wait=False, cancel_futures=True)


class SharedLink(Link):
    """The rank's end when its holder runs on the same host: each send copies into the holder's slots, which
    this process maps (SharedSlots.attach)."""

    def __init__(self, shared: SharedSlots):
        self.shared = shared
        self.sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix="memory-sender")

    def _write(self, slot: Slot) -> None:
        copy_slot(self.shared.for_step(slot.step), slot)
