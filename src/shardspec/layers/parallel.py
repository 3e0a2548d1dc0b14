"""Tensor-parallel plumbing: the rank's place in its group, and how a parameter is sliced."""

from __future__ import annotations

import hashlib
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardspec import kernels
from shardspec.layers import shm
from shardspec.layers.shm import ShmCollectives

Ranges = list[tuple[int, int]]


@dataclass(eq=False)
class TPGroup:
    """This rank's tensor-parallel group; size 1 needs no torch.distributed at all. `group`: the
    torch.distributed group (None: the default one). `symmetric`: small all-reduces go through
    symmetric memory (SymmetricReducer; see use_symmetric_memory)."""

    rank: int = 0
    size: int = 1
    group: Any = None
    symmetric: bool = False
    ordered: bool = False  # batch-invariant mode: sums in rank order (see all_reduce)
    shm: ShmCollectives | None = None  # CPU ranks on one host: collectives through shared memory
    _reducer: SymmetricReducer | None = field(default=None, init=False, repr=False)

    @property
    def path(self) -> str:
        """How its collectives go: shm, gloo, symm, nccl; "" for a group of one."""
        if self.size == 1:
            return ""
        if self.shm is not None:
            return "shm"
        return "symm" if self.symmetric else dist.get_backend(self.group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        if self.shm is not None and self.shm.fits(x):  # (in rank order: deterministic too)
            return self.shm.all_reduce(x)
        if self.ordered and self.size > 2:
            # a ring all-reduce adds an element's parts in an order that depends on where the element
            # falls in the tensor's chunks, so on the batch; two parts add the same either way
            parts = self.all_gather(x[None], dim=0)
            total = parts[0]
            for part in parts[1:]:
                total = total + part
            x.copy_(total)
            return x
        if self.symmetric and x.is_cuda and x.nbytes <= SymmetricReducer.MAX_BYTES:
            return self._symmetric()(x)
        dist.all_reduce(x, group=self.group)
        return x

    def all_reduce_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
        """(norm(sum of x over the group + residual), that sum) in one kernel, or None where the
        fused kernel does not apply: the symmetric-memory all-reduce only (it reads the peers'
        buffers), CUDA with the kernels and the option fused_norm, up to SymmetricReducer.NORM_ROWS rows."""
        if self.size == 1 or not (self.symmetric and kernels.settings.fused_norm and kernels.enabled(x)):
            return None
        return self._symmetric().rms_norm(x, residual, weight, eps)

    def _symmetric(self) -> SymmetricReducer:
        if self._reducer is None:  # made at the first (eager) all-reduce, the same one on every rank
            self._reducer = SymmetricReducer(self.group)
        return self._reducer

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.size == 1:
            return x
        if self.shm is not None and self.shm.fits(x):
            return self.shm.all_gather(x, dim)
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def split(self, n: int) -> tuple[int, int]:
        """This rank's [start, end) of n items split evenly (n divisible by size)."""
        per = n // self.size
        return self.rank * per, (self.rank + 1) * per


def host_key() -> int:
    """What ranks on one host share and ranks on others do not, as an int64: the host's name and
    boot, and the network namespace (emulated hosts on one machine are other hosts to the group)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()  # two hosts can share a name
        net = os.readlink("/proc/self/ns/net")
    except OSError:
        boot = net = ""
    digest = hashlib.blake2b(f"{socket.gethostname()}/{boot}/{net}".encode(), digest_size=7).digest()
    return int.from_bytes(digest, "little")


def one_host(size: int, group: Any, device: torch.device) -> bool:
    """Whether every rank of the group is on this host (a collective: every rank calls it)."""
    every = [torch.empty(1, dtype=torch.int64, device=device) for _ in range(size)]
    dist.all_gather(every, torch.tensor([host_key()], dtype=torch.int64, device=device), group=group)
    return len({int(key) for key in every}) == 1


def use_symmetric_memory(device: torch.device, size: int, group: Any = None) -> bool:
    """Whether a CUDA group takes the symmetric-memory all-reduce. The option allreduce symm (or shm)
    says yes, nccl (or gloo) no; by default (auto) yes where every rank is on this host and its GPU
    can reach every other rank's GPU directly (NVLink or PCIe peer access), which symmetric memory
    needs; a group that spans hosts keeps NCCL. A collective: every rank of the group calls it."""
    choice = kernels.settings.allreduce
    if device.type != "cuda" or size == 1 or choice in ("nccl", "gloo"):
        return False
    if choice in ("symm", "shm"):
        return True
    gpu = device.index if device.index is not None else torch.cuda.current_device()
    gpus = [torch.empty(1, dtype=torch.int64, device=device) for _ in range(size)]
    dist.all_gather(gpus, torch.tensor([gpu], dtype=torch.int64, device=device), group=group)
    reachable = one_host(size, group, device) and all(torch.cuda.can_device_access_peer(gpu, int(other))
                                                      for other in gpus if int(other) != gpu)
    agreed = torch.tensor([int(reachable)], dtype=torch.int64, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)  # every rank takes the same path
    return bool(agreed.item())


def cpu_shared_memory(rank: int, size: int, group: Any, timeout_s: float) -> ShmCollectives | None:
    """A CPU group's shared-memory collectives (layers.shm) where every rank is on this x86-64 host
    and the option allreduce is auto or shm (or symm); None for Gloo. A collective over `group`.
    ValueError where shm is asked for and cannot be."""
    choice = kernels.settings.allreduce
    if size == 1 or choice in ("gloo", "nccl"):
        return None
    if not (shm.supported() and one_host(size, group, torch.device("cpu"))):
        if choice == "shm":
            raise ValueError("--allreduce shm needs every rank of a TP group on one x86-64 Linux host")
        return None
    return ShmCollectives.join(rank, size, group, timeout_s)


class SymmetricReducer:
    """One-shot all-reduce through PyTorch's symmetric memory: every rank reads its peers' buffers
    directly over NVLink. For the small tensors of a decode step it takes a few microseconds where
    NCCL's ring takes tens."""

    MAX_BYTES = 1 << 20
    NORM_ROWS = 256  # rows of the fused all-reduce + norm: decode and verify passes, not long prefills

    def __init__(self, group: Any):
        from torch.distributed import _symmetric_memory as symm_mem

        self.symm_mem = symm_mem
        self.group = group or dist.group.WORLD
        self.group_name = self.group.group_name
        self.buffers: dict[torch.dtype, torch.Tensor] = {}
        self.norm_rings: dict[tuple[torch.dtype, int], _NormRing] = {}

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        buffer = self.buffers.get(x.dtype)
        if buffer is None:
            buffer = self.symm_mem.empty(self.MAX_BYTES // x.element_size(), dtype=x.dtype, device=x.device)
            self.symm_mem.rendezvous(buffer, self.group_name)
            self.buffers[x.dtype] = buffer
        x = x.contiguous()
        out = torch.empty_like(x)
        torch.ops.symm_mem.one_shot_all_reduce_copy_out(buffer[: x.numel()].view_as(x), x, "sum", self.group_name, out)
        return out

    def rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
        """The all-reduce fused with the residual add and RMSNorm after it (kernels.norm), or None
        for more rows than its buffers hold or a width its 16-byte loads do not divide. One kernel
        where there were two (the one-shot all-reduce, the add + norm) and the gap between them, 64
        times in a 9B decode step."""
        D = x.shape[-1]
        if D % 16:
            return None
        ring = self.norm_rings.get((x.dtype, D))
        if ring is None:
            ring = self.norm_rings[x.dtype, D] = _NormRing(self.symm_mem, self.group, x.dtype, D, x.device,
                                                           self.NORM_ROWS)
        if x.numel() // D > ring.rows:
            return None
        return kernels.norm.all_reduce_rms_norm(x, weight, eps, residual, ring.buffers, ring.pads, ring.epochs,
                                                ring.rows, ring.rank, ring.world)


class _NormRing:
    """The fused all-reduce + norm's state on one rank: a symmetric buffer of two slots of `rows`
    rows (each rank's copy readable by every peer), the device addresses of every rank's copy and
    signal pad, and a counter per row that picks the slot (see kernels.norm)."""

    def __init__(self, symm_mem: Any, group: Any, dtype: torch.dtype, width: int, device: torch.device,
                 rows: int):
        buffer = symm_mem.empty(2 * rows * width, dtype=dtype, device=device)
        handle = symm_mem.rendezvous(buffer, group.group_name)
        self.rank, self.world = handle.rank, handle.world_size
        self.rows = min(rows, handle.signal_pad_size // (4 * self.world))  # a 4-byte flag per row and peer
        # where the buffer starts in each rank's symmetric allocation (a pool may place it anywhere)
        offset = torch.tensor([buffer.data_ptr() - handle.buffer_ptrs[self.rank]], dtype=torch.int64, device=device)
        offsets = torch.empty(self.world, dtype=torch.int64, device=device)
        dist.all_gather_into_tensor(offsets, offset, group=group)
        self.buffers = torch.tensor(handle.buffer_ptrs, dtype=torch.int64, device=device) + offsets
        self.pads = torch.tensor(list(handle.signal_pad_ptrs), dtype=torch.int64, device=device)
        self.epochs = torch.zeros(rows, dtype=torch.int64, device=device)
        self._keep = buffer, handle


@dataclass(frozen=True)
class SliceSpec:
    """How a rank's parameter is cut from the checkpoint (models.loader reads it by this; a layer
    holds one per parameter in its `slice_specs`, default WHOLE).

    cut: (dim, ranges): the concatenation along dim of those ranges of one tensor; ranges past its
        end read as zeros (vocabulary padding).
    parts: the rows `ranges` of each named sibling tensor, stacked in order: several projections of
        one input held as one weight (`in_proj.weight` made of `in_proj_qkv.weight`, ...); the
        names replace the module's own in the checkpoint key.
    experts: [first, end): whole experts one after the other, each cut by `cut` or `parts`.
    source: the parameter's weight as the unquantised layer holds it, where it is another leaf
        (a quantised layer's `rest` rows come from `weight`).
    block: > 0: the block scales of `source` (`{source}_scale_inv`, one per block × block; ranges
        in blocks)."""

    cut: tuple[int, Ranges] | None = None
    parts: tuple[tuple[str, Ranges], ...] | None = None
    experts: tuple[int, int] | None = None
    source: str = ""
    block: int = 0


WHOLE = SliceSpec()  # a replicated parameter: the whole checkpoint tensor


def slice_specs(model: nn.Module) -> dict[str, SliceSpec]:
    """Every parameter's spec, by its name in `model`."""
    specs = {}
    for name, _ in model.named_parameters():
        module, _, leaf = name.rpartition(".")
        specs[name] = getattr(model.get_submodule(module), "slice_specs", {}).get(leaf, WHOLE)
    return specs
