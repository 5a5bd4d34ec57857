"""How much memory a device can still give: the host's (Linux MemAvailable) or a CUDA device's (free plus what
torch's caching allocator holds unused). Used to size work before it starts rather than fail halfway."""
from __future__ import annotations

import os
import re
from typing import Sequence, TypeVar

T = TypeVar("T")

# Host memory for one chunk of a block's experts compressed together on the CPU (dense fp32 copies, results,
# a method's per-expert state): with the block loop's other copies, a process then holds a few blocks' worth.
HOST_CHUNK_BYTES = 256 << 20


def available_memory_bytes() -> int | None:
    """Memory the system can give new processes (Linux MemAvailable), else free pages, else None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _cuda_cap_bytes(device) -> int | None:
    """The process's own limit on `device` (torch.cuda.set_per_process_memory_fraction × its memory), or None."""
    import torch

    get = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if get is None:
        return None
    fraction = get(device)
    if fraction >= 1.0:
        return None
    return int(fraction * torch.cuda.get_device_properties(device).total_memory)


def device_available_bytes(device) -> int | None:
    """Bytes a new allocation on `device` can still get: a CUDA device's free memory plus its cached, unused
    blocks (torch's allocator hands those out again, and frees them to the driver before it gives up), never more
    than the process's own cap leaves; the host's available memory for the CPU (None when the system does not
    say). What sizes work chunks before they start: the driver's free memory alone shrank by the ~50 GiB a
    block's work left cached, and later blocks then sized for a fraction of the card."""
    if device.type == "cuda":
        import torch

        free, _ = torch.cuda.mem_get_info(device)
        allocated = torch.cuda.memory_allocated(device)
        available = free + torch.cuda.memory_reserved(device) - allocated
        cap = _cuda_cap_bytes(device)
        return available if cap is None else max(0, min(available, cap - allocated))
    return available_memory_bytes()


def use_expandable_segments() -> None:
    """Ask torch's CUDA allocator for expandable segments unless the user configured it (PYTORCH_CUDA_ALLOC_CONF):
    a block's phases free and allocate tensors of very different sizes (refinement's state, then one pass over an
    expert's rows), and fixed segments left ~13 GiB reserved but unusable for the next request on an 80 GB card.
    Takes effect for the allocations made after it; call it before the first CUDA allocation."""
    if "PYTORCH_CUDA_ALLOC_CONF" in os.environ or "PYTORCH_ALLOC_CONF" in os.environ:
        return
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"


def size(nbytes: float) -> str:
    """Bytes for a person: 19.1 GiB, 512.0 KiB."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{int(nbytes)} B"


def parse_size(text: str) -> int:
    """'5GB', '500MB', '2GiB', '1000000' -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*", str(text), re.IGNORECASE)
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"--max-shard-size {text!r}: expected a size such as 5GB, 500MB or 2GiB")
    unit = m.group(2).upper()
    power = "KMGT".find(unit) + 1 if unit else 0
    size = int(float(m.group(1)) * (1024 if m.group(3) else 1000) ** power)
    if size < 1:
        raise ValueError(f"--max-shard-size {text!r}: less than one byte; expected a size such as 5GB, 500MB or 2GiB")
    return size


def consecutive_chunks(items: Sequence[T], sizes: Sequence[float], budget: float) -> list[list[T]]:
    """`items` in order, cut into consecutive chunks whose sizes sum to at most `budget`; an item larger than
    the budget gets a chunk of its own."""
    chunks: list[list[T]] = []
    used = 0.0
    for item, size in zip(items, sizes):
        if chunks and used + size <= budget:
            chunks[-1].append(item)
            used += size
        else:
            chunks.append([item])
            used = size
    return chunks


_LIBC_TRIM = None  # glibc's malloc_trim, once looked up (False where the C library has none)


def release_freed_memory() -> None:
    """Hand memory freed by the C allocator back to the system (glibc's malloc_trim(0)); nothing elsewhere.

    glibc keeps freed heap pages mapped: tensors of up to its (self-raising) mmap threshold come from the heap,
    so a block's worth of freed per-expert tensors stays in the resident set unless trimmed. Called after each
    block, it keeps the peak at what the block loop holds rather than at what it ever held."""
    global _LIBC_TRIM
    if _LIBC_TRIM is None:
        _LIBC_TRIM = False
        try:
            import ctypes
            import ctypes.util

            name = ctypes.util.find_library("c")
            trim = getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
            if trim is not None:
                trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
                _LIBC_TRIM = trim
        except OSError:
            pass
    if _LIBC_TRIM:
        _LIBC_TRIM(0)


def release_device_cache() -> None:
    """After an out-of-memory error: collect the failed attempt's tensors and give torch's cached CUDA blocks back,
    so a smaller retry can use them."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
