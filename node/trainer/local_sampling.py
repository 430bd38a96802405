"""Sampling in the trainer's own process, without a swarm: the learning test and bench/learning.py use it
to measure RL itself (the swarm's workers sample with node.worker.backends and the seeded sampler)."""
from __future__ import annotations

import torch


@torch.no_grad()
def sample_group(model, prompt_ids: list[int], n: int, max_tokens: int, eos_id: int,
                 generator: torch.Generator, temperature: float = 1.0) -> list[tuple[list[int], list[float]]]:
    """n completions of one prompt, sampled token by token with a KV cache; (ids, sampler logprobs) each."""
    was_training = model.training
    model.eval()
    ids = torch.tensor([prompt_ids] * n)
    out = model(input_ids=ids, use_cache=True)
    past, logits = out.past_key_values, out.logits[:, -1]
    tokens: list[list[int]] = [[] for _ in range(n)]
    logprobs: list[list[float]] = [[] for _ in range(n)]
    done = [False] * n
    for _ in range(max_tokens):
        lp = torch.log_softmax(logits.float() / temperature, dim=-1)
        nxt = torch.multinomial(lp.exp(), 1, generator=generator)[:, 0]
        for i in range(n):
            if not done[i]:
                tokens[i].append(int(nxt[i]))
                logprobs[i].append(float(lp[i, nxt[i]]))
                done[i] = int(nxt[i]) == eos_id
        if all(done):
            break
        out = model(input_ids=nxt[:, None], past_key_values=past, use_cache=True)
        past, logits = out.past_key_values, out.logits[:, -1]
    model.train(was_training)
    return list(zip(tokens, logprobs))
