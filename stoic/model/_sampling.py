"""Batched sampling: greedy, temperature, top-k, top-p, per-request seeds, logprobs.

All rows are handled with whole-batch tensor operations; only seeded rows draw their noise from
their own generator. A seeded row's noise depends on ``(seed, number of tokens generated)`` alone,
so its output is reproducible whatever it is batched with, and survives preemption and executor
restarts.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._batch import SampledToken, SeqChunk

__all__ = ["sample"]


def sample(
    logits: torch.Tensor,
    chunks: Sequence[SeqChunk],
    eos_token_ids: frozenset[int],
) -> list[SampledToken]:
    """Sample one token per row of ``logits`` (``[rows, vocab]``, rows aligned with ``chunks``)."""
    logits = logits.float()
    rows, vocab = logits.shape
    device = logits.device
    raw = logits

    # min_tokens: EOS and stop tokens may not end the sequence yet.
    banned_rows: list[int] = []
    banned_cols: list[int] = []
    for i, chunk in enumerate(chunks):
        p = chunk.params
        if chunk.num_generated < p.min_tokens:
            ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
            for t in ids:
                if 0 <= t < vocab:
                    banned_rows.append(i)
                    banned_cols.append(t)
    if banned_rows:
        logits = logits.clone()
        logits[banned_rows, banned_cols] = float("-inf")

    greedy = torch.tensor([c.params.greedy for c in chunks], device=device)
    chosen = logits.argmax(dim=-1)
    if not bool(greedy.all()):
        temps = torch.tensor([c.params.temperature or 1.0 for c in chunks], device=device)
        scaled = logits / temps[:, None]
        top_ks = [c.params.top_k if c.params.top_k > 0 else vocab for c in chunks]
        top_ps = [c.params.top_p for c in chunks]
        if any(k < vocab for k in top_ks) or any(p < 1.0 for p in top_ps):
            scaled = _top_k_top_p(
                scaled, torch.tensor(top_ks, device=device), torch.tensor(top_ps, device=device)
            )
        probs = torch.softmax(scaled, dim=-1)
        noise = torch.empty_like(probs).exponential_()
        for i, chunk in enumerate(chunks):
            seed = chunk.params.seed
            if seed is not None and not chunk.params.greedy:
                gen = torch.Generator(device=device)
                gen.manual_seed((seed * 1_000_003 + chunk.num_generated) % (2**63))
                noise[i].exponential_(generator=gen)
        drawn = (probs / noise).argmax(dim=-1)
        chosen = torch.where(greedy, chosen, drawn)

    want_logprobs = [c.params.logprobs for c in chunks]
    token_ids = chosen.tolist()
    if not any(want_logprobs):
        return [SampledToken(t) for t in token_ids]
    logprobs = torch.log_softmax(raw, dim=-1)
    chosen_lp = logprobs.gather(1, chosen[:, None]).squeeze(1).tolist()
    k = max(c.params.top_logprobs for c in chunks)
    top_vals: list[list[float]] = [[] for _ in range(rows)]
    top_ids: list[list[int]] = [[] for _ in range(rows)]
    if k > 0:
        values, indices = logprobs.topk(k, dim=-1)
        top_vals, top_ids = values.tolist(), indices.tolist()
    out: list[SampledToken] = []
    for i, chunk in enumerate(chunks):
        if not chunk.params.logprobs:
            out.append(SampledToken(token_ids[i]))
            continue
        n = chunk.params.top_logprobs
        alternatives = tuple(zip(top_ids[i][:n], top_vals[i][:n], strict=True))
        out.append(SampledToken(token_ids[i], chosen_lp[i], alternatives))
    return out


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    remove = ranks >= top_k[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
    cumulative = probs.cumsum(dim=-1)
    # keep the smallest prefix whose mass reaches top_p (the first token always stays)
    remove |= (cumulative - probs) >= top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
