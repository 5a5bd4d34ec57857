"""Host memory per process: the block loop holds a bounded number of blocks' worth of expert tensors (its own
copies are freed as soon as they are written or installed), and the commands' peak RSS stays under
non-expert weights + 3 blocks' experts + 1 GiB (slow tests, measured in subprocesses)."""
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch

from moesq_core.compression import engine
from moesq_core.compression.methods.base import CompressedExpert
from moesq_core.compression.pipeline import MethodConfig, run_init
from moesq_core.formats.registry import formats
from moesq_core.models.lazy import ReleasedExperts
from moesq_core.serving.experts import MoesqExperts

from conftest import CALIB, benchmark_module

synthetic = benchmark_module("synthetic_model")  # benchmarks/synthetic_model.py
qwen3_moe_config = synthetic.qwen3_moe_config
write_random_qwen3_moe = synthetic.write_random_qwen3_moe

REPO = Path(__file__).resolve().parents[2]


def _tiny_model(path: Path, layers: int, hidden: int, experts: int, inter: int) -> int:
    cfg = qwen3_moe_config(hidden_size=hidden, num_hidden_layers=layers, num_experts=experts,
                           moe_intermediate_size=inter, intermediate_size=inter, num_attention_heads=1,
                           num_key_value_heads=1, head_dim=32)
    return write_random_qwen3_moe(path, cfg, seed=0)


@pytest.mark.parametrize("fmt_name", sorted(formats()))
def test_a_block_packed_in_chunks_is_the_bytes_of_one_stack(fmt_name, monkeypatch):
    """pack_block packs a chunk of experts at a time (PACK_CHUNK_BYTES) into preallocated tensors: the artifact's
    tensors are those of packing the whole stack, whatever the chunk."""
    fmt = formats()[fmt_name]
    gen = torch.Generator().manual_seed(0)
    results = [CompressedExpert(*(fmt.quantize(torch.randn(*shape, generator=gen))
                                  for shape in ((32, 64), (32, 64), (64, 32))), None, {"e": e}) for e in range(7)]
    amax_in, amax_mid = torch.rand(7, generator=gen), torch.rand(7, generator=gen)
    packed = []
    for chunk_bytes in (1 << 40, 1, 3 * 32 * 64 * engine.RESULT_BYTES_PER_WEIGHT):  # 7 / 1 / 3 experts a chunk
        monkeypatch.setattr(engine, "PACK_CHUNK_BYTES", chunk_bytes)
        packed.append(engine.pack_block(results, amax_in, amax_mid))
    (whole, meta), *others = packed
    for tensors, m in others:
        assert m == meta and list(tensors) == list(whole)
        for k, t in tensors.items():
            assert t.dtype == whole[k].dtype and torch.equal(t, whole[k]), k


def test_pack_shards_are_written_from_a_spill_as_save_file_writes_them(tmp_path):
    """pack's shard writer holds one tensor at a time (the shard's tensors wait in a spill file): each shard is
    byte for byte what safetensors' save_file writes of its tensors (every dtype pack writes, empty and 0-d
    tensors, names of any order), and no spill file is left."""
    from safetensors.torch import save_file

    from moesq_core.compression.export import _ShardWriter

    gen = torch.Generator().manual_seed(0)
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.uint8, torch.int8, torch.bool, torch.int32,
              torch.int64, torch.float8_e4m3fn]
    shapes = [(3, 5), (0, 4), (), (7,), (2, 3, 4)]
    tensors = {(f"model.layers.{i % 7}.w{i}" if i % 3 else f"z{i}"): (torch.randn(shapes[i % 5], generator=gen) * 10)
               .to(dtypes[i % len(dtypes)]) for i in range(45)}
    writer = _ShardWriter(tmp_path, 160)  # several shards
    for k, t in tensors.items():
        writer.add(k, t)
    shards = writer.shards + [{k: None for k in writer.cur}]  # the last, written by flush
    writer.flush()
    assert len(shards) > 3 and sum(map(len, shards)) == len(tensors)
    for i, names in enumerate(shards, 1):
        save_file({k: tensors[k] for k in names}, str(tmp_path / "want"), metadata={"format": "pt"})
        assert (tmp_path / f".shard{i}.tmp").read_bytes() == (tmp_path / "want").read_bytes(), i
    assert not list(tmp_path.glob("*.spill"))
    held = torch.randn(1000, generator=gen)
    ref = weakref.ref(held)
    writer.add("held", held)
    del held
    gc.collect()
    assert ref() is None  # written to the spill, not kept


def test_the_block_loop_frees_each_block_before_the_next(tmp_path, monkeypatch, one_thread):
    """On a lazily opened model, when a block is compressed nothing of the previous block's results is alive and
    no earlier block's installed experts are: the earlier ones were released once they had propagated the
    states (the last stays installed), and the previous results once packed and installed."""
    model = tmp_path / "model"
    _tiny_model(model, layers=3, hidden=64, experts=8, inter=32)
    codes: list[weakref.ref] = []  # every result's codes, as the engine's block loop installs them
    installed: list[weakref.ref] = []
    alive_at_compress = []
    compress, install = engine._compress_block, engine.install_block

    def counting_compress(*args, **kwargs):
        gc.collect()
        alive_at_compress.append((sum(r() is not None for r in codes), sum(r() is not None for r in installed)))
        return compress(*args, **kwargs)

    def recording_install(block, fmt, results, *args, **kwargs):
        codes.extend(weakref.ref(qw.codes) for r in results for qw in r.weights().values())
        install(block, fmt, results, *args, **kwargs)
        installed.append(weakref.ref(block.mlp.experts))

    monkeypatch.setattr(engine, "_compress_block", counting_compress)
    monkeypatch.setattr(engine, "install_block", recording_install)
    run = {"calib_source": str(CALIB), "seq_len": 16, "n_train": 2, "n_val": 1, "n_init": 2}
    run_init(tmp_path / "wd", MethodConfig("rtn"), model, run, device="cpu", batch_size=2)
    assert alive_at_compress == [(0, 0), (0, 0), (0, 0)]
    assert [r() is not None for r in installed] == [False, False, True]


def test_released_experts_refuse_to_run_and_an_eager_model_keeps_its_own(micro_path):
    """MoEBlock.release_installed frees a lazily opened block's installed experts (which then refuse to run)
    and leaves an eagerly loaded model's alone."""
    from moesq_core.models import load_model

    for lazy in (True, False):
        model, _, adapter, _ = load_model(micro_path, lazy=lazy)
        block = adapter.blocks(model)[0]
        E = block.num_experts
        inter, H = block.dense_experts.down_proj.shape[2], block.dense_experts.down_proj.shape[1]
        mine = MoesqExperts("p48-nvfp4", torch.zeros(E, 2 * inter, H), torch.zeros(E, H, inter), act_quant=False)
        block.set_experts(mine)
        block.release_installed()
        if lazy:
            assert isinstance(block.mlp.experts, ReleasedExperts)
            with pytest.raises(RuntimeError, match="released"):
                block.mlp.experts(torch.zeros(1, H), torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1))
        else:
            assert block.mlp.experts is mine


def test_refinement_on_the_cpu_goes_in_chunks_of_the_host_budget(monkeypatch):
    """On the CPU (no chunk_gb) refinement holds the state of as many experts as fit memory.HOST_CHUNK_BYTES at
    a time, and its pre-flight line says so; a block within the budget stays one chunk."""
    from moesq_core.compression.methods.refine import RefineConfig, trainer
    from moesq_core.compression.methods.refine.trainer import refine_bytes_per_expert, refine_chunks, refine_memory_plan
    from moesq_core.formats import get_format

    from test_refine import make_block

    fmt = get_format("p48-nvfp4")
    experts = make_block(E=5, n=8, n_val=4)
    assert [len(c) for c in refine_chunks(experts, fmt, RefineConfig())] == [5]
    monkeypatch.setattr(trainer, "HOST_CHUNK_BYTES", int(2.5 * refine_bytes_per_expert(fmt, 64, 64)))
    assert [len(c) for c in refine_chunks(experts, fmt, RefineConfig())] == [2, 2, 1]
    plan = refine_memory_plan(fmt, RefineConfig(), experts=5, H=64, inter=64, tokens=12, token_bytes=4, routed_rows=24,
                              available=None, device="cpu", sequences=3)
    assert plan.endswith("refined in 3 chunks of experts to bound host memory"), plan


# -- peak RSS of the commands ---------------------------------------------------------------------------------
def _peak_rss_per_process(cmd: list[str], env: dict) -> list[int]:
    """Run cmd; the peak RSS of each process of its tree (bytes), largest first, polled every 50 ms."""
    import time

    import psutil

    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    root, peaks = psutil.Process(p.pid), {}
    while p.poll() is None:
        try:
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            procs = []
        for q in procs:
            try:
                peaks[q.pid] = max(peaks.get(q.pid, 0), q.memory_info().rss)
            except psutil.Error:
                pass
        time.sleep(0.05)
    out = p.stdout.read()
    assert p.returncode == 0, out[-3000:]
    return sorted(peaks.values(), reverse=True)


@pytest.mark.slow
def test_peak_rss_per_process_is_bounded_by_three_blocks(tmp_path):
    """init-sgptq --method rtn (one process and --nproc 2) and pack on a 4-block model whose blocks are each
    ~100 MiB of bf16 experts: every process's peak RSS <= non-expert weights + 3 blocks' experts + 1 GiB."""
    layers, hidden, experts, inter = 4, 1024, 32, 512
    model = tmp_path / "model"
    size = _tiny_model(model, layers=layers, hidden=hidden, experts=experts, inter=inter)
    block = experts * 3 * inter * hidden * 2
    bound = size - layers * block + 3 * block + (1 << 30)
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": "1"}
    cli = [sys.executable, "-m", "moesq_cli"]
    calib = ["--seq-len", "32", "--n-train", "2", "--n-val", "1", "--n-init", "4", "--calib", str(CALIB)]
    got = {}
    for nproc in (1, 2):
        wd = tmp_path / f"wd{nproc}"
        got[f"init rtn --nproc {nproc}"] = _peak_rss_per_process(
            [*cli, "init-sgptq", "-m", str(model), "-w", str(wd), "--method", "rtn", "--device", "cpu", "-q",
             "--nproc", str(nproc), *calib], env)
    got["pack"] = _peak_rss_per_process(
        [*cli, "pack", str(tmp_path / "wd1"), "-o", str(tmp_path / "packed"), "-q"], env)
    print(json.dumps({k: [round(v / 2**20) for v in peaks[:3]] for k, peaks in got.items()}),
          f"bound {bound / 2**20:.0f} MiB")
    assert len(got["init rtn --nproc 2"]) >= 3  # the launcher and its two workers
    for what, peaks in got.items():
        assert peaks[0] <= bound, f"{what}: peak RSS {peaks[0] / 2**20:.0f} MiB > {bound / 2**20:.0f} MiB"
