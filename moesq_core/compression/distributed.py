"""Expert parallel across processes: joining torch.distributed from torchrun's environment, and launching
torchrun for `--nproc N`.

Under torchrun (RANK, WORLD_SIZE, LOCAL_RANK set, WORLD_SIZE > 1) a stage command joins the process group:
NCCL with device cuda:LOCAL_RANK when it computes on GPUs, gloo on the CPU. The engine then shards each
block's experts over the ranks (engine.py); rank 0 alone writes the work dir and prints. Collectives time
out after $MOESQ_DIST_TIMEOUT seconds (default 1800: a rank may wait that long for a slower one), so a rank
whose peer died or hung stops with an error instead of waiting forever; torchrun itself stops the other
ranks as soon as one fails.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import os
import pickle
import re
import signal
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

TIMEOUT_ENV = "MOESQ_DIST_TIMEOUT"
DEFAULT_TIMEOUT_S = 1800

log = logging.getLogger("moesq")


class PeerFailed(RuntimeError):
    """A collective failed: another rank stopped (or did not answer within the timeout)."""


class RankZeroFailed(RuntimeError):
    """Rank 0 failed at a step that it runs first for all ranks; it reports the error, the others only stop."""


# -- where this process stands ---------------------------------------------------------------------------------
def launched_world() -> int:
    """WORLD_SIZE of the torchrun launch this process is part of (1 when not launched by torchrun)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def launched_rank() -> int:
    """RANK of this process in a torchrun launch (0 when not launched by torchrun)."""
    if launched_world() <= 1:
        return 0
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def is_main_process() -> bool:
    """True for rank 0 of a torchrun launch and for a plain (single) process: the one that prints."""
    return launched_rank() == 0


def active():
    """torch.distributed when a process group of more than one rank is up, else None."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist
    return None


def timeout() -> datetime.timedelta:
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None:
        return datetime.timedelta(seconds=DEFAULT_TIMEOUT_S)
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r}: must be a number of seconds > 0")
    return datetime.timedelta(seconds=seconds)


def rank_device(device: str | None) -> str | None:
    """The device this rank computes on: under torchrun on GPUs cuda:LOCAL_RANK (--device auto or cuda),
    else `device` unchanged. Raises ValueError naming --device when the launch cannot work as asked."""
    import torch

    if launched_world() <= 1:
        return device
    dev = device or "auto"
    if dev == "cpu" or (dev == "auto" and not torch.cuda.is_available()):
        return "cpu"
    if dev.startswith("cuda:"):
        raise ValueError(f"--device {dev}: with several processes each rank uses the GPU cuda:LOCAL_RANK; "
                         "give --device cuda (or auto)")
    if not torch.cuda.is_available():
        raise ValueError(f"--device {dev}: no CUDA GPU is visible; use --device cpu (or auto)")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if local >= torch.cuda.device_count():
        raise ValueError(f"--device {dev}: LOCAL_RANK {local} but only {torch.cuda.device_count()} GPU(s) are "
                         "visible; start at most one process per GPU")
    return f"cuda:{local}"


@contextlib.contextmanager
def process_group(device: str | None):
    """Join torchrun's process group for the duration of a command (no-op in a plain single process);
    yields the device to compute on (see rank_device)."""
    import torch
    import torch.distributed as dist

    if launched_world() <= 1 or dist.is_initialized():
        yield device
        return
    dev = rank_device(device)
    wait = timeout()
    if dev.startswith("cuda"):
        torch.cuda.set_device(dev)
        # device_id binds the communicator to this rank's GPU (barriers and object collectives use it)
        dist.init_process_group("nccl", timeout=wait, device_id=torch.device(dev))
    else:
        dist.init_process_group("gloo", timeout=wait)
    log.info("expert parallel: rank %d of %d on %s (%s)", dist.get_rank(), dist.get_world_size(), dev,
             dist.get_backend())
    try:
        yield dev
    finally:
        dist.destroy_process_group()


# -- collectives with a clear error ----------------------------------------------------------------------------
@dataclasses.dataclass
class Traffic:
    """What this rank's collectives moved: payload bytes it contributed (`sent`) and got from the other ranks
    (`received`), the seconds spent in them (waiting for the slowest rank included) and how many there were."""

    sent: int = 0
    received: int = 0
    seconds: float = 0.0
    calls: int = 0

    def line(self) -> str:
        from moesq_core.memory import size

        return (f"sent {size(self.sent)} ({self.sent:,} B), received {size(self.received)} ({self.received:,} B) "
                f"in {self.calls} collectives, {self.seconds:.2f} s")


_traffic = Traffic()


def take_traffic() -> Traffic:
    """This process's collectives since the last call (the engine logs them per block)."""
    global _traffic
    taken, _traffic = _traffic, Traffic()
    return taken


@contextlib.contextmanager
def _collective(what: str, sent: int = 0, received: int = 0):
    t0 = time.perf_counter()
    try:
        yield
        _traffic.sent += sent
        _traffic.received += received
        _traffic.calls += 1
        _traffic.seconds += time.perf_counter() - t0
    except RuntimeError as e:  # DistBackendError, gloo's "Connection closed by peer", timeouts
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        first = re.sub(r"^\[[^\]]*\]\s*", "", first)  # gloo's "[.../pair.cc:553] " source location
        raise PeerFailed(f"{what}: another rank stopped or did not answer within {timeout().total_seconds():.0f} s "
                         f"({first}); finished blocks are saved: re-run the same command to resume") from e


def barrier(what: str) -> None:
    dist = active()
    if dist is not None:
        with _collective(what):
            dist.barrier()


def all_gather_object(obj, what: str) -> list:
    """[obj of rank 0, obj of rank 1, ...]; [obj] without a process group."""
    dist = active()
    if dist is None:
        return [obj]
    out = [None] * dist.get_world_size()
    with _collective(what, sent=len(pickle.dumps(obj))):
        dist.all_gather_object(out, obj)
    _traffic.received += sum(len(pickle.dumps(o)) for r, o in enumerate(out) if r != dist.get_rank())
    return out


def all_gather_tensors(tensors: list[torch.Tensor], device, what: str) -> list[list[torch.Tensor]]:
    """[tensors of rank 0, tensors of rank 1, ...] for ranks holding tensors of the same shapes and dtypes: raw
    bytes through the collective (on `device`, the rank's GPU with NCCL), no pickling; [tensors] alone."""
    import torch

    dist = active()
    if dist is None:
        return [tensors]
    flat = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    sizes = [f.numel() for f in flat]
    buf = torch.cat(flat).to(device) if flat else torch.zeros(0, dtype=torch.uint8, device=device)
    out = [torch.empty_like(buf) for _ in range(dist.get_world_size())]
    with _collective(what, sent=buf.numel(), received=buf.numel() * (len(out) - 1)):
        dist.all_gather(out, buf)
    del flat, buf
    gathered = []
    for r in range(len(out)):
        b, out[r] = out[r], None  # each rank's buffer freed once split: one block's results, not twice over
        parts, start = [], 0
        for t, n in zip(tensors, sizes):
            parts.append(b[start : start + n].clone().view(t.dtype).reshape(t.shape))  # clone: aligned storage
            start += n
        gathered.append(parts)
        del b
    return gathered


def broadcast(t: "torch.Tensor", src: int, what: str) -> None:
    """t (in place on every rank) = rank src's t; nothing without a process group."""
    dist = active()
    if dist is not None:
        nbytes = t.numel() * t.element_size()
        mine = dist.get_rank() == src
        with _collective(what, sent=nbytes if mine else 0, received=0 if mine else nbytes):
            dist.broadcast(t, src)


def main_first(fn, *args, **kwargs):
    """Run fn on rank 0 first, then on the other ranks (which then find its writes done, e.g. the work dir
    calibrated, and only check them). If it fails on rank 0, the others raise RankZeroFailed without running
    it (rank 0 reports the error)."""
    dist = active()
    if dist is None:
        return fn(*args, **kwargs)
    failure = None
    if dist.get_rank() == 0:
        try:
            result = fn(*args, **kwargs)
        except Exception as e:
            failure = e
    box = [None if failure is None else f"{type(failure).__name__}: {failure}"]
    with _collective(f"waiting for rank 0 ({getattr(fn, '__name__', 'setup')})"):
        dist.broadcast_object_list(box, src=0)
    if failure is not None:
        raise failure
    if box[0] is not None:
        raise RankZeroFailed(f"rank 0 failed: {box[0]}")
    return result if dist.get_rank() == 0 else fn(*args, **kwargs)


# -- `--nproc N`: torchrun started from the command itself -----------------------------------------------------
def check_launch(nproc: int, device: str | None) -> None:
    """Refuse (ValueError naming the option) a --nproc launch that cannot work, before anything starts."""
    import torch

    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    if nproc > 1 and launched_world() > 1:
        raise ValueError(f"--nproc {nproc}: this process already runs under torchrun (WORLD_SIZE="
                         f"{launched_world()}); give either --nproc or torchrun, not both")
    dev = device or "auto"
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if nproc > 1 and dev != "cpu" and (gpus or dev.startswith("cuda")):
        if dev.startswith("cuda:"):
            raise ValueError(f"--device {dev}: with --nproc each rank uses its own GPU; give --device cuda (or auto)")
        if nproc > gpus:
            raise ValueError(f"--nproc {nproc}: only {gpus} CUDA GPU(s) are visible (one process per GPU); "
                             f"give --nproc {max(gpus, 1)} or --device cpu")


def without_option(argv: list[str], option: str) -> list[str]:
    """argv with `option VALUE` / `option=VALUE` removed (every occurrence)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == option:
            skip = True
        elif not a.startswith(option + "="):
            out.append(a)
    return out


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, e.g. a container's or `taskset`'s share), which can
    be fewer than the machine has."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # no affinity call on this platform
        return os.cpu_count() or 1


def threads_per_rank(nproc: int, cpus: int | None = None) -> int:
    """Each of `nproc` ranks' share of `cpus` (default: the CPUs this process may use), at least one."""
    return max(1, (cpus if cpus is not None else usable_cpus()) // nproc)


def launch(nproc: int, argv: list[str]) -> tuple[int, str | None]:
    """Run `python -m moesq_cli ARGV` as `nproc` ranks under torchrun on this machine (standalone rendezvous
    on a free port) and wait. Returns (exit code, a one-line error when a rank died without reporting one)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    if "OMP_NUM_THREADS" not in os.environ:  # share the cores (torchrun's default would be 1 thread per rank)
        os.environ["OMP_NUM_THREADS"] = str(threads_per_rank(nproc))
    for name in ("torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher"):
        logging.getLogger(name).setLevel(logging.CRITICAL)  # the ranks report; the agent's log is noise here
    args = parse_args(["--standalone", "--nnodes", "1", "--nproc-per-node", str(nproc), "--max-restarts", "0",
                       "--module", "moesq_cli", *argv])
    try:
        run(args)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        code = failure.exitcode
        if code > 0:
            return code, None  # the rank printed its error
        try:
            why = f"killed by {signal.Signals(-code).name}"
        except ValueError:
            why = f"exited with code {code}"
        return 1, f"rank {rank} was {why}; the other ranks were stopped"
    return 0, None

