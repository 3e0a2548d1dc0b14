"""Triton kernels for the CUDA path.

Each kernel fuses a run of small PyTorch operations of one layer into a single launch: a decode step
of a 32-layer model otherwise launches thousands of tiny kernels, and even inside a CUDA graph each
costs a few microseconds of GPU time. The pure-PyTorch code in `shardspec.layers` stays the CPU path
and the reference; each kernel reproduces its rounding steps (bf16 where the reference rounds to
bf16), so the two agree within float32 rounding, or a bf16 ulp or two.

`enabled(x)` says whether a tensor takes the kernel path: CUDA tensors when Triton is installed,
unless the options turn the kernels off (for comparisons). The tests also run every kernel on the CPU
through Triton's interpreter (TRITON_INTERPRET=1).

`settings` holds this process's WorkerOptions, which the kernels and layers read when they run: a
worker sets them from its init request (`use`) before it builds a model; elsewhere they are the
defaults. Read them as `kernels.settings.<field>`, never bound to a name at import.
"""

from __future__ import annotations

import os

import torch

from shardspec.protocol.messages import WorkerOptions


def _import_triton() -> bool:
    """Triton where a kernel can run: a GPU, or its interpreter (TRITON_INTERPRET=1, the tests).
    A CPU-only process skips the import, a few tenths of a second of every CPU worker's start."""
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:  # the CPU wheel of torch comes without Triton
        return False
    return True


HAVE_TRITON = _import_triton()

settings = WorkerOptions()


def use(options: WorkerOptions) -> None:
    """Make `options` this process's settings (before a model is built: some apply at construction)."""
    global settings
    settings = options


def active() -> bool:
    """Whether the kernels run at all: Triton is here and the options leave them on."""
    return HAVE_TRITON and settings.kernels


def enabled(x: torch.Tensor) -> bool:
    return active() and x.is_cuda


def rows(x: torch.Tensor) -> torch.Tensor:
    """x as a 2-D [rows, last dim] view with unit stride along the last dim (a copy if it must)."""
    x = x.reshape(-1, x.shape[-1])
    return x if x.stride(-1) == 1 else x.contiguous()


if HAVE_TRITON:  # the kernel modules need Triton to import; callers check enabled() first
    from shardspec.kernels import attention, fp8, gdn, gemv, head, moe, norm  # noqa: F401
