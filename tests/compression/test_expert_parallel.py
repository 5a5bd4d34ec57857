"""Expert parallel from the command line, on the CPU (gloo): `moesq … --nproc 2` and `torchrun … moesq …` write
the artifacts one process writes, byte for byte (init-sgptq and refine); bad options are refused once; a rank
that dies stops the others with a clear message and the same command resumes from the finished blocks."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from moesq_runner import ENV, MOESQ, moesq, moesq_here

# batches of 2 sequences: each rank runs the decoder-layer passes of every other batch (and broadcasts them)
BATCHES = ["--batch-size", "2"]
SMALL = ["--seq-len", "32", "--n-train", "4", "--n-val", "2", "--n-init", "8", *BATCHES]
# a short refinement whose logits can move patterns (so the per-expert Gumbel noise matters)
SHORT = ["--epochs", "3", "--steps-per-epoch", "4", "--lr-logits", "0.01"]
REFINE = [*SHORT, "--device", "cpu", *BATCHES]
# one thread per process, the reference and each rank alike: CPU reductions depend on the thread count
ONE_THREAD = {**ENV, "OMP_NUM_THREADS": "1"}


def _blocks(wd: Path, stage: str) -> dict:
    m = json.loads((wd / "manifest.json").read_text())
    return {k: v["sha256"] for k, v in m["stages"].get(stage, {}).get("blocks", {}).items()}


@pytest.fixture(scope="module")
def single(micro_path, tmp_path_factory) -> Path:
    """A work dir whose init-sgptq and refine stages one process computed (this one, on one thread as each rank:
    no process boundary is under test in the reference)."""
    wd = tmp_path_factory.mktemp("ep") / "single"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        moesq_here("init-sgptq", "--model", micro_path, "-w", wd, *SMALL, "--device", "cpu", "-q")
        r = moesq_here("refine", "-w", wd, *REFINE, "-q")
    finally:
        torch.set_num_threads(threads)
    assert "patterns can change" in r.stderr
    return wd


def test_two_processes_write_the_artifacts_of_one(single, micro_path, tmp_path):
    # each rank one thread, as the reference: CPU reductions (and so the bytes) depend on the thread count
    wd = tmp_path / "two"
    r = moesq("init-sgptq", "--model", micro_path, "-w", wd, *SMALL, "--device", "cpu", "--nproc", "2", env=ONE_THREAD)
    assert r.stdout.count("stage init-sgptq: 4 blocks (4 computed now)") == 1
    r = moesq("refine", "-w", wd, *REFINE, "--nproc", "2", env=ONE_THREAD)
    assert r.stdout.count("stage refine: 4 blocks (4 computed now)") == 1  # rank 0 alone prints
    assert r.stderr.count("refine schedule:") == 1
    for stage in ("init-sgptq", "refine"):
        assert _blocks(wd, stage) == _blocks(single, stage) and len(_blocks(wd, stage)) == 4, stage
    m = json.loads((wd / "manifest.json").read_text())
    assert m["stages"]["refine"]["summary"]["world_size"] == 2
    # what each rank sent and received per block is logged, and the two ranks' accounts agree: every byte one sent
    # (its share of the results, its batches of the layer passes, its experts' metadata) the other received
    import re

    traffic = re.compile(r"refine: layer (\d+) expert-parallel traffic \(rank (\d) of 2\): sent [^(]*\(([\d,]+) B\), "
                         r"received [^(]*\(([\d,]+) B\) in (\d+) collectives, ([\d.]+) s")
    seen = {}
    for line in (wd / "logs" / "moesq.log").read_text().splitlines():
        if (hit := traffic.search(line)):
            sent, received = int(hit[3].replace(",", "")), int(hit[4].replace(",", ""))
            seen[int(hit[1]), int(hit[2])] = (sent, received)
            assert sent > 0 and received > 0 and int(hit[5]) > 0
    assert sorted(seen) == [(layer, rank) for layer in range(4) for rank in (0, 1)]
    for layer in range(4):
        (s0, r0), (s1, r1) = seen[layer, 0], seen[layer, 1]
        assert abs(s0 - r1) <= 0.01 * s0 and abs(s1 - r0) <= 0.01 * s1, (layer, seen[layer, 0], seen[layer, 1])
    # some shipped experts moved patterns, i.e. the random numbers mattered
    from safetensors import safe_open

    changed = 0
    for rec in m["stages"]["refine"]["blocks"].values():
        with safe_open(str(wd / rec["file"]), "pt") as f:
            info = json.loads(f.metadata()["moesq"])["info"]
            changed += sum(e["refine"].get("groups_changed", 0) for e in info.values())
    assert changed > 0


def test_nproc_shares_out_the_cpus_this_process_may_use():
    """`--nproc N` gives each rank its share of the CPUs this process may run on (its affinity, not the
    machine's count), at least one thread."""
    from moesq_core.compression.distributed import threads_per_rank

    assert [threads_per_rank(n, cpus=8) for n in (1, 2, 3, 8, 16)] == [8, 4, 2, 1, 1]
    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("no CPU affinity on this platform")
    code = ("import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
            "from moesq_core.compression.distributed import usable_cpus, threads_per_rank; "
            "print(usable_cpus(), threads_per_rank(1), threads_per_rank(2))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["1", "1", "1"]


@pytest.mark.slow
def test_torchrun_launch_writes_the_artifacts_of_one(single, tmp_path):
    """The documented torchrun form: `torchrun --nproc-per-node 2 $(which moesq) refine ...`."""
    import shutil

    torchrun = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
    wd = tmp_path / "wd"
    shutil.copytree(single, wd)
    stage = [*REFINE, "--refine-seed", "3", "--stage", "refine-seed3", "-q"]
    r = subprocess.run([MOESQ, "refine", "-w", str(single), *stage], env=ONE_THREAD, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([torchrun, "--nproc-per-node", "2", MOESQ, "refine", "-w", str(wd), *stage], env=ENV,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("stage refine-seed3: 4 blocks (4 computed now)") == 1
    assert _blocks(wd, "refine-seed3") == _blocks(single, "refine-seed3")
    assert json.loads((wd / "manifest.json").read_text())["stages"]["refine-seed3"]["summary"]["world_size"] == 2


def test_bad_options_are_refused_once(tmp_path):
    # --nproc: refused before any process starts
    r = moesq_here("refine", "-w", tmp_path / "a", "--nproc", "2", "--device", "cuda:1", check=False)
    assert r.returncode == 2 and "--device cuda:1" in r.stderr and not (tmp_path / "a").exists()
    r = moesq_here("refine", "-w", tmp_path / "a", "--nproc", "0", check=False)
    assert r.returncode == 2 and "--nproc" in r.stderr
    # ranks of a torchrun launch (its environment): every rank validates and exits 2, rank 0 alone prints
    for bad in (["--values-only", "--support-only"], ["--epochs", "-1"]):
        env = {**ONE_THREAD, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29581"}
        ps = [subprocess.Popen([MOESQ, "refine", "-w", str(tmp_path / "b"), *bad, "--device", "cpu"],
                               env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True) for r in range(2)]
        outs = [p.communicate(timeout=120) for p in ps]
        assert [p.returncode for p in ps] == [2, 2], outs
        assert bad[0] in outs[0][1] and outs[1] == ("", ""), outs
    assert not (tmp_path / "b").exists()


def _rank_pid(parent: int, rank: int) -> int | None:
    """The pid of the given rank among a process's descendants (from their environment)."""
    import psutil

    for c in psutil.Process(parent).children(recursive=True):
        try:
            if c.environ().get("RANK") == str(rank) and c.environ().get("WORLD_SIZE"):
                return c.pid
        except psutil.Error:
            pass
    return None


def _wait_for_block(proc, wd: Path, stage: str, timeout: float = 300) -> None:
    t0 = time.time()
    while len(_blocks(wd, stage)) < 1 if (wd / "manifest.json").is_file() else True:
        assert proc.poll() is None, "the run ended before its first block was written"
        assert time.time() - t0 < timeout
        time.sleep(0.1)


@pytest.mark.slow
def test_killed_rank_stops_the_run_and_it_resumes(single, micro_path, tmp_path):
    """SIGKILL one rank of `--nproc 2` once a block is written: the run stops with one line naming the rank,
    the other is stopped; the same command then computes only the missing blocks, with the same bytes."""
    import shutil

    wd = tmp_path / "wd"
    shutil.copytree(single, wd)
    slow = ["--epochs", "12", "--steps-per-epoch", "4", "--lr-logits", "0.01", "--device", "cpu", "--stage", "rk",
            *BATCHES]
    ref = subprocess.run([MOESQ, "refine", "-w", str(single), *slow, "-q"], env=ONE_THREAD, capture_output=True,
                         text=True, timeout=600)
    assert ref.returncode == 0, ref.stderr
    cmd = [MOESQ, "refine", "-w", str(wd), *slow, "--nproc", "2", "-q"]
    p = subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_block(p, wd, "rk")
        victim = _rank_pid(p.pid, 1)
        assert victim is not None
        os.kill(victim, signal.SIGKILL)
        out, err = p.communicate(timeout=300)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 1, err
    assert err.strip().splitlines()[-1].startswith("error: rank 1 was killed by SIGKILL"), err
    assert "re-run the same command to resume" in err
    done = len(_blocks(wd, "rk"))
    assert 1 <= done < 4
    r = moesq(*cmd[1:])
    assert f"({4 - done} computed now)" in r.stdout
    assert _blocks(wd, "rk") == _blocks(single, "rk")


@pytest.mark.slow
def test_a_rank_whose_peer_dies_or_hangs_stops_with_a_clear_error(single, tmp_path):
    """Without torchrun's agent (ranks started by hand): a dead peer or one that stops answering (SIGSTOP,
    past MOESQ_DIST_TIMEOUT) makes rank 0 stop at its next collective with one line saying so."""
    import shutil

    for sig, port in ((signal.SIGKILL, 29571), (signal.SIGSTOP, 29572)):
        wd = tmp_path / sig.name
        shutil.copytree(single, wd)
        env = {**ONE_THREAD, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2",
               "MOESQ_DIST_TIMEOUT": "20"}
        cmd = [MOESQ, "refine", "-w", str(wd), "--epochs", "12", "--steps-per-epoch", "4", "--device", "cpu",
               "--stage", "rg", "-q"]
        ps = [subprocess.Popen(cmd, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True) for r in range(2)]
        try:
            _wait_for_block(ps[0], wd, "rg")
            os.kill(ps[1].pid, sig)
            out, err = ps[0].communicate(timeout=300)
        finally:
            for p in ps:
                if p.poll() is None:
                    p.kill()
        assert ps[0].returncode == 1, err
        last = err.strip().splitlines()[-1]
        assert last.startswith("error: rg: ") and "another rank stopped or did not answer within 20 s" in last, err
        assert "re-run the same command to resume" in last


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_two_gpus_write_the_artifacts_of_one(micro_path, tmp_path):
    """NCCL, one GPU per rank (cuda:LOCAL_RANK): the artifacts of one process on one GPU."""
    one, two = tmp_path / "one", tmp_path / "two"
    moesq("refine", "--model", micro_path, "-w", one, *SMALL, *SHORT, "--device", "cuda", "-q")
    r = moesq("refine", "--model", micro_path, "-w", two, *SMALL, *SHORT, "--device", "cuda", "--nproc", "2")
    assert r.stdout.count("stage refine: 4 blocks (4 computed now)") == 1
    for stage in ("init-sgptq", "refine"):
        assert _blocks(two, stage) == _blocks(one, stage), stage
