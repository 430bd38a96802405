"""Turn a problem into prompt token ids, and completion ids back into text for scoring."""
from __future__ import annotations

from node.envs.base import Problem


def encode_prompt(tokenizer, problem: Problem) -> list[int]:
    """The user message through the tokenizer's chat template, with the generation prompt added.

    A problem's system message goes first as a system turn; where the chat template has no system
    role (the tiny character tokenizer's), it is put before the user's text instead, separated by a
    blank line, as verifiers' harnesses do.
    """
    system = getattr(problem, "system", None)
    user = {"role": "user", "content": problem.prompt}
    folded = {"role": "user", "content": f"{system}\n\n{problem.prompt}"} if system else user
    if getattr(tokenizer, "chat_template", None):
        if system:
            from jinja2 import TemplateError

            try:
                return _apply(tokenizer, [{"role": "system", "content": system}, user])
            except TemplateError:
                pass
        return _apply(tokenizer, [folded])
    return [int(i) for i in tokenizer(folded["content"], add_special_tokens=True)["input_ids"]]


def _apply(tokenizer, messages: list[dict]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    return [int(i) for i in ids]


def decode_completion(tokenizer, completion_ids: list[int]) -> str:
    """Text the reward function sees: special tokens (EOS, padding) removed."""
    return tokenizer.decode(completion_ids, skip_special_tokens=True)


def decode_completions(tokenizer, completions: list[list[int]]) -> list[str]:
    """`decode_completion` of each, in one call: the light tokenizer hands the whole list to the Rust tokenizer's
    decode_batch, which lets go of the GIL (the coordinator's intake decodes a submission's 128 completions in a
    thread beside the event loop) and decodes on every core."""
    return list(tokenizer.batch_decode(completions, skip_special_tokens=True))
