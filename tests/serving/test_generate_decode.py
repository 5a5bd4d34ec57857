"""`moesq generate`'s static-cache decode step (moesq_core.serving.decode_step): batched, left-padded generation
gives exactly the tokens of transformers' own `generate` per prompt; sampling filters; the CLI's batch options
and refusals; on a GPU the CUDA-graph step gives the eager step's tokens."""
from __future__ import annotations

import json
import warnings

import pytest
import torch

# different lengths, so the batch is left-padded (the last is a single token)
PROMPTS = ["Memory barriers order", "The scheduler picks the next task to run on each CPU, and then",
           "In 1905 the", "A"]


def moesq(*args, check=True):
    """The CLI in this process (typer's runner): the import of torch and transformers is paid once."""
    from typer.testing import CliRunner

    from moesq_cli.app import app

    r = CliRunner().invoke(app, [str(a) for a in args])
    if check and r.exit_code != 0:
        raise AssertionError(f"moesq {' '.join(map(str, args))} exited {r.exit_code}\n{r.stdout}\n{r.stderr}")
    return r


@pytest.fixture(scope="module")
def p48_pack(packs):
    return packs["p48-nvfp4"][1]


@torch.no_grad()
def test_batched_static_cache_matches_transformers_generate(p48_pack):
    from moesq_core.serving.generate import generate_batch, load_pack

    pack = load_pack(p48_pack, device="cpu", dtype="auto")
    assert pack.dtype == "float32"
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # e.g. transformers' past_key_values deprecation
        run = generate_batch(pack, PROMPTS, max_new_tokens=12)
    assert run["batch_size"] == len(PROMPTS) and run["decode"]["cuda_graph"] is False
    tok, model = pack.tokenizer, pack.model
    lengths = {len(tok(p)["input_ids"]) for p in PROMPTS}
    assert len(lengths) == len(PROMPTS)  # every row padded differently
    for p, c in zip(PROMPTS, run["completions"]):
        ids = tok(p, return_tensors="pt")["input_ids"]
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                             pad_token_id=1, temperature=None, top_p=None, top_k=None)
        want = out[0, ids.shape[1]:]
        assert c["new_tokens"] == want.numel()
        assert c["completion"] == tok.decode(want, skip_special_tokens=True), p
    assert run["new_tokens"] == sum(c["new_tokens"] for c in run["completions"])
    assert run["prefill"]["tokens"] == sum(lengths) and run["decode"]["steps"] == 11
    assert run["decode"]["tokens"] == run["new_tokens"] - len(PROMPTS)


@torch.no_grad()
def test_tokens_equal_per_row_and_rows_stop_at_their_end_token(p48_pack):
    """The token ids themselves (not only their text) equal transformers' per prompt; a row that emits the end
    token is padded afterwards and its completion ends there, while the other rows go on."""
    from moesq_core.serving.decode_step import generate_tokens
    from moesq_core.serving.generate import left_padded, load_pack

    pack = load_pack(p48_pack, device="cpu")
    tok, model = pack.tokenizer, pack.model
    rows = [tok(p)["input_ids"] for p in PROMPTS[:3]]
    ids, mask = left_padded(rows, 1)
    free = generate_tokens(model, ids, mask, 10, pad_token_id=1)  # no end token: every row runs 10 tokens
    for r, got in zip(rows, free.tokens):
        t = torch.tensor([r])
        want = model.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=10, do_sample=False,
                              eos_token_id=None, pad_token_id=1, temperature=None, top_p=None, top_k=None)
        assert got == want[0, len(r):].tolist()
    # an end token that only one row emits: that row stops there (padded after), the others run on
    end = next(t for row in free.tokens for t in row if sum(t in r for r in free.tokens) == 1)
    stop = generate_tokens(model, ids, mask, 10, eos_token_ids=(end,), pad_token_id=1)
    stopped = 0
    for row, got in zip(free.tokens, stop.tokens):
        want = row[:row.index(end) + 1] if end in row else row
        stopped += len(want) < len(row)
        assert got == want
    assert stopped == 1


def test_prefill_refuses_right_padding(p48_pack):
    from moesq_core.serving.decode_step import DecodeStep
    from moesq_core.serving.generate import load_pack

    model = load_pack(p48_pack, device="cpu").model
    step = DecodeStep(model, 2, 8)
    with pytest.raises(ValueError, match="left-padded"):
        step.prefill(torch.ones(2, 3, dtype=torch.long), torch.tensor([[1, 1, 0], [1, 1, 1]]))


def test_select_tokens_filters():
    from moesq_core.serving.decode_step import Sampling, select_tokens

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 50, generator=g)
    best = logits.argmax(-1)
    torch.manual_seed(1)
    assert torch.equal(select_tokens(logits, Sampling()), best)
    assert torch.equal(select_tokens(logits, Sampling(temperature=5.0, top_k=1)), best)  # top-1: the argmax
    assert torch.equal(select_tokens(logits, Sampling(temperature=5.0, top_p=1e-6)), best)  # the top token alone
    top3 = logits.topk(3, dim=-1).indices
    for _ in range(5):
        s = select_tokens(logits, Sampling(temperature=5.0, top_k=3))
        assert (top3 == s[:, None]).any(-1).all()
    hot = torch.stack([select_tokens(logits, Sampling(temperature=5.0)) for _ in range(5)])
    assert (hot != best).any()  # a high temperature samples away from the argmax
    torch.manual_seed(7)
    a = select_tokens(logits, Sampling(temperature=1.0))
    torch.manual_seed(7)
    assert torch.equal(a, select_tokens(logits, Sampling(temperature=1.0)))


def test_dtype_auto_is_bf16_on_a_gpu_fp32_on_the_cpu():
    from moesq_core.serving.generate import resolve_dtype

    assert resolve_dtype("auto", torch.device("cuda")) == "bfloat16"
    assert resolve_dtype("auto", torch.device("cpu")) == "float32"
    assert [resolve_dtype(d, torch.device("cpu")) for d in ("bf16", "fp16", "fp32", "float16")] == [
        "bfloat16", "float16", "float32", "float16"]
    with pytest.raises(ValueError, match="--dtype 'int8'"):
        resolve_dtype("int8", torch.device("cpu"))


def test_sampling_is_seeded(p48_pack):
    from moesq_core.serving.generate import generate_batch, load_pack

    pack = load_pack(p48_pack, device="cpu")
    a = generate_batch(pack, PROMPTS[:2], max_new_tokens=8, temperature=1.5, seed=3)["completions"]
    b = generate_batch(pack, PROMPTS[:2], max_new_tokens=8, temperature=1.5, seed=3)["completions"]
    greedy = generate_batch(pack, PROMPTS[:2], max_new_tokens=8)["completions"]
    assert a == b and a != greedy


def test_cli_batch_from_prompts_and_file(p48_pack, tmp_path):
    f = tmp_path / "prompts.txt"
    f.write_text(f"{PROMPTS[1]}\n\n{PROMPTS[2]}\n")
    r = moesq("generate", p48_pack, "--prompt", PROMPTS[0], "--prompts", f, "--max-new-tokens", "3", "--dtype",
              "fp32", "--device", "cpu", "--json", "-", "--quiet")
    doc = json.loads(r.stdout)
    assert doc["schema"] == "moesq.generate/2" and doc["batch_size"] == 3 and doc["dtype"] == "float32"
    assert [c["prompt"] for c in doc["completions"]] == PROMPTS[:3]
    assert doc["prefill"]["tokens_per_second"] > 0 and doc["decode"]["tokens_per_second"] > 0
    assert doc["decode"]["steps"] == 2 and doc["decode"]["cuda_graph"] is False
    for args, msg in ((("--prompts", tmp_path / "missing.txt"), "cannot read"), (("--dtype", "int8"), "--dtype"),
                      ((), "give a prompt")):
        r = moesq("generate", p48_pack, *args, check=False)
        assert r.exit_code == 2 and msg in r.stderr, r.stderr


def test_decode_benchmark_times_the_generate_step(p48_pack):
    """The decode benchmark's loop is generate's DecodeStep (eager here): it prefills, steps and times."""
    from moesq_core.serving.bench.e2e_decode import run_decode
    from moesq_core.serving.generate import load_pack

    model = load_pack(p48_pack, device="cpu").model
    rec = run_decode(model, 2, 8, 4, 30.0, torch.Generator().manual_seed(0))
    assert rec["steps"] == 4 and rec["cuda_graph"] is False and rec["tokens_per_s"] > 0 and rec["prefill_s"] > 0


# -- benchmarks/generate_vs_decode_step.py (its measurements need a GPU) -------------------------------------------
def test_generate_vs_decode_step_arguments_and_refusal(tmp_path, capsys):
    from conftest import benchmark_module

    bench = benchmark_module("generate_vs_decode_step")
    args = bench.parse_args(["--root", str(tmp_path)])
    assert args.layers == 4 and args.batches == [1, 16] and args.format == "p48-nvfp4" and args.device == "cuda"
    for bad in (["--batches", "1", "0"], ["--new-tokens", "1"], ["--layers", "0"], ["--format", "int3"], []):
        with pytest.raises(SystemExit) as e:
            bench.parse_args(["--root", str(tmp_path), *bad] if bad else bad)
        assert e.value.code == 2
    texts = bench.prompts(4, 100)
    assert len({len(t) for t in texts}) == 4 and all(texts)  # different lengths: the batch is left-padded
    md = bench.markdown({"date": "d", "gpu": "g", "torch": "t", "transformers": "x", "commit": "c", "model": "m",
                         "format": "f", "dtype": "bfloat16", "new_tokens": 8, "prompt_chars": 100,
                         "runs": [{"batch": 16, "error": "OutOfMemoryError: ..."}]})
    assert "| 16 | error: OutOfMemoryError" in md
    if not torch.cuda.is_available():  # refuses before writing anything
        assert bench.main(["--root", str(tmp_path / "root"), "--out", str(tmp_path / "out")]) == 2
        assert "needs a CUDA GPU" in capsys.readouterr().err and not any(tmp_path.iterdir())


@pytest.mark.slow
def test_generate_vs_decode_step_smoke_run_on_cpu(tmp_path):
    """The whole script at a small width on the CPU (~1 min): model, init-rtn stage, pack, generate and step."""
    from conftest import run_benchmark_script

    run_benchmark_script("generate_vs_decode_step", "--root", tmp_path / "root", "--out", tmp_path / "out", "--small",
                         "--device", "cpu", "--layers", "1", "--batches", "1", "3", "--new-tokens", "6",
                         "--repeats", "1", "--prompt-chars", "120")
    (doc,) = [json.loads(f.read_text()) for f in (tmp_path / "out").glob("generate_vs_decode_step_cpu_*.json")]
    assert [r["batch"] for r in doc["runs"]] == [1, 3]
    for r in doc["runs"]:
        assert r["generate"]["decode_tokens_per_s"] > 0 and r["step"]["steps"] == 6 and r["generate_vs_step"] > 0
    assert (tmp_path / "out").joinpath(next((tmp_path / "out").glob("*.json")).stem + ".md").is_file()


# -- on a GPU: the captured step against the eager one ----------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@torch.no_grad()
def test_graph_step_matches_eager_step(packs, dtype):
    from moesq_core.serving.generate import generate_batch, load_pack

    hopper = torch.cuda.get_device_capability() == (9, 0)
    for fmt, (_, path, _) in packs.items():
        pack = load_pack(path, device="cuda", dtype=dtype)
        graph = generate_batch(pack, PROMPTS, max_new_tokens=16)
        eager = generate_batch(pack, PROMPTS, max_new_tokens=16, cuda_graph=False)
        assert eager["decode"]["cuda_graph"] is False
        fast = pack.experts_modules != ["MoesqExperts"]
        if hopper and fast:  # the Hopper experts modules read nothing on the host: the step is captured
            assert graph["decode"]["cuda_graph"], graph["decode"].get("graph_error")
        if graph["decode"]["cuda_graph"]:
            assert graph["completions"] == eager["completions"], fmt
        a = generate_batch(pack, PROMPTS, max_new_tokens=8, temperature=1.0, seed=5)
        b = generate_batch(pack, PROMPTS, max_new_tokens=8, temperature=1.0, seed=5)
        assert a["completions"] == b["completions"], fmt


@pytest.mark.gpu
@torch.no_grad()
def test_graph_step_matches_transformers_generate_on_gpu(packs):
    """fp32 on the GPU: the batched, captured step gives transformers' per-prompt greedy tokens."""
    from moesq_core.serving.generate import generate_batch, load_pack

    pack = load_pack(packs["p48-nvfp4"][1], device="cuda", dtype="fp32")
    run = generate_batch(pack, PROMPTS, max_new_tokens=12)
    tok, model = pack.tokenizer, pack.model
    agree = 0
    for p, c in zip(PROMPTS, run["completions"]):
        ids = tok(p, return_tensors="pt")["input_ids"].cuda()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                             pad_token_id=1, temperature=None, top_p=None, top_k=None)
        agree += c["completion"] == tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    # GPU kernels may round a batch differently from a single row; a near tie can then flip one token
    assert agree >= len(PROMPTS) - 1

