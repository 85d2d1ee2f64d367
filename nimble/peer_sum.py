"""A sum over the ranks of one host in one kernel that reads the peers' memory (issue 51): the
all-reduce of a tensor-parallel decode step's partial sums, a few KiB each, two a layer; and
the same kernel's all-gather (:meth:`PeerSum.gather`: a vocabulary-split head's logits).

NCCL's all-reduce of 8 KiB takes 13 µs inside a CUDA graph on two H200s (docs/results.md,
"One all-reduce on these two GPUs"), the floor under every split layer.  Here each rank copies
its tensor into a buffer that every rank maps (torch's symmetric memory), meets the others at a
flag in that memory and reads their copies over NVLink (:mod:`nimble.peer_sum_kernels` says
how and why one wait a call is enough).  The ranks add in rank order in float32, so every rank
holds the same bits.

:class:`PeerSum` owns a process group's buffers and pointer table; calling it on a tensor is
the operator ``nimble::peer_sum`` (its ``gather``, ``nimble::peer_gather``), opaque to
``torch.compile`` and recorded by Nimble as any kernel.  The kernel's name is one of :data:`nimble.ir.kernel_names.NIMBLE_COLLECTIVES`: a
prepared graph keeps its launches in order, and its buffers (reached through the table, which
the graph reads where it is) are never copied, snapshotted or restored.  It is one of
:data:`nimble.ir.waiting_kernels.WAITING_KERNELS` (it reads only the table before its wait): a
prepare with programmatic launch may make the edge into it programmatic.  As with any
collective, every rank must make the same calls: a rank whose peer never comes waits for ever.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from . import kernel_waits
from .errors import InputError

#: The most programs a call launches: every call launches all of its layout's, few enough to be
#: resident at once on any GPU (a program waits for its peers', which must be able to start).
MAX_PROGRAMS = 32
#: The fewest and the most elements a program sums at a time (its block; a power of two), and
#: the block from which a program runs on 8 warps rather than 4.
MIN_BLOCK, MAX_BLOCK, WIDE_BLOCK = 256, 4096, 2048
#: The dtypes the sum takes.
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: The alignment of the data slots in a buffer (bytes): whole cache lines.
ALIGN = 128

_KERNEL: list = []


@dataclass(frozen=True)
class PeerSumLayout:
    """Where each part lies in a rank's buffer: a flag per sending rank and program, a call
    counter per program (int32 words), then two data slots of ``slot_elements`` from
    ``data_at`` bytes on (:mod:`nimble.peer_sum_kernels`)."""

    ranks: int
    programs: int
    element_size: int
    capacity: int

    @classmethod
    def for_elements(cls, max_numel: int, ranks: int, dtype: torch.dtype,
                     max_programs: int = MAX_PROGRAMS) -> "PeerSumLayout":
        """The layout for calls of at most ``max_numel`` elements of ``dtype``."""
        if max_numel < 1 or ranks < 1:
            raise InputError(f"a peer sum of at most {max_numel} elements over {ranks} ranks: "
                             "both must be at least 1")
        if dtype not in DTYPES:
            raise InputError(f"the peer sum adds {', '.join(map(str, DTYPES))}, not {dtype}")
        programs = max(1, min(max_programs, -(-max_numel // MIN_BLOCK)))
        return cls(ranks, programs, torch.empty((), dtype=dtype).element_size(), max_numel)

    @property
    def slot_elements(self) -> int:
        """The elements of one data slot: the capacity, whole cache lines."""
        per_line = ALIGN // self.element_size
        return -(-self.capacity // per_line) * per_line

    @property
    def data_at(self) -> int:
        """The first data slot's offset in bytes: past the flags and counters."""
        words = (self.ranks + 1) * self.programs
        return -(-4 * words // ALIGN) * ALIGN

    @property
    def nbytes(self) -> int:
        """The size of one rank's buffer."""
        return self.data_at + 2 * self.slot_elements * self.element_size

    def block(self, numel: int) -> int:
        """The elements a program sums at a time in a call of ``numel``: a power of two that
        shares them out over the programs in one step where it can."""
        share = -(-numel // self.programs)
        return min(MAX_BLOCK, max(MIN_BLOCK, 1 << max(0, share - 1).bit_length()))


def _kernel():
    """The Triton kernel, imported on first use (no Triton import where no peer sum runs)."""
    if not _KERNEL:
        from .peer_sum_kernels import nimble_peer_sum_kernel

        _KERNEL.append(nimble_peer_sum_kernel)
    return _KERNEL[0]


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def check_call(x: torch.Tensor, layout: PeerSumLayout, table: torch.Tensor) -> None:
    """Refuse a call the kernel cannot make, saying what to pass (:class:`InputError`)."""
    if not isinstance(x, torch.Tensor):
        raise InputError(f"the peer sum adds a tensor, not {type(x).__name__}")
    if not x.is_cuda and not _interpreted():
        raise InputError(f"the peer sum runs on a GPU: move the tensor there (.cuda()), "
                         f"not on {x.device}")
    if x.device != table.device:
        raise InputError(f"the tensor is on {x.device}, the peer sum's buffers on "
                         f"{table.device}: call it on the device its group was made on")
    if torch.empty((), dtype=x.dtype).element_size() != layout.element_size \
            or x.dtype not in DTYPES:
        raise InputError(f"the peer sum was made for {layout.element_size}-byte elements, "
                         f"not {x.dtype}: make one per dtype")
    if x.numel() > layout.capacity:
        raise InputError(f"a peer sum of {x.numel()} elements: its buffers take "
                         f"{layout.capacity} (make it with a larger max_numel)")


def launch_peer_sum(x: torch.Tensor, table: torch.Tensor, rank: int,
                    layout: PeerSumLayout, gather: bool = False) -> torch.Tensor:
    """``x`` summed over the ranks whose buffers' addresses ``table`` holds (int64, in rank
    order, on ``x``'s device); a new tensor of ``x``'s shape.  With ``gather``, every rank's
    ``x`` stacked in rank order instead (``ranks x x.shape``)."""
    import triton

    check_call(x, layout, table)
    x = x.contiguous()
    out = x.new_empty((layout.ranks,) + tuple(x.shape)) if gather else x.new_empty(x.shape)
    n = x.numel()
    if n == 0:
        return out
    block = layout.block(n)
    _kernel()[(layout.programs,)](
        x, out, table, n, rank, layout.slot_elements, RANKS=layout.ranks,
        PROGRAMS=layout.programs,
        DATA_AT=layout.data_at, BLOCK=block, WAITS=kernel_waits.waits(x.device), GATHER=gather,
        num_warps=8 if block >= WIDE_BLOCK else 4)
    return out


@torch.library.custom_op("nimble::peer_sum", mutates_args=())
def peer_sum_op(x: torch.Tensor, table: torch.Tensor, rank: int, ranks: int, programs: int,
                capacity: int) -> torch.Tensor:
    """``x`` summed over the ranks by :func:`launch_peer_sum`, as one operator."""
    layout = PeerSumLayout(ranks, programs, x.element_size(), capacity)
    return launch_peer_sum(x, table, rank, layout)


@peer_sum_op.register_fake
def _peer_sum_shape(x, table, rank, ranks, programs, capacity):
    return x.new_empty(x.shape)  # contiguous, as the kernel writes it


@torch.library.custom_op("nimble::peer_gather", mutates_args=())
def peer_gather_op(x: torch.Tensor, table: torch.Tensor, rank: int, ranks: int, programs: int,
                   capacity: int) -> torch.Tensor:
    """Every rank's ``x`` stacked in rank order by :func:`launch_peer_sum`, as one operator."""
    layout = PeerSumLayout(ranks, programs, x.element_size(), capacity)
    return launch_peer_sum(x, table, rank, layout, gather=True)


@peer_gather_op.register_fake
def _peer_gather_shape(x, table, rank, ranks, programs, capacity):
    return x.new_empty((ranks,) + tuple(x.shape))


class PeerSum(torch.nn.Module):
    """Sums over the ranks of ``group`` (default: the world) of at most ``max_numel`` elements
    of ``dtype`` per call, on the current CUDA device (one per process, as NCCL's ranks); made
    with ``gathers``, a call gathers instead (:meth:`gather`).
    Made by every rank together (a rendezvous and a barrier); each buffer is freed by torch's
    symmetric memory when the last reference to it goes.

    A module whose ``table`` (the ranks' buffers' addresses, the one tensor its kernel is
    given) is a buffer of it, not saved in a ``state_dict`` (the addresses are this
    process's): a prepared graph reads it as one of the model's weights, by its name."""

    def __init__(self, max_numel: int, dtype: torch.dtype, device=None, group=None,
                 gathers: bool = False) -> None:
        import torch.distributed as dist

        super().__init__()
        self.gathers = gathers  # called, it gathers (:meth:`gather`) rather than sums

        if not dist.is_available() or not dist.is_initialized():
            raise InputError("a peer sum is made by every rank of a process group: call "
                             "torch.distributed.init_process_group first")
        import torch.distributed._symmetric_memory as symm_mem

        group = group or dist.group.WORLD
        self.rank, ranks = dist.get_rank(group), dist.get_world_size(group)
        self.layout = PeerSumLayout.for_elements(max_numel, ranks, dtype)
        device = torch.device(device) if device is not None else \
            torch.device("cuda", torch.cuda.current_device())
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:  # torch releases before symmetric memory was default
            enable(group.group_name)
        self.buffer = symm_mem.empty(self.layout.nbytes, dtype=torch.uint8, device=device)
        handle = symm_mem.rendezvous(self.buffer, group)
        self.buffer.zero_()  # no flag set and every counter at zero before any rank signals
        # the handle's pointers are its allocations' starts; the buffer lies at the same
        # offset into each (a symmetric allocation may share one)
        offset = self.buffer.data_ptr() - int(handle.buffer_ptrs[self.rank])
        self.register_buffer("table", torch.tensor(
            [int(p) + offset for p in handle.buffer_ptrs], dtype=torch.int64, device=device),
            persistent=False)
        self._handle = handle  # the peers' mappings live as long as it does
        torch.cuda.synchronize(device)
        dist.barrier(group)

    def __deepcopy__(self, memo) -> "PeerSum":
        # the ranks' buffers are one per group, as the group is: a copied model sums through
        # them too (a copy of the buffer would be mapped by no peer)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` summed over the ranks (every rank calls it with a tensor of one shape), or
        gathered where made with ``gathers``."""
        if self.gathers:
            return self.gather(x)
        if self.layout.ranks == 1:
            return x.clone()
        return torch.ops.nimble.peer_sum(x, self.table, self.rank, self.layout.ranks,
                                         self.layout.programs, self.layout.capacity)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` stacked in rank order (``ranks x x.shape``): an all-gather
        through the same buffers (and the same count of calls on every rank)."""
        if self.layout.ranks == 1:
            return x.unsqueeze(0).clone()
        return torch.ops.nimble.peer_gather(x, self.table, self.rank, self.layout.ranks,
                                            self.layout.programs, self.layout.capacity)
