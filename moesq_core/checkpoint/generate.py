"""`moesq generate`: load any packed checkpoint through load_packed and generate text from a prompt."""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: no CUDA GPU is visible; use --device cpu")
    return dev


@torch.no_grad()
def generate_text(path: str | Path, prompt: str, *, max_new_tokens: int = 64, device: str = "auto",
                  dtype: str = "float32", chat: bool = False, temperature: float = 0.0, seed: int = 0,
                  progress=None, verify: bool = True) -> dict:
    """Generate a completion of `prompt` with the packed model at `path`; returns the `moesq generate --json`
    document (schema "moesq.generate/1"). Greedy unless temperature > 0 (then seeded sampling). verify: see
    load_packed."""
    from .loader import load_packed

    path = Path(path)
    if max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"--temperature must be >= 0, got {temperature}")
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    if not prompt:
        raise ValueError("--prompt is empty")
    dev = resolve_device(device)
    t0 = time.perf_counter()
    model, tok = load_packed(path, device=dev, dtype=DTYPES[dtype], progress=progress, verify=verify)
    load_s = time.perf_counter() - t0
    if tok is None:
        raise ValueError(f"{path} has no tokenizer files; generation needs one")
    fmt = json.loads((path / "config.json").read_text())["quantization_config"]["moesq"]["format"]
    experts = {type(m).__name__ for m in model.modules() if type(m).__name__.endswith("Experts")}
    text = prompt
    if chat:
        if not getattr(tok, "chat_template", None):
            raise ValueError(f"--chat: {path} has no chat template (chat_template.jinja or tokenizer_config.json)")
        text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    ids = tok(text, return_tensors="pt")["input_ids"].to(dev)
    torch.manual_seed(seed)
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=temperature > 0, pad_token_id=tok.pad_token_id or tok.eos_token_id)
    if temperature > 0:
        kwargs["temperature"] = temperature
    else:
        kwargs.update(temperature=None, top_p=None, top_k=None)
    t1 = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    gen_s = time.perf_counter() - t1
    new = out[0, ids.shape[1]:]
    return {
        "schema": "moesq.generate/1", "path": str(path), "format": fmt, "device": str(dev), "dtype": dtype,
        "experts_module": sorted(experts), "prompt": prompt, "chat": chat, "completion": tok.decode(new, skip_special_tokens=True),
        "new_tokens": int(new.numel()), "load_seconds": round(load_s, 3),
        "tokens_per_second": round(new.numel() / gen_s, 3) if gen_s > 0 else None,
    }
