"""Triton kernels for the CUDA path.

Each kernel fuses a run of small PyTorch operations of one layer into a single launch: a decode step
of a 32-layer model otherwise launches thousands of tiny kernels, and even inside a CUDA graph each
costs a few microseconds of GPU time. The pure-PyTorch code in `shardspec.layers` stays the CPU path
and the reference; each kernel reproduces its rounding steps (bf16 where the reference rounds to
bf16), so the two agree within float32 rounding, or a bf16 ulp or two.

`enabled(x)` says whether a tensor takes the kernel path: CUDA tensors when Triton is installed,
unless SHARDSPEC_KERNELS=0 (for comparisons). The tests also run every kernel on the CPU through
Triton's interpreter (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import os

import torch


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

ENABLED = HAVE_TRITON and os.environ.get("SHARDSPEC_KERNELS", "1") != "0"


def enabled(x: torch.Tensor) -> bool:
    return ENABLED and x.is_cuda


def rows(x: torch.Tensor) -> torch.Tensor:
    """x as a 2-D [rows, last dim] view with unit stride along the last dim (a copy if it must)."""
    x = x.reshape(-1, x.shape[-1])
    return x if x.stride(-1) == 1 else x.contiguous()


if HAVE_TRITON:  # the kernel modules need Triton to import; callers check enabled() first
    from shardspec.kernels import attention, fp8, gdn, gemv, head, moe, norm  # noqa: F401
