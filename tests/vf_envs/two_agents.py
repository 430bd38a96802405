"""A verifiers environment whose Env plays the agent twice (a multi-turn episode): must be refused."""
from __future__ import annotations

import verifiers.v1 as vf

from tests.vf_envs.prime_node_arith import ArithTaskset as _Arith


class TwiceTaskset(_Arith):
    pass


class TwiceEnv(vf.SingleAgentEnv):
    async def run(self, task, agents) -> None:
        await agents.agent.run(task)
        await agents.agent.run(task)


__all__ = ["TwiceEnv", "TwiceTaskset"]
