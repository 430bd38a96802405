"""Local verifiers (0.4, v1 API) environments for the tests: nothing is downloaded.

`ArithTaskset` is a plain single-turn taskset (loaded as "verifiers:tests.vf_envs.prime_node_arith",
or by id "prime-node-arith" through verifiers' own loader when this folder is on sys.path). The
others are loaded by "module:Class" and must be refused: tools, a conversation as the prompt, a
reward that needs a sandbox, an LLM judge.
"""
from __future__ import annotations

import random

import verifiers.v1 as vf


class ArithData(vf.TaskData):
    answer: str = ""


class ArithConfig(vf.TasksetConfig):
    rows: int = 20
    max_value: int = 9
    instructions: str = ""  # a system prompt, when set


class ArithTask(vf.Task[ArithData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def exact(self, trace: vf.Trace) -> float:
        return 1.0 if trace.last_reply == self.data.answer else 0.0

    @vf.reward(weight=0.0)
    async def checked_async(self, trace: vf.Trace) -> float:
        """Weight 0: proves rewards are awaited on an event loop (a scoring coroutine that yields)."""
        import asyncio

        await asyncio.sleep(0)
        return 1.0


class ArithTaskset(vf.Taskset[ArithTask, ArithConfig]):
    def load(self):
        for i in range(self.config.rows):
            rng = random.Random(i)
            a, b = rng.randint(0, self.config.max_value), rng.randint(0, self.config.max_value)
            yield ArithTask(ArithData(prompt=f"{a}+{b}=", answer=str(a + b), name=f"sum-{i}",
                                      system_prompt=self.config.instructions or None), self.config.task)


class Calculator(vf.Toolset):
    @vf.tool
    async def add(self, a: int, b: int) -> int:
        """Add two integers."""
        return a + b


class ToolTask(ArithTask):
    @classmethod
    def toolsets(cls, config):
        return [Calculator(vf.ToolsetConfig())]


class ToolTaskset(vf.Taskset[ToolTask, ArithConfig]):
    def load(self):
        yield ToolTask(ArithData(prompt="1+2=", answer="3"), self.config.task)


class ConversationTaskset(vf.Taskset[ArithTask, ArithConfig]):
    def load(self):
        prompt = [vf.UserMessage(content="1+2="), vf.AssistantMessage(content="3"), vf.UserMessage(content="and 2+2=")]
        yield ArithTask(ArithData(prompt=prompt, answer="4"), self.config.task)


class SandboxTask(ArithTask):
    @vf.reward
    async def file_written(self, trace: vf.Trace, runtime) -> float:
        return 1.0


class SandboxTaskset(vf.Taskset[SandboxTask, ArithConfig]):
    def load(self):
        yield SandboxTask(ArithData(prompt="1+2=", answer="3"), self.config.task)


class EmptyTaskset(vf.Taskset[ArithTask, ArithConfig]):
    def load(self):
        return iter(())


__all__ = ["ArithTaskset"]
