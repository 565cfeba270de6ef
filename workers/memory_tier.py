"""The memory tier of the recover checkpoint: one rank's recover state, kept in memory that outlives the rank.

After each optimizer step a rank copies its state (its local shard of every parameter and of AdamW's two
moments) into one of two preallocated flat slots, the slot of step G being G % 2, with a small meta dict
beside it (the step, AdamW's per-parameter step, the param groups with their lr, the LR scheduler, the RNGs).
A background thread then sends the slot over a side link, a gloo group of two processes of its own, to the
rank's holder (a warm spare on another node), which receives it into two slots of its own for that rank.
Two slots, so that a failure during a copy or a send leaves the previous step whole: a slot is landed only
once its whole buffer and its meta arrived. The rank's own slots are what a surviving rank rolls back from;
the holder's are what a spare taking a dead rank's place loads. Which step is committed (every rank's copy
landed) is the Supervisor's business.
"""
from __future__ import annotations

import datetime
import io
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.distributed as dist

SLOTS = 2
KINDS = ("param", "exp_avg", "exp_avg_sq")  # the order of the parts in a slot, each over every parameter
DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # a slot's dtype, sent as its index here
RANK, HOLDER = 0, 1  # the two ends of a side link


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

    @property
    def step(self) -> int | None:
        return None if self.meta is None else self.meta["global_step"]


class Slots:
    """Two flat buffers, allocated and touched at once: the first copy into untouched pages costs seconds of
    page faults at ~100M (0.3 to 3.6 s measured), and it must not fall on a step."""

    def __init__(self, numel: int, dtype: torch.dtype):
        self.slots = [Slot(torch.empty(numel, dtype=dtype).zero_()) for _ in range(SLOTS)]

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
        return slot

    def landed(self) -> list[int]:
        return sorted(s.step for s in self.slots if s.step is not None)


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
    meta = pack_meta(slot.meta)
    header = torch.tensor([slot.step, meta.numel(), slot.flat.numel(), DTYPES.index(slot.flat.dtype)])
    for tag, tensor in enumerate((header, meta, slot.flat)):
        group.send([tensor], HOLDER, tag).wait()


class Holding:
    """The holder's end for one rank: the store it hosts, and a thread that accepts the rank's link and then
    receives its slots for as long as the link lives (an error, the rank's death included, ends it)."""

    def __init__(self, port: int, key: str, timeout: datetime.timedelta):
        self.store = dist.TCPStore("0.0.0.0", port, 2, is_master=True, timeout=timeout, wait_for_workers=False)
        self.slots: Slots | None = None  # allocated when the first header says how large the rank's state is
        self.closed = False
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._receive, args=(key, timeout), daemon=True,
                                       name=f"memory-holder-{key}")
        self.thread.start()

    def landed(self) -> list[int]:
        return [] if self.slots is None else self.slots.landed()

    def close(self) -> None:
        """Take no more steps from this link (its thread ends when the link does)."""
        self.closed = True

    def _receive(self, key: str, timeout: datetime.timedelta) -> None:
        try:
            group = link_group(self.store, key, HOLDER, timeout)
            while not self.closed:
                header = torch.zeros(4, dtype=torch.int64)
                group.recv([header], RANK, 0).wait()
                step, meta_bytes, numel, dtype = header.tolist()
                meta = torch.empty(meta_bytes, dtype=torch.uint8)
                group.recv([meta], RANK, 1).wait()
                if self.slots is None or (self.slots.numel, self.slots.dtype) != (numel, DTYPES[dtype]):
                    self.slots = Slots(numel, DTYPES[dtype])
                slot = self.slots.for_step(step)
                slot.meta = None  # no longer the step it held; landed again only when the whole buffer is here
                group.recv([slot.flat], RANK, 2).wait()
                if not self.closed:
                    slot.meta = unpack_meta(meta)
        except BaseException as e:  # noqa: BLE001 - a link that ended (its rank died or re-linked): kept, not raised
            self.error = e


class Link:
    """The rank's end of its side link to its holder; sends run one at a time on a thread of its own."""

    def __init__(self, holder_ip: str, port: int, key: str, timeout: datetime.timedelta):
        self.store = dist.TCPStore(holder_ip, port, 2, is_master=False, timeout=timeout)
        self.group = link_group(self.store, key, RANK, timeout)
        self.sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix="memory-sender")

    def send(self, slot: Slot) -> Future:
        return self.sender.submit(send_slot, self.group, slot)

    def close(self) -> None:
        """Stop using the link: a send still running is abandoned (its thread ends with the link's error)."""
        self.sender.shutdown(wait=False, cancel_futures=True)
