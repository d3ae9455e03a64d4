"""Programmatic dependent launch (PDL) between the kernels of a decode layer.

Between two dependent kernels the GPU normally drains the first before it launches the
second: ~0.4 us a boundary with nothing running (measured in benchmarks/RESULTS.md, 2026-12-02 "third"), a dozen
boundaries a layer. With PDL (sm_90 and later) a kernel lets its successor launch once all
of its own programs have started (`release_next`), and the successor, launched with
`launch_pdl=True`, runs until `wait_for_previous`, which returns when the predecessor has
finished and its writes are visible. What a successor does before that wait may read only
memory no earlier kernel of the step writes (weights); everything else comes after.

A kernel launched with PDL must wait before touching activations even where it reads
nothing of its direct predecessor: the wait is also what orders it after the kernels
before that one. cuBLAS's kernels take no part, so after one of them a PDL launch simply
waits for it to finish, as without PDL.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from rlserve import envs

# RLSERVE_PDL=0 launches every kernel plainly (a debugging aid; results are the same).
ENABLED = envs.RLSERVE_PDL.get()


@functools.cache
def _capable(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    _AVAILABLE = True
except ImportError:  # an older Triton without the PDL intrinsics: kernels launch plainly
    gdc_launch_dependents = gdc_wait = None
    _AVAILABLE = False


def enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL: CUDA on sm_90 or later."""
    if not (ENABLED and _AVAILABLE) or device.type != "cuda":
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


def launch_options(pdl: bool) -> dict:
    """The launch keyword of a kernel that waits (none where PDL is off, so a Triton
    without the option never sees it)."""
    return {"launch_pdl": True} if pdl else {}


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    if PDL:
        gdc_wait()


@triton.jit
def release_next(PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
