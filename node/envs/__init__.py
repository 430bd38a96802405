"""Tasks: prompts plus reward functions that run offline.

    task = load_task("reverse-text", {"min_len": 3, "max_len": 6})
    problem = task.sample(seed, index)        # Problem(prompt_id, prompt, answer); deterministic
    ids = encode_prompt(tokenizer, problem)   # chat template + generation prompt
    reward = task.score(problem, decode_completion(tokenizer, completion_ids))   # float in [0, 1]

Built-ins: `reverse-text` (LCS-ratio partial credit), `arithmetic` (exact match), `guess-number`
(multi-turn: the environment answers "higher"/"lower" between the model's turns; see episode.py). Custom tasks by
"package.module:Class" (subclass `Task`, or any class with sample(seed, index) and score()).
Light imports only (no torch): the coordinator imports this at start-up.
"""
from node.envs.base import Problem, Task, TaskError, TaskKwargs
from node.envs.prompt import decode_completion, encode_prompt
from node.envs.registry import BUILTIN_TASKS, load_task

__all__ = ["BUILTIN_TASKS", "Problem", "Task", "TaskError", "TaskKwargs", "decode_completion", "encode_prompt",
           "load_task"]
