"""Keep freed memory in the engine process, so a received KV frame does not page-fault.

libzmq allocates every received message with malloc in its I/O thread; a KV frame is
8 MiB, freed by the receiver's thread once written into the pool. glibc adapts its
thresholds to such blocks (M_MMAP_THRESHOLD up to the largest block freed, M_TRIM_THRESHOLD
to twice that) and, once free memory at an arena heap's top passes the trim threshold
(two frames), hands it back to the kernel: the next frames touch fresh pages, each one a
page fault and a zeroed page. On loopback an 8k-token transfer (67 MB, 16,384 pages)
faulted 0-8,000 pages on the decode side, ~4,000 on average.

Fixing the thresholds (mallopt, as the MALLOC_*_ environment variables would) stops the
adapting: blocks up to MMAP_THRESHOLD come from the heap, and up to TRIM_THRESHOLD of
free memory stays mapped for the next frames (about 0 faults a transfer on a quiet
machine; tests/test_transfer_heap.py replays the pattern). Torch's CPU tensors up to
32 MiB (a prefill's activations) are served the same way.
"""

from __future__ import annotations

import ctypes
import logging
import os

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameter numbers
MMAP_THRESHOLD = 32 << 20  # glibc's ceiling for it on 64-bit
TRIM_THRESHOLD = 128 << 20  # > the frames one transfer has in flight (8 MiB each)
ENV_OVERRIDES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def keep_freed_memory() -> bool:
    """Set both thresholds for this process. A no-op (False) where the C library is not
    glibc, or where the user set either through the environment (theirs wins)."""
    if any(name in os.environ for name in ENV_OVERRIDES):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    ok = ok and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if not ok:
        log.info("mallopt refused the heap thresholds: freed KV frames go back to the kernel")
    return ok
