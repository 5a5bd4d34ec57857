"""One decode step of a transformers causal LM over a StaticCache, on static buffers, replayable as a CUDA graph.

`DecodeStep` holds every tensor a step reads or writes (the token fed, each row's left-padding count, the cache
slot, finished flags, the sequences) at fixed addresses, so a step is pure device work: the model's forward
(4D additive attention mask built from the padding counts and the slot, per-row positions, `logits_to_keep=1`),
token selection (greedy argmax, or temperature / top-k / top-p sampling by the exponential race, which needs no
host read), and in-place updates. On a GPU `capture()` warms the step up on a side stream and records it in a
CUDA graph; `step()` then replays it (one launch per token instead of the forward's hundreds). Elsewhere, or
when capture fails (an experts module that reads the device from the host), `step()` runs it eagerly: the same
static-cache path. `generate_tokens` is the loop `moesq generate` runs; the decode benchmark replays the same
step (`moesq_core.serving.bench.e2e_decode`).

Contract: a batch of left-padded prompts (each row's padding a prefix); rows that emit an end token are padded
afterwards, as transformers' `generate` does. The model's attention must take a 4D additive mask (sdpa, eager).
"""
from __future__ import annotations

import inspect
import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    """Sampling settings: temperature 0 = greedy; top_k 0 and top_p 1.0 switch those filters off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


def cache_keyword(model) -> str:
    """The forward's name for the cache argument: `cache` in current transformers (which deprecates
    `past_key_values`), `past_key_values` in earlier 5.x releases."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def select_tokens(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """Next token per row of logits [B, V]: argmax, or a sample after temperature, top-k and top-p (in
    transformers' order). Sampling draws exponentials from the device's default generator (capturable)."""
    logits = logits.float()
    if sampling.greedy:
        return logits.argmax(-1)
    logits = logits / sampling.temperature
    if 0 < sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1)  # ascending
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum <= 1 - sampling.top_p
        drop[:, -1] = False  # keep at least the most likely token
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    probs = logits.softmax(-1)
    # argmax(p / E) with E ~ Exp(1) draws from p (the exponential race)
    return (probs / torch.empty_like(probs).exponential_()).argmax(-1)


class DecodeStep:
    """Static buffers, a StaticCache and the decode step for `batch` rows of at most `max_len` tokens.

    Use: `capture()` (optional, CUDA), then `prefill(input_ids, attention_mask)` for each batch of prompts, then
    `step()` per token. After prefill and n steps, `sequences[:, L : L + n + 1]` hold the new tokens (L the
    padded prompt length)."""

    def __init__(self, model, batch: int, max_len: int, sampling: Sampling = Sampling(),
                 eos_token_ids: tuple[int, ...] = (), pad_token_id: int = 0):
        from transformers import StaticCache

        impl = getattr(model.config, "_attn_implementation", None)
        if impl not in (None, "sdpa", "eager"):
            raise ValueError(f"attention implementation {impl!r}: the static-cache decode step needs sdpa or eager")
        self.model, self.batch, self.max_len, self.sampling = model, batch, max_len, sampling
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        dev = self.device
        self.cache = StaticCache(config=model.config, max_cache_len=max_len)
        self.cache_kw = cache_keyword(model)
        self.tokens = torch.zeros(batch, 1, dtype=torch.long, device=dev)  # the token fed at column `slot`
        self.pad = torch.zeros(batch, 1, dtype=torch.long, device=dev)  # left-padding count per row
        self.slot = torch.zeros(1, dtype=torch.long, device=dev)  # cache column of the token fed next
        self.finished = torch.zeros(batch, dtype=torch.bool, device=dev)
        self.sequences = torch.zeros(batch, max_len, dtype=torch.long, device=dev)
        self.columns = torch.arange(max_len, device=dev)
        self.eos = torch.tensor(list(eos_token_ids), dtype=torch.long, device=dev)
        self.pad_token_id = pad_token_id
        self.graph = None
        self.graph_error: str | None = None
        self.eager_step_ms: float | None = None
        self.prompt_len = 0

    # -- the step -------------------------------------------------------------------------------------------
    def _mask(self, query_columns: torch.Tensor) -> torch.Tensor:
        """[B, 1, Q, max_len] additive mask: a query at column c sees its row's real keys up to c; a padding
        query sees only itself (no row is all masked, so padding rows stay finite)."""
        q = query_columns.view(1, -1, 1)
        cols = self.columns.view(1, 1, -1)
        pad = self.pad.view(-1, 1, 1)
        allowed = ((cols >= pad) & (cols <= q)) | (cols == q)
        zero = torch.zeros((), dtype=self.dtype, device=self.device)
        return torch.where(allowed, zero, torch.finfo(self.dtype).min).unsqueeze(1)

    def _forward(self, ids: torch.Tensor, query_columns: torch.Tensor) -> torch.Tensor:
        positions = (query_columns.view(1, -1) - self.pad).clamp_min(0)
        out = self.model(input_ids=ids, position_ids=positions, attention_mask=self._mask(query_columns),
                         use_cache=True, logits_to_keep=1, **{self.cache_kw: self.cache})
        return out.logits[:, -1]

    def _advance(self, logits: torch.Tensor) -> None:
        nxt = select_tokens(logits, self.sampling)
        nxt = torch.where(self.finished, torch.full_like(nxt, self.pad_token_id), nxt)
        self.finished |= (nxt[:, None] == self.eos).any(-1)
        self.tokens.copy_(nxt[:, None])
        self.slot.add_(1)
        self.sequences.index_copy_(1, self.slot, self.tokens)

    def _eager_step(self) -> None:
        self._advance(self._forward(self.tokens, self.slot))

    @torch.no_grad()
    def step(self) -> None:
        """Feed `tokens` at column `slot`, pick the next token into `tokens` and `sequences`, advance `slot`."""
        if self.graph is not None:
            self.graph.replay()
        else:
            self._eager_step()

    # -- set-up ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def capture(self, warmup: int = 2) -> bool:
        """Warm the step up on a side stream (the cache allocates, kernels compile and tune; the last warm-up
        step's time is `eager_step_ms`) and capture it in a CUDA graph. Leaves the buffers and the cache reset
        (call before `prefill`). Returns whether a graph was captured; if not, `graph_error` says why and `step`
        stays eager. The last warm-up step runs with synchronising CUDA calls raising: a step that reads the
        device from the host (e.g. a reference experts module) cannot be captured, and is then not tried,
        since a capture that fails part-way leaves its stream's allocations routed to the dead graph's pool."""
        if self.device.type != "cuda":
            self.graph_error = "not a CUDA device"
            return False
        main = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            for i in range(warmup):
                t0 = time.perf_counter()
                mode = torch.cuda.get_sync_debug_mode()
                if i == warmup - 1:
                    torch.cuda.set_sync_debug_mode("error")
                try:
                    self._eager_step()
                except RuntimeError as e:
                    self.graph_error = f"the step synchronises with the host: {e}"[:300]
                finally:
                    torch.cuda.set_sync_debug_mode(mode)
                torch.cuda.synchronize(self.device)
                self.eager_step_ms = round((time.perf_counter() - t0) * 1e3, 3)
        main.wait_stream(side)
        torch.cuda.synchronize(self.device)
        if self.graph_error is None:
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.stream(torch.cuda.Stream(self.device)):  # left even when the capture fails
                    graph.capture_begin()
                    try:
                        self._eager_step()
                    finally:
                        graph.capture_end()
                self.graph = graph
            except RuntimeError as e:
                self.graph_error = f"{type(e).__name__}: {e}"[:300]
            torch.cuda.synchronize(self.device)
        self._reset()
        return self.graph is not None

    def _reset(self) -> None:
        self.cache.reset()  # in place: the captured graph keeps the same addresses
        for t in (self.tokens, self.pad, self.slot, self.sequences):
            t.zero_()
        self.finished.zero_()

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> None:
        """Run the left-padded prompts [B, L] (attention_mask 1 on real tokens) into a reset cache and pick each
        row's first new token (at column L)."""
        B, L = input_ids.shape
        if B != self.batch or L >= self.max_len:
            raise ValueError(f"prompts [{B}, {L}] do not fit this step ({self.batch} rows of < {self.max_len} tokens)")
        mask = attention_mask.to(self.device).long()
        pad = L - mask.sum(1)
        if bool((mask != (self.columns[:L].view(1, -1) >= pad.view(-1, 1)).long()).any()):
            raise ValueError("prompts must be left-padded (each row's padding a prefix)")
        self._reset()
        self.pad.copy_(pad.view(-1, 1))
        ids = input_ids.to(self.device)
        self.sequences[:, :L] = ids
        self.prompt_len = L
        self.slot.fill_(L - 1)
        self._advance(self._forward(ids, self.columns[:L]))

    def new_tokens(self, steps: int) -> torch.Tensor:
        """The [B, steps + 1] tokens picked by the prefill and `steps` steps (padding after a row's end token)."""
        return self.sequences[:, self.prompt_len:self.prompt_len + steps + 1]


@dataclass
class Generation:
    """What generate_tokens produced: per row the new token ids (through the first end token), and timings."""

    tokens: list[list[int]]
    prompt_tokens: int  # real (unpadded) prompt tokens over all rows
    prefill_seconds: float
    decode_steps: int
    decode_seconds: float
    cuda_graph: bool
    graph_error: str | None = None
    eager_step_ms: float | None = None  # one warm-up step before capture (CUDA)
    capture_seconds: float = 0.0  # warm-up and capture, before the prefill (not in the timings above)

    @property
    def decode_tokens(self) -> int:
        """Tokens picked by decode steps (each row's first new token comes from the prefill)."""
        return sum(max(len(t) - 1, 0) for t in self.tokens)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def generate_tokens(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int, *,
                    sampling: Sampling = Sampling(), eos_token_ids: tuple[int, ...] = (), pad_token_id: int = 0,
                    cuda_graph: bool = True, finished_check_every: int = 8) -> Generation:
    """Up to max_new_tokens new tokens for each left-padded prompt row, through one DecodeStep (captured in a
    CUDA graph on a GPU when cuda_graph and capture succeeds). Stops early once every row has emitted an end
    token; on a GPU that is read every `finished_check_every` steps (a host read stalls the replay queue)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    B, L = input_ids.shape
    step = DecodeStep(model, B, L + max_new_tokens, sampling, eos_token_ids, pad_token_id)
    dev = step.device
    t_capture = time.perf_counter()
    if cuda_graph and dev.type == "cuda":
        step.capture()
    capture_s = time.perf_counter() - t_capture
    check_every = finished_check_every if dev.type == "cuda" else 1
    _sync(dev)
    t0 = time.perf_counter()
    step.prefill(input_ids, attention_mask)
    _sync(dev)
    t1 = time.perf_counter()
    steps = 0
    while steps < max_new_tokens - 1:
        if len(eos_token_ids) and steps % check_every == 0 and bool(step.finished.all()):
            break
        step.step()
        steps += 1
    _sync(dev)
    t2 = time.perf_counter()
    rows = []
    eos = set(eos_token_ids)
    for row in step.new_tokens(steps).tolist():
        end = next((i for i, t in enumerate(row) if t in eos), None)
        rows.append(row if end is None else row[:end + 1])
    return Generation(rows, int(attention_mask.sum()), t1 - t0, steps, t2 - t1, step.graph is not None,
                      step.graph_error, step.eager_step_ms, capture_s)
