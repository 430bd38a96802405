"""Turn a problem into prompt token ids, and completion ids back into text for scoring."""
from __future__ import annotations

from node.envs.base import Problem


def encode_prompt(tokenizer, problem: Problem) -> list[int]:
    """The user message through the tokenizer's chat template, with the generation prompt added."""
    messages = [{"role": "user", "content": problem.prompt}]
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        return [int(i) for i in ids]
    return [int(i) for i in tokenizer(problem.prompt, add_special_tokens=True)["input_ids"]]


def decode_completion(tokenizer, completion_ids: list[int]) -> str:
    """Text the reward function sees: special tokens (EOS, padding) removed."""
    return tokenizer.decode(completion_ids, skip_special_tokens=True)
