"""Shared test fixtures. The shared real models live at ../shared relative to the repo root (as in CI)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
# The micro model is also embedded in the package (the default of `moesq run`); use that copy when ../shared
# is not there (e.g. on the GPU machine).
MICRO = SHARED / "models" / "micro-qwen3-moe"
if not MICRO.is_dir():
    MICRO = REPO / "moesq_core" / "assets" / "micro-qwen3-moe"
TINY = SHARED / "models" / "tiny-qwen3-moe"
EVAL_TEXT = SHARED / "data" / "eval-docs.txt.xz"
CALIB_TEXT = SHARED / "data" / "calib-docs.txt.xz"
# In a user's clone (no ../shared) the texts embedded in the package stand in.
CALIB = CALIB_TEXT if CALIB_TEXT.is_file() else REPO / "moesq_core" / "assets" / "calib-sample.txt.xz"
EVAL = EVAL_TEXT if EVAL_TEXT.is_file() else REPO / "moesq_core" / "assets" / "eval-sample.txt.xz"


def moe_block_inputs(model, tok, layer: int, n_seq: int, seq: int, chars: int) -> torch.Tensor:
    """The hidden states entering layer `layer`'s MoE block for the first n_seq × seq tokens of CALIB."""
    import lzma

    with lzma.open(CALIB, "rt") as f:
        text = f.read(chars)
    ids = tok(text, return_tensors="pt").input_ids[0][: n_seq * seq].view(n_seq, seq)
    caps = []
    h = model.model.layers[layer].mlp.register_forward_hook(
        lambda mod, inp, out: caps.append(inp[0].detach().reshape(-1, inp[0].shape[-1])))
    try:
        with torch.no_grad():
            model(ids)
    finally:
        h.remove()
    return torch.cat(caps)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def packed_expert_linears(model, f, suffixes: tuple[str, ...]):
    """(name, load_packed's dequantized weight, the linear's tensors in the open shard `f`) for every expert
    linear of a model `load_packed` returned: what the stock decompressors are compared against."""
    for li, layer in enumerate(model.model.layers):
        ours = layer.mlp.experts
        inter = ours.gate_up_proj.shape[1] // 2
        for e in range(ours.num_experts):
            for proj, mine in (("gate_proj", ours.gate_up_proj[e, :inter]), ("up_proj", ours.gate_up_proj[e, inter:]),
                               ("down_proj", ours.down_proj[e])):
                base = f"model.layers.{li}.mlp.experts.{e}.{proj}"
                yield base, mine, {k: f.get_tensor(f"{base}.{k}") for k in suffixes}


def pytest_configure(config):
    # pytest-xdist workers share the cores: each takes its share of torch's intra-op threads instead of all of them,
    # and so do the `moesq` processes its tests start (idle OpenMP threads spin: oversubscribed cores run slower)
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        share = max(1, torch.get_num_threads() // workers)
        torch.set_num_threads(share)
        os.environ.setdefault("OMP_NUM_THREADS", str(share))


def pytest_addoption(parser):
    parser.addoption("--full-matrix", action="store_true",
                     help="also run the tests marked full_matrix (the whole generated kernel test matrix)")


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--full-matrix"):  # deselected, whatever -m says: the full matrix is opt-in
        full = [item for item in items if "full_matrix" in item.keywords]
        if full:
            config.hook.pytest_deselected(items=full)
            items[:] = [item for item in items if "full_matrix" not in item.keywords]
    # files flagged START_FIRST (minutes of work in one file) run first: pytest-xdist hands out whole files in this
    # order (addopts: --no-loadscope-reorder), and one started last would leave the other workers idle meanwhile
    items.sort(key=lambda item: not getattr(getattr(item, "module", None), "START_FIRST", False))  # stable
    has_gpu = torch.cuda.is_available()
    hopper = has_gpu and torch.cuda.get_device_capability() == (9, 0)
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "hopper" in item.keywords and not hopper:
            item.add_marker(pytest.mark.skip(reason="needs a Hopper (sm_90) GPU"))


@pytest.fixture(scope="session")
def micro_path() -> Path:
    if not MICRO.is_dir():
        pytest.skip(f"shared model not found at {MICRO}")
    return MICRO


@pytest.fixture(scope="session")
def tiny_path() -> Path:
    if not TINY.is_dir():
        pytest.skip(f"shared model not found at {TINY}")
    return TINY


@pytest.fixture(scope="module")
def one_thread():
    """Small tensors: intra-op threads only add contention on the shared 2-core CI machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def micro_calibrated(micro_path):
    """(model, adapter, path, calibration splits): the micro model, loaded per module (stages replace its
    experts), and a small calibration set (32-token sequences: 4 train, 2 val, 4 init)."""
    from moesq_core.compression.calibration import CalibConfig, build_calibration, read_documents
    from moesq_core.models import load_model

    model, tok, adapter, path = load_model(micro_path)
    calib = build_calibration(tok, read_documents(CALIB, max_chars=200_000),
                              CalibConfig(seq_len=32, n_train=4, n_val=2, n_init=4))
    return model, adapter, path, calib


# -- one finished stage and one packed dir per format, shared by the checkpoint tests ----------------------------
PACK_FORMATS = ("p48-nvfp4", "dense-nvfp4", "s24-fp8")


def finished_stage(micro_path: Path, root: Path, fmt: str):
    """A WorkDir at `root` with a finished init-rtn stage of the embedded model in format `fmt` (seconds)."""
    from moesq_core.compression.calibration import CalibConfig, build_calibration, read_documents
    from moesq_core.compression.engine import StageSpec, run_stage
    from moesq_core.compression.methods.rtn import RTN
    from moesq_core.compression.pipeline import DEFAULT_CALIB
    from moesq_core.compression.workdir import WorkDir, model_fingerprint
    from moesq_core.formats import get_format
    from moesq_core.models import load_model

    model, tok, adapter, path = load_model(micro_path)  # fresh: run_stage replaces the model's experts
    calib = build_calibration(tok, read_documents(DEFAULT_CALIB, max_chars=200_000),
                              CalibConfig(seq_len=64, n_train=4, n_val=2, n_init=8))
    wd = WorkDir(root)
    wd.init({"source": str(path), "path": str(path), "fingerprint": model_fingerprint(path)},
            {"format": fmt, "act_quant": True})
    run_stage(model, adapter, calib, StageSpec("init-rtn", get_format(fmt), lambda li: RTN(), {"method": "rtn"},
                                               batch_size=4), wd.ledger("init-rtn"))
    return wd


@pytest.fixture(scope="session")
def stages(micro_path, tmp_path_factory):
    """{format: WorkDir with a finished init-rtn stage} (seconds each on the embedded model)."""
    root = tmp_path_factory.mktemp("stages")
    return {fmt: finished_stage(micro_path, root / fmt, fmt) for fmt in PACK_FORMATS}


@pytest.fixture(scope="session")
def packs(stages, tmp_path_factory):
    """{format: (work dir, packed dir, pack summary)}."""
    from moesq_core.compression.export import export_packed

    root = tmp_path_factory.mktemp("packs")
    return {fmt: (wd, root / fmt, export_packed(wd, "init-rtn", root / fmt)) for fmt, wd in stages.items()}


# -- helpers shared by the kernel and runtime tests ---------------------------------------------------------------


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative Frobenius error of a against b."""
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def routing(T: int, E: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random top-k routes (k distinct experts per token) and softmax weights."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    w = torch.softmax(torch.randn(T, k, generator=g), -1)
    return idx, w


def assert_graph_replays(fast, ref, xs, routes, tol: float, eager_tol: float = 0.0) -> torch.Tensor:
    """Capture one forward of the experts module `fast` in a CUDA graph (warmed up on a side stream first, so
    kernels compile outside the capture), then for each x and (top_k_index, top_k_weights) write them into
    the captured buffers and replay: every replay must match an eager call on the same buffers (bit for bit,
    or within eager_tol relative error) and the CPU module `ref` on the bf16-rounded inputs within tol.
    Returns the last replay's output (float32, CPU)."""
    x_buf = xs[0].to(torch.bfloat16).cuda()
    idx_buf, w_buf = routes[0][0].cuda(), routes[0][1].cuda()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fast(x_buf, idx_buf, w_buf)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_buf = fast(x_buf, idx_buf, w_buf)
    got = None
    for x, (idx, w) in zip(xs, routes):
        x_buf.copy_(x.to(torch.bfloat16))
        idx_buf.copy_(idx)
        w_buf.copy_(w)
        graph.replay()
        torch.cuda.synchronize()
        want = ref(x.to(torch.bfloat16).float(), idx, w)
        eager = fast(x_buf, idx_buf, w_buf).float().cpu()
        got = out_buf.float().cpu()
        assert torch.equal(got, eager) or rel(got, eager) <= eager_tol, rel(got, eager)
        assert rel(got, want) < tol, rel(got, want)
    return got


class P48GroupedCase:
    """One capacity-batched p48-nvfp4 grouped GEMM on the GPU against p48_reference: E experts' release
    tensors, tokens per expert `counts` (capacity C = the largest, at least 1), bf16 activations x [E*C, K]
    (expert e's rows start at e*C), per-expert activation global scales, and the reference output
    want [E, C, M] (float32, CPU). `spread` > 0 multiplies every 32-column block of x by exp(N(0, spread)),
    so the NVFP4 block scales of W4A4 cover the UE4M3 range, subnormal scales and the 448 clamp included."""

    def __init__(self, tensors: list[dict[str, torch.Tensor]], counts: list[int], act_quant: bool,
                 gen: torch.Generator, spread: float = 0.0):
        from moesq_core.serving.kernels import p48_reference as ref

        E = len(tensors)
        M, K = tensors[0]["weight_sparse_packed"].shape[0], tensors[0]["weight_sparse_packed"].shape[1] * 4
        dec = ref.decode_p48({s: torch.stack([t[s] for t in tensors]) for s in ref.WEIGHT_SUFFIXES})
        g_a = torch.rand(E, generator=gen) * 1000 + 100
        dec.input_global_scale = g_a
        C = max(max(counts), 1)
        x = torch.randn(E, C, K, generator=gen) * 3
        if spread:
            scale = torch.exp(torch.randn(E, C, K // 32, 1, generator=gen) * spread)
            x = x * scale.expand(-1, -1, -1, 32).reshape(E, C, K)
        x = x.to(torch.bfloat16)
        cnt = torch.tensor(counts, dtype=torch.int32)
        self.E, self.M, self.K, self.C, self.counts_list, self.act_quant = E, M, K, C, list(counts), act_quant
        self.want = ref.p48_grouped_ref(x, cnt, dec, act_quant)
        dev = torch.device("cuda")
        self.x = x.reshape(E * C, K).to(dev)
        self.row_start = (torch.arange(E, dtype=torch.int32) * C).to(dev)
        self.counts = cnt.to(dev)
        self.act_global = g_a.to(dev)

    def gemm_input(self) -> torch.Tensor:
        """What a GEMM without in-kernel quantization reads: x, or in W4A4 the NVFP4 pre-pass of x."""
        from moesq_core.serving.kernels import p48_triton as pt

        if not self.act_quant:
            return self.x
        groups = torch.arange(self.E, dtype=torch.int32, device=self.x.device).repeat_interleave(self.C)
        return pt.nvfp4_quantize_rows(self.x, groups, self.act_global)

    def alpha(self, weight_global: torch.Tensor) -> torch.Tensor:
        return 1.0 / (weight_global * self.act_global) if self.act_quant else 1.0 / weight_global

    def output(self, poisoned: bool, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """NaN-filled (every valid row must be written, no other) or zeros (split-K atomics)."""
        fill = float("nan") if poisoned else 0.0
        return torch.full((self.E * self.C, self.M), fill, dtype=dtype, device=self.x.device)

    def check(self, out: torch.Tensor, tol: float, poisoned: bool) -> None:
        """Each expert's valid rows within relative error tol of the reference; with a poisoned output the rows
        past each count untouched."""
        torch.cuda.synchronize()
        got = out.float().reshape(self.E, self.C, self.M).cpu()
        for e, n in enumerate(self.counts_list):
            if n:
                assert not torch.isnan(got[e, :n]).any(), f"expert {e}: rows left unwritten"
                err = rel(got[e, :n], self.want[e, :n])
                assert err < tol, f"expert {e}: relative error {err}"
            if poisoned:
                assert torch.isnan(got[e, n:]).all(), f"expert {e}: rows past the count were written"


def run_triton_interpreted(script: str) -> str:
    """Run a Python script with TRITON_INTERPRET=1 (Triton kernels on the CPU) in a fresh process at the repo
    root, with tests/ and its folders importable; returns its stdout (the test fails with the tail of stderr)."""
    pytest.importorskip("triton")
    # the repo first, then whatever path this process was given (where Triton may be installed)
    folders = sorted(str(p) for p in (REPO / "tests").iterdir() if p.is_dir() and p.name[0] not in "._")
    path = [str(REPO), str(REPO / "tests"), *folders, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(path))
    res = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout


def run_benchmark_script(name: str, *args, check: bool = True, timeout: float = 1200, env: dict | None = None):
    """benchmarks/<name>.py with `args` in a fresh process on one torch thread; the test fails with the tails of
    its output unless it exits 0 (or check=False: the CompletedProcess, whatever its exit status)."""
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / f"{name}.py"), *map(str, args)], capture_output=True,
                       text=True, timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    if check and r.returncode != 0:
        raise AssertionError(f"exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r


def benchmark_module(name: str):
    """benchmarks/<name>.py imported as a module (the benchmarks are scripts, not a package)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        return __import__(name)
    finally:
        sys.path.pop(0)


def assert_experts_module_rejects_bad_inputs(from_packed, packed, *args) -> None:
    """An experts module built by from_packed(packed, *args) (hidden size 64) refuses hidden states of the wrong
    width and routes of mismatched shapes; from_packed refuses an expert without its down projection."""
    mod = from_packed(packed, *args)
    with pytest.raises(ValueError, match="hidden_states"):
        mod(torch.randn(4, 32), torch.zeros(4, 2, dtype=torch.long), torch.ones(4, 2))
    with pytest.raises(ValueError, match="top_k_index"):
        mod(torch.randn(4, 64), torch.zeros(4, 2, dtype=torch.long), torch.ones(4, 3))
    bad = [dict(t) for t in packed]
    bad[1] = {"gate": bad[1]["gate"], "up": bad[1]["up"]}
    with pytest.raises(ValueError, match="missing projection"):
        from_packed(bad, *args)
