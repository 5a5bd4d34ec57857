"""A block's device memory: passes over an expert's rows go in pieces, a pass or chunk that runs out of device
memory is retried smaller with the same results, and the calibration states' cache is sized from host memory."""
from __future__ import annotations

import logging

import pytest
import torch

from moesq_core.compression import engine
from moesq_core.compression.engine import StateStore, expert_activation_amax
from moesq_core.compression.methods import batching
from moesq_core.compression.methods.base import TokenRows
from moesq_core.compression.methods.refine import BlockRefiner, RefineConfig, RefineMethod
from moesq_core.compression.methods.rtn import RTN
from moesq_core.compression.preflight import (
    DEFAULT_CACHE_BYTES,
    CalibrationStates,
    GiB,
    auto_cache_limit_bytes,
    states_footprint,
)
from moesq_core.formats import get_format

from test_refine import FAST, assert_same_experts, make_block

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: small tensors, one intra-op thread


def _oom(what: str = "injected") -> torch.OutOfMemoryError:
    return torch.OutOfMemoryError(f"CUDA out of memory ({what})")


def test_pieces_cover_every_row_once_and_a_failing_piece_is_halved(caplog):
    seen = []

    def fn(a, b):
        if b - a > 3:  # "too big for the device"
            raise _oom()
        seen.append((a, b))
        return torch.tensor(float(b - a))

    with caplog.at_level(logging.WARNING, logger="moesq.engine"):
        out = list(engine._pieces(23, fn, rows=10))
    assert sum(float(v) for _, _, v in out) == 23
    covered = sorted(seen)
    assert covered[0][0] == 0 and covered[-1][1] == 23
    assert all(b0 == a1 for (_, b0), (a1, _) in zip(covered, covered[1:]))  # contiguous, no overlap
    assert "retrying them in two halves" in caplog.text


def test_a_single_row_that_does_not_fit_is_an_error():
    with pytest.raises(torch.OutOfMemoryError):
        list(engine._pieces(2, lambda a, b: (_ for _ in ()).throw(_oom()), rows=2))


@pytest.mark.parametrize("act_quant", [True, False])
def test_activation_ranges_in_pieces_equal_one_pass(monkeypatch, act_quant):
    fmt = get_format("p48-nvfp4")
    ex = make_block(E=1, H=64, inter=64, n=300, with_val=False)[0]
    result = RTN(report_errors=False).compress_block([ex], fmt)[0]
    tokens = torch.cat([torch.randn(50, 64), ex.x])  # the expert's rows inside a larger token matrix
    rows = TokenRows(tokens, torch.arange(50, 350))
    whole = expert_activation_amax(fmt, result, ex.x, act_quant)
    from moesq_core.compression.methods import base

    monkeypatch.setattr(base, "ROW_PIECE", 7)  # 43 pieces, the last one short
    pieces = expert_activation_amax(fmt, result, rows, act_quant)
    assert torch.equal(pieces[0], whole[0])
    torch.testing.assert_close(pieces[1], whole[1], rtol=1e-6, atol=0)
    # the input range from the token matrix's per-token ranges (the engine's, once per block): the same numbers
    with_ranges = expert_activation_amax(fmt, result, rows, act_quant, token_amax=base.row_amax(tokens))
    assert torch.equal(with_ranges[0], pieces[0]) and torch.equal(with_ranges[1], pieces[1])
    assert float(whole[1]) > 0
    assert [float(v) for v in expert_activation_amax(fmt, result, TokenRows(tokens, torch.zeros(0, dtype=torch.int64)),
                                                     act_quant)] == [0.0, 0.0]


def test_activation_range_pass_is_counted_below_the_micro_batch():
    from moesq_core.compression.methods.refine.trainer import micro_batch_bytes

    # a Qwen3-30B-A3B block: the pass's piece stays far below refinement's own micro-batch working set
    assert engine.amax_pass_bytes(2048, 768) < micro_batch_bytes(2048, 768, RefineConfig().micro_batch_rows) / 4


def test_refine_chunk_out_of_memory_is_retried_smaller_with_the_same_bytes(monkeypatch, caplog):
    """A refinement chunk that runs out of device memory is retried as two halves (down to one expert, then with
    half the micro-batch rows) instead of losing the block; the halves give the bytes of the whole."""
    fmt = get_format("p48-nvfp4")
    ex = make_block(E=5, H=64, inter=64, n=200, n_val=60)
    cfg = RefineConfig(**{**FAST, "epochs": 2, "steps_per_epoch": 5, "micro_batch_rows": 4096})
    whole = RefineMethod(RTN(report_errors=False), cfg).compress_block(ex, fmt)

    run = BlockRefiner.run
    calls = []

    def run_failing_on_more_than_two(self, on_step=None):
        calls.append((self.E, self.cfg.micro_batch_rows))
        if self.E > 2 or (self.E == 1 and self.cfg.micro_batch_rows == cfg.micro_batch_rows):
            self.train_epoch(max_steps=1)  # fail after some work, as a real step would
            raise _oom()
        return run(self, on_step)

    monkeypatch.setattr(BlockRefiner, "run", run_failing_on_more_than_two)
    with caplog.at_level(logging.WARNING):
        retried = RefineMethod(RTN(report_errors=False), cfg).compress_block(ex, fmt)
    assert calls[0] == (5, cfg.micro_batch_rows)
    assert (2, cfg.micro_batch_rows) in calls and (1, cfg.micro_batch_rows // 2) in calls
    assert "retrying them as 2 + 3" in caplog.text and "retrying it at --micro-batch-rows 2048" in caplog.text
    # the chunks' bytes equal the whole's; a smaller micro-batch sums the same rows in another order
    assert_same_experts([r for r, e in zip(retried, ex) if e.index < 2], [r for r, e in zip(whole, ex) if e.index < 2])
    for a, b in zip(retried, whole):
        for p, qa in a.weights().items():
            qb = b.weights()[p]
            assert (qa.mask == qb.mask).float().mean() > 0.99
            tol = 0.05 * float(qb.dequantize().abs().max())
            torch.testing.assert_close(qa.dequantize(), qb.dequantize(), rtol=0, atol=tol)


def test_refine_gives_up_with_one_expert_at_the_smallest_micro_batch(monkeypatch):
    fmt = get_format("p48-nvfp4")
    ex = make_block(E=2, H=64, inter=64, n=100, n_val=30)
    cfg = RefineConfig(**{**FAST, "epochs": 1, "steps_per_epoch": 2, "micro_batch_rows": 1500})
    monkeypatch.setattr(BlockRefiner, "run", lambda self, on_step=None: (_ for _ in ()).throw(_oom()))
    with pytest.raises(torch.OutOfMemoryError, match="out of memory refining one expert at --micro-batch-rows 750"):
        RefineMethod(RTN(report_errors=False), cfg).compress_block(ex, fmt)


def test_one_shot_chunk_out_of_memory_is_retried_smaller(caplog):
    fmt = get_format("p48-nvfp4")
    ex = make_block(E=5, H=64, inter=64, n=120, with_val=False)
    sizes = []

    def solve(chunk, budget):
        sizes.append(len(chunk))
        if len(chunk) > 2:
            raise _oom()
        return RTN(report_errors=False).compress_block(chunk, fmt)

    with caplog.at_level(logging.WARNING):
        out = batching.compress_batched(ex, fmt, "rtn", solve, experts_per_chunk=5)
    assert sizes == [5, 2, 2, 1]
    assert_same_experts(out, RTN(report_errors=False).compress_block(ex, fmt))
    assert "retrying 2 at a time" in caplog.text
    with pytest.raises(torch.OutOfMemoryError, match="solving one expert"):
        batching.compress_batched(ex[:1], fmt, "rtn", lambda c, b: (_ for _ in ()).throw(_oom()))


# -- calibration states in host memory --------------------------------------------------------------------------
PAPER = CalibrationStates({"train": 960, "init": 64, "val": 128}, ("train+init", "val"), seq_len=4096,
                          hidden_size=2048, dtype_bytes=2, batch_size=8)


def test_default_cache_holds_every_state_where_the_host_has_room():
    everything = 2 * sum(PAPER.chunk_bytes("train+init"))  # two stores of the largest split's size
    assert auto_cache_limit_bytes(PAPER, 128 * GiB) == -(-everything // GiB) * GiB
    assert states_footprint(PAPER, auto_cache_limit_bytes(PAPER, 128 * GiB)).spilled == 0
    # 48 GiB available: half of it for the states, whole GiB
    limit = auto_cache_limit_bytes(PAPER, 48 * GiB)
    assert limit % GiB == 0 and 0 < limit < everything
    assert states_footprint(PAPER, limit).memory <= 24 * GiB < states_footprint(PAPER, limit + GiB).memory
    assert auto_cache_limit_bytes(PAPER, 0) == 0
    assert auto_cache_limit_bytes(PAPER, None) == DEFAULT_CACHE_BYTES


def test_states_kept_away_from_their_device_come_back_on_it(tmp_path):
    store = StateStore(1 << 20, tmp_path, home="cpu")
    chunks = [torch.randn(2, 3, 4) for _ in range(3)]
    for c in chunks:
        store.append(c)
    assert all(torch.equal(a, b) and a.device == b.device for a, b in zip(store, chunks))
    assert store.like(1).shape == (2, 3, 4)


@pytest.mark.gpu
def test_gpu_states_live_in_host_memory_and_come_back_on_the_gpu(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    store = StateStore(3 * 96, tmp_path, home="cpu")  # two chunks in host memory, the third spills
    chunks = [torch.randn(2, 3, 4, device="cuda") for _ in range(3)]
    before = torch.cuda.memory_allocated()
    for c in chunks:
        store.append(c)
    assert torch.cuda.memory_allocated() == before  # nothing more on the device
    assert store.spilled == 96 and store.in_memory == 192
    for a, b in zip(store, chunks):
        assert a.device == b.device and torch.equal(a, b)
    assert store.like(2).device == chunks[2].device
    # held in pinned host memory, copied asynchronously: host reads wait for the copy, device reads are ordered
    assert all(c.tensor.is_pinned() and c.copied is not None for c in store.chunks[:2])
    big = torch.randn(64, 1024, 1024, device="cuda")  # 256 MiB: a copy still running when it is read
    pinned = StateStore(1 << 40, None, home="cpu")
    pinned.append(big)
    assert torch.equal(pinned.stored(0), big.cpu())
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # read from another stream: still after the copy in
        back = pinned[0]
    side.synchronize()
    assert torch.equal(back, big)
    from moesq_core.compression import engine

    engine.PIN_HELD_STATES = False
    try:
        pageable = StateStore(1 << 40, None, home="cpu")
        pageable.append(big)
        assert not pageable.chunks[0].tensor.is_pinned() and torch.equal(pageable[0], big)
    finally:
        engine.PIN_HELD_STATES = True


@pytest.mark.gpu
def test_device_memory_reads_honour_the_process_cap():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from moesq_core.memory import device_available_bytes

    dev = torch.device("cuda")
    total = torch.cuda.get_device_properties(dev).total_memory
    torch.cuda.set_per_process_memory_fraction(0.25, dev)
    try:
        assert device_available_bytes(dev) <= 0.25 * total - torch.cuda.memory_allocated(dev) + 1
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, dev)
    assert device_available_bytes(dev) > 0.25 * total


@pytest.mark.gpu
def test_work_is_sized_from_memory_the_allocator_holds_cached_too():
    """After a block's work torch's allocator keeps its freed blocks (~50 GiB on an H100): the next block sizes its
    chunks from them too, not from the driver's free memory alone (which left block 1 a fraction of the card)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from moesq_core.compression.methods.batching import DEFAULT_GPU_FRACTION, memory_budget
    from moesq_core.memory import device_available_bytes

    dev = torch.device("cuda")
    big = torch.empty(int(torch.cuda.mem_get_info(dev)[0] * 0.6), dtype=torch.uint8, device=dev)
    del big  # cached, not returned to the driver
    free, _ = torch.cuda.mem_get_info(dev)
    cached = torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
    assert cached > free  # the situation: most of the card cached
    budget = memory_budget(dev, None)
    assert budget > free * DEFAULT_GPU_FRACTION * 1.5
    assert abs(budget - device_available_bytes(dev) * DEFAULT_GPU_FRACTION) < (64 << 20)
    torch.empty(budget * 2 - (256 << 20), dtype=torch.uint8, device=dev)  # and it can be had


def test_a_layer_pass_out_of_memory_is_retried_in_halves(micro_path, caplog):
    """Routing and propagation run a batch of sequences through a decoder layer; out of device memory the batch is
    split (its per-sequence keyword arguments with it) and the halves give the whole batch's states."""
    from moesq_core.compression.engine import StateStore, _layer_out, capture_layer_inputs, split_on_oom
    from moesq_core.models import load_model

    model, _, _, _ = load_model(micro_path, dtype=torch.float32, device="cpu")
    tokens = torch.randint(0, model.config.vocab_size, (4, 16), generator=torch.Generator().manual_seed(0))
    store = StateStore(1 << 30, None)
    kwargs = capture_layer_inputs(model, tokens, 4, store)[4]
    layer = model.model.layers[0]
    with torch.no_grad():
        whole = _layer_out(layer(store[0], **kwargs))
        sizes = []

        def fn(h, kw):
            sizes.append(h.shape[0])
            if h.shape[0] > 1:
                raise _oom()
            return _layer_out(layer(h, **kw))

        with caplog.at_level(logging.WARNING, logger="moesq.engine"):
            split = split_on_oom(fn, store[0], kwargs)
    assert sizes == [4, 2, 1, 1, 2, 1, 1]
    torch.testing.assert_close(split, whole, rtol=1e-5, atol=1e-6)
    assert "retrying them in two halves" in caplog.text


@pytest.mark.parametrize("weighting", ["none", "w2"])
def test_hessians_over_row_pieces_equal_one_pass(monkeypatch, weighting):
    """The one-shot methods' statistics go over an expert's rows piece by piece (a hot expert's SwiGLU intermediate
    at the paper's calibration would be ~10 GB at once): the same sums in the same order."""
    from moesq_core.compression.methods import base
    from moesq_core.compression.methods.hessian import hessian, input_sq_norms
    from moesq_core.compression.methods.rtn import check_expert

    ex = make_block(E=1, H=64, inter=32, n=250, with_val=False)[0]
    tokens = torch.cat([torch.randn(30, 64), ex.x])
    shared = base.ExpertData(0, ex.gate, ex.up, ex.down, TokenRows(tokens, torch.arange(30, 280)), ex.w)
    monkeypatch.setattr(base, "ROW_PIECE", 100)  # 3 pieces, the last one short
    assert [a for a, _ in shared.input_pieces()] == [0, 100, 200]
    for whole, pieces in ((ex.inputs(), shared.input_pieces()),
                          (ex.dense_intermediate(), shared.intermediate_pieces())):
        assert torch.equal(hessian(pieces, ex.w, weighting, chunk=50), hessian(whole, ex.w, weighting, chunk=50))
        torch.testing.assert_close(input_sq_norms(pieces, ex.w, weighting), input_sq_norms(whole, ex.w, weighting))
    empty = base.ExpertData(0, ex.gate, ex.up, ex.down, TokenRows(tokens, torch.zeros(0, dtype=torch.int64)),
                            torch.zeros(0))
    assert torch.equal(hessian(empty.input_pieces()), torch.zeros(64, 64))
    check_expert(shared, get_format("p48-nvfp4"))
    tokens[200, 3] = float("nan")
    with pytest.raises(ValueError, match="non-finite calibration inputs"):
        check_expert(shared, get_format("p48-nvfp4"))


def test_states_are_saved_for_resuming_at_most_a_twentieth_of_the_time(tmp_path, monkeypatch):
    from moesq_core.compression import state_checkpoint
    from moesq_core.compression.workdir import WorkDir

    clock = [1000.0]
    monkeypatch.setattr(state_checkpoint.time, "monotonic", lambda: clock[0])
    ledger = WorkDir(tmp_path / "wd").ledger("refine")
    saved = state_checkpoint.StateCheckpoint(ledger, {"init": torch.zeros(2, 3, dtype=torch.int64)}, ["init"], 8,
                                             every_s=60)
    clock[0] += 61
    assert saved.due()
    saved.last_save, saved.last_seconds = clock[0], 40.0  # a full-width model's states took 40 s to write
    clock[0] += 61
    assert not saved.due()  # a minute later: saving would be 40 s of every 100
    clock[0] += 740
    assert saved.due()  # 800 s after: 1/20 of the time
    every_block = state_checkpoint.StateCheckpoint(ledger, {"init": torch.zeros(2, 3, dtype=torch.int64)}, ["init"],
                                                   8, every_s=0)
    every_block.last_seconds = 40.0
    assert every_block.due()


def test_states_saved_in_the_background_are_the_same_files_and_a_cancelled_save_leaves_none(tmp_path):
    """The engine saves the calibration states on a thread of its own while the next block computes: the same
    record and bytes as a save in the stage's thread; an interrupt cancels it without a file or record left; an
    error on the thread is raised by wait()."""
    import threading

    from moesq_core.compression import state_checkpoint
    from moesq_core.compression.engine import StateStore
    from moesq_core.compression.workdir import DiskWriteError, WorkDir

    calib = {"init": torch.zeros(2, 3, dtype=torch.int64)}
    gen = torch.Generator().manual_seed(0)
    store = StateStore(1 << 30, None)
    for _ in range(3):
        store.append(torch.randn(4, 16, 8, generator=gen))

    def ledger_in(name):
        wd = WorkDir(tmp_path / name)
        wd.init({"model": "m"}, {})
        return wd.ledger("refine")

    def files(ledger):
        return sorted(p.name for p in ledger.cache_dir.iterdir()) if ledger.cache_dir.exists() else []

    ledger_a = ledger_in("a")
    state_checkpoint.StateCheckpoint(ledger_a, calib, ["init"], 8).save(0, [], {"init": store})
    ledger_b = ledger_in("b")
    with state_checkpoint.StateCheckpoint(ledger_b, calib, ["init"], 8) as saved:
        saved.save_in_background(0, [], {"init": store})
    assert files(ledger_b) == files(ledger_a) == ["refine-states-L000.bin", "refine-states.json"]
    for name in files(ledger_a):
        assert (ledger_a.cache_dir / name).read_bytes() == (ledger_b.cache_dir / name).read_bytes()

    class Gated(StateStore):
        """A store whose second chunk is read only once the test lets it (a save caught mid-write)."""
        reached, go = threading.Event(), threading.Event()

        def stored(self, i):
            if i == 1:
                self.reached.set()
                self.go.wait(10)
            return super().stored(i)

    gated = Gated(1 << 30, None)
    for i in range(3):
        gated.append(store.stored(i))
    ledger_c = ledger_in("c")
    with pytest.raises(KeyboardInterrupt):
        with state_checkpoint.StateCheckpoint(ledger_c, calib, ["init"], 8) as saved:
            saved.save_in_background(0, [], {"init": gated})
            assert Gated.reached.wait(10)
            threading.Timer(0.2, Gated.go.set).start()
            raise KeyboardInterrupt
    assert files(ledger_c) == []  # no half file, no record

    class Broken(StateStore):
        def stored(self, i):
            raise OSError(28, "No space left on device")

    broken = Broken(1 << 30, None)
    broken.append(torch.zeros(2))
    saved = state_checkpoint.StateCheckpoint(ledger_in("d"), calib, ["init"], 8)
    saved.save_in_background(0, [], {"init": broken})
    with pytest.raises(DiskWriteError, match="no space left"):
        saved.wait()
