"""`moesq generate`: load any packed checkpoint through load_packed and generate text from a batch of prompts.

The prompts are tokenized one by one, left-padded into one batch and run through the static-cache decode step
(`moesq_core.serving.decode_step`): one prefill, then one step per token, replayed as a CUDA graph on a GPU.
Greedy unless temperature > 0; sampling then applies the model's generation config's top-k / top-p (transformers'
defaults: 50 and 1.0), seeded.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
DTYPE_CHOICES = ("auto", *DTYPE_ALIASES, *DTYPES)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: no CUDA GPU is visible; use --device cpu")
    return dev


def resolve_dtype(dtype: str, device: torch.device) -> str:
    """The torch dtype name for --dtype: auto is bfloat16 on a GPU and float32 on the CPU."""
    if dtype == "auto":
        return "bfloat16" if device.type == "cuda" else "float32"
    name = DTYPE_ALIASES.get(dtype, dtype)
    if name not in DTYPES:
        raise ValueError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPE_CHOICES)}")
    return name


def read_prompts(prompts: list[str] | tuple[str, ...] = (), prompts_file: str | Path | None = None) -> list[str]:
    """The --prompt values, then the non-blank lines of --prompts FILE (one prompt per line)."""
    out = list(prompts)
    if any(not p for p in out):
        raise ValueError("--prompt is empty")
    if prompts_file is not None:
        f = Path(prompts_file)
        try:
            lines = f.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--prompts {f}: cannot read it ({e})") from None
        from_file = [line for line in lines if line.strip()]
        if not from_file:
            raise ValueError(f"--prompts {f}: no prompts (one per line)")
        out += from_file
    if not out:
        raise ValueError("give a prompt: --prompt TEXT (repeatable) or --prompts FILE")
    return out


def check_max_new_tokens(path: str | Path, max_new_tokens: int) -> None:
    """Refuse (ValueError naming --max-new-tokens) a count below 1 or beyond the context of the model at `path`
    (its config.json's max_position_embeddings), before anything is loaded: the KV cache is sized from it."""
    if max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return  # the load says what is wrong with the dir
    context = (config.get("text_config") or config).get("max_position_embeddings") if isinstance(config, dict) \
        else None
    if isinstance(context, int) and max_new_tokens >= context:
        raise ValueError(f"--max-new-tokens {max_new_tokens}: the model's context is {context} tokens "
                         "(max_position_embeddings), prompt included")


@dataclass
class LoadedPack:
    """A packed model loaded for generation."""

    path: Path
    model: torch.nn.Module
    tokenizer: object
    format: str
    device: torch.device
    dtype: str
    load_seconds: float

    @property
    def experts_modules(self) -> list[str]:
        return sorted({type(m).__name__ for m in self.model.modules() if type(m).__name__.endswith("Experts")})


def load_pack(path: str | Path, device: str = "auto", dtype: str = "auto", progress=None,
              verify: bool = True) -> LoadedPack:
    from moesq_core.serving.loader import load_packed

    path = Path(path)
    dev = resolve_device(device)
    dtype_name = resolve_dtype(dtype, dev)
    t0 = time.perf_counter()
    model, tok = load_packed(path, device=dev, dtype=DTYPES[dtype_name], progress=progress, verify=verify)
    load_s = time.perf_counter() - t0
    if tok is None:
        raise ValueError(f"{path} has no tokenizer files; generation needs one")
    fmt = json.loads((path / "config.json").read_text())["quantization_config"]["moesq"]["format"]
    return LoadedPack(path, model, tok, fmt, dev, dtype_name, load_s)


def _token_ids(ids) -> tuple[int, ...]:
    if ids is None:
        return ()
    return tuple(ids) if isinstance(ids, (list, tuple)) else (int(ids),)


def left_padded(rows: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids [B, L], attention_mask [B, L]) with each row right-aligned after pad_token_id padding."""
    L = max(len(r) for r in rows)
    ids = torch.full((len(rows), L), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), L), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, L - len(r):] = torch.tensor(r, dtype=torch.long)
        mask[i, L - len(r):] = 1
    return ids, mask


def _rate(tokens: int, seconds: float) -> float | None:
    return round(tokens / seconds, 3) if tokens and seconds > 0 else None


@torch.no_grad()
def generate_batch(pack: LoadedPack, prompts: list[str], *, max_new_tokens: int = 64, chat: bool = False,
                   temperature: float = 0.0, seed: int = 0, cuda_graph: bool = True) -> dict:
    """Generate a completion for every prompt, all in one batch; returns the completions, tokens/s of the
    prefill and of the decode steps, and whether the step ran as a CUDA graph (the generate JSON's run part)."""
    from moesq_core.serving.decode_step import Sampling, generate_tokens

    if max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"--temperature must be >= 0, got {temperature}")
    tok, model = pack.tokenizer, pack.model
    texts = prompts
    if chat:
        if not getattr(tok, "chat_template", None):
            raise ValueError(f"--chat: {pack.path} has no chat template (chat_template.jinja or tokenizer_config.json)")
        texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
                 for p in prompts]
    rows = [list(tok(t)["input_ids"]) for t in texts]
    for p, r in zip(prompts, rows):
        if not r:
            raise ValueError(f"prompt {p!r} has no tokens")
    gc = model.generation_config
    eos = _token_ids(gc.eos_token_id)
    pad = next((t for t in (gc.pad_token_id, tok.pad_token_id, *eos) if t is not None), 0)
    sampling = Sampling(temperature, gc.top_k if gc.top_k is not None else 50,
                        gc.top_p if gc.top_p is not None else 1.0) if temperature > 0 else Sampling()
    ids, mask = left_padded(rows, pad)
    torch.manual_seed(seed)
    gen = generate_tokens(model, ids.to(pack.device), mask.to(pack.device), max_new_tokens, sampling=sampling,
                          eos_token_ids=eos, pad_token_id=pad, cuda_graph=cuda_graph)
    completions = [{"prompt": p, "completion": tok.decode(t, skip_special_tokens=True), "new_tokens": len(t)}
                   for p, t in zip(prompts, gen.tokens)]
    new = sum(len(t) for t in gen.tokens)
    decode = {"tokens": gen.decode_tokens, "steps": gen.decode_steps, "seconds": round(gen.decode_seconds, 4),
              "tokens_per_second": _rate(gen.decode_tokens, gen.decode_seconds), "cuda_graph": gen.cuda_graph,
              "capture_seconds": round(gen.capture_seconds, 4)}
    if gen.graph_error and pack.device.type == "cuda":  # why the step ran eagerly
        decode["graph_error"] = gen.graph_error
    return {
        "batch_size": len(prompts), "completions": completions, "new_tokens": new,
        "prefill": {"tokens": gen.prompt_tokens, "seconds": round(gen.prefill_seconds, 4),
                    "tokens_per_second": _rate(gen.prompt_tokens, gen.prefill_seconds)},
        "decode": decode,
        "tokens_per_second": _rate(new, gen.prefill_seconds + gen.decode_seconds),
    }


def generate_text(path: str | Path, prompts: list[str], *, max_new_tokens: int = 64, device: str = "auto",
                  dtype: str = "auto", chat: bool = False, temperature: float = 0.0, seed: int = 0,
                  progress=None, verify: bool = True) -> dict:
    """Generate a completion of every prompt with the packed model at `path`, in one batch; returns the
    `moesq generate --json` document (schema "moesq.generate/2"). verify: see load_packed."""
    if not prompts:
        raise ValueError("give a prompt: --prompt TEXT (repeatable) or --prompts FILE")
    check_max_new_tokens(path, max_new_tokens)
    if temperature < 0:
        raise ValueError(f"--temperature must be >= 0, got {temperature}")
    if any(not p for p in prompts):
        raise ValueError("--prompt is empty")
    resolve_dtype(dtype, torch.device("cpu"))  # a bad --dtype fails before the load
    pack = load_pack(path, device, dtype, progress, verify=verify)
    run = generate_batch(pack, prompts, max_new_tokens=max_new_tokens, chat=chat, temperature=temperature, seed=seed)
    return {
        "schema": "moesq.generate/2", "path": str(pack.path), "format": pack.format, "device": str(pack.device),
        "dtype": pack.dtype, "experts_module": pack.experts_modules, "chat": chat, "max_new_tokens": max_new_tokens,
        "temperature": temperature, "seed": seed, "load_seconds": round(pack.load_seconds, 3), **run,
    }
