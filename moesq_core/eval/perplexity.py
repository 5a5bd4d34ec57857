"""Perplexity over a text file in fixed, non-overlapping windows (the shared models' reference protocol:
the first 65,536 tokens, 512-token windows)."""
from __future__ import annotations

import math
from pathlib import Path

import torch

from moesq_core.compression.calibration import open_text


def load_eval_tokens(tokenizer, path: str | Path, max_tokens: int = 65536) -> torch.Tensor:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"evaluation text {path} not found")
    with open_text(path) as fh:
        text = fh.read()
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:max_tokens]
    if len(ids) < 2:
        raise ValueError(f"{path}: too little text to evaluate")
    return torch.tensor(ids, dtype=torch.int64)


@torch.no_grad()
def perplexity(model, tokens: torch.Tensor, window: int = 512, batch_size: int = 8, progress=None) -> float:
    """exp(mean next-token NLL) over non-overlapping windows (the last partial window is dropped)."""
    n = len(tokens) // window
    if n == 0:
        raise ValueError(f"need at least {window} tokens, have {len(tokens)}")
    seqs = tokens[: n * window].reshape(n, window)
    device = next(model.parameters()).device
    nll, count = 0.0, 0
    for i in range(0, n, batch_size):
        batch = seqs[i : i + batch_size].to(device)
        logits = model(input_ids=batch, use_cache=False).logits.float()
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum")
        nll += float(loss)
        count += batch[:, 1:].numel()
        if progress:
            progress(len(batch))
    return math.exp(nll / count)
