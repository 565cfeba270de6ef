"""A CPU engine's weights in shared memory, written in place by the trainer ranks on the same host.

The engine keeps its parameters in one memfd segment, laid end to end in the stream's order after a header
page that holds a random nonce, and offers it when it joins a weights-update group. A trainer rank on the
same host maps it through /proc/<pid>/fd/<fd> and checks the nonce; a rank on another host, or in another
pid namespace, cannot, and the sync falls back to the stream. Each rank then writes its own shard of every
parameter straight into the engine's parameters: one copy of each byte, no gather on rank 0, no receive
buffer on the engine. It is the CPU counterpart of handing an engine CUDA IPC handles (SGLang's
`update_weights_from_tensor`). The memfd has no name, so nothing is left in /dev/shm when the engine dies:
the kernel frees the memory when the last mapping goes.
"""
from __future__ import annotations

import fcntl
import mmap
import os

import torch

NAME = "relaunch-weights"  # /proc/<pid>/fd/<fd> of the segment reads /memfd:relaunch-weights (deleted)
HEADER = 4096  # the nonce's page; the parameters start page-aligned after it
NONCE = 16


class SharedWeights:
    """Engine side: moves `model`'s parameters (each once: a tied weight is one parameter) into a segment.
    Raises OSError where the segment cannot be made (the engine then offers none and is streamed to).

    Each weights-update group gets a segment of its own (`renew`): the parameters are copied into a new memfd
    and the old one is let go, so a writer left over from an earlier group (a rank of a killed TrainGroup that
    outlived its kill) writes into memory the engine no longer serves. That costs one copy of the weights per
    new group, and the old segment's memory until its last such writer is gone."""

    def __init__(self, model: torch.nn.Module):
        self.params = [p for _, p in model.named_parameters()]
        if len({p.dtype for p in self.params}) != 1:
            raise OSError("the engine's parameters are of several dtypes: one flat segment cannot hold them")
        self.layout = [(name, list(p.shape)) for name, p in model.named_parameters()]
        self.nbytes = sum(p.numel() * p.element_size() for p in self.params)
        self.generation: str | None = None  # the weights-update group whose ranks may write it
        self.fd, self.map, self.nonce = -1, None, b""
        self.renew(None)

    def renew(self, generation: str | None) -> dict:
        """A new segment for the group `generation`, holding the parameters as they are; returns its handle."""
        fd, segment, nonce = create_segment(NAME, HEADER + self.nbytes)
        move_into(self.params, torch.frombuffer(segment, dtype=torch.uint8)[HEADER:])
        if self.fd >= 0:
            os.close(self.fd)  # the old mapping goes with its last view, dropped above
        self.fd, self.map, self.nonce, self.generation = fd, segment, nonce, generation
        return self.handle()

    def flat(self) -> torch.Tensor:
        """The parameters as one flat uint8 tensor, in the stream's order: what the ranks write and hash."""
        return torch.frombuffer(self.map, dtype=torch.uint8, offset=HEADER, count=self.nbytes)

    def handle(self) -> dict:
        """What a trainer rank needs to map the segment: picklable, checked by the nonce."""
        return {"path": f"/proc/{os.getpid()}/fd/{self.fd}", "nonce": self.nonce.hex(), "bytes": self.nbytes,
                "layout": self.layout, "generation": self.generation}


def move_into(params: list[torch.Tensor], data: torch.Tensor) -> None:
    """Each parameter's data becomes a view of `data` (flat uint8), laid end to end in order, its values copied in."""
    offset = 0
    with torch.no_grad():
        for p in params:
            n = p.numel() * p.element_size()
            view = data[offset:offset + n].view(p.dtype).view(p.shape)
            view.copy_(p.data)
            p.data = view
            offset += n


def create_segment(name: str, size: int) -> tuple[int, mmap.mmap, bytes]:
    """A memfd segment of `size` bytes, sealed against resizing (no SIGBUS by truncation), mapped and touched,
    with a random nonce in its first bytes; its fd is kept open: other processes reopen it through /proc."""
    fd = os.memfd_create(name, os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    segment = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    nonce = os.urandom(NONCE)
    segment[:NONCE] = nonce
    return fd, segment, nonce


def map_segment(path: str, name: str, size: int, nonce: str) -> mmap.mmap | None:
    """Another process's segment (`create_segment`) mapped into this one through `path` (/proc/<pid>/fd/<fd>),
    or None when this process cannot reach it (another host or pid namespace, a pid reused): its name, size and
    nonce are checked before it is mapped whole."""
    try:
        if not os.readlink(path).startswith(f"/memfd:{name}"):
            return None
        fd = os.open(path, os.O_RDWR)
        try:
            if os.fstat(fd).st_size != size:
                return None
            with mmap.mmap(fd, NONCE, prot=mmap.PROT_READ) as header:
                if header[:NONCE] != bytes.fromhex(nonce):
                    return None
            return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        finally:
            os.close(fd)
    except (OSError, ValueError):
        return None


def attach(handle: dict) -> torch.Tensor | None:
    """Trainer side: the engine's parameters as one flat uint8 tensor mapped into this process, or None when
    this process cannot reach that memory (another host or pid namespace, a pid reused, a malformed handle).
    The segment is checked (its name, size and nonce) before it is mapped whole; the mapping lives as long as
    the tensor."""
    try:
        segment = map_segment(handle["path"], NAME, HEADER + handle["bytes"], handle["nonce"])
    except (KeyError, TypeError):
        return None
    return None if segment is None else torch.frombuffer(segment, dtype=torch.uint8, offset=HEADER,
                                                         count=handle["bytes"])
