"""A two-turn verifiers environment: add two digits, then double the sum.

    user       3+4=          the task's prompt
    assistant  7             turn 1 (trained on)
    user       *2=           the environment's reply (never trained on)
    assistant  14            turn 2 (trained on)

Written with verifiers' own v1 classes only: a `vf.Taskset` of `vf.Task`s whose `@vf.reward`
methods are the rubric, and a `vf.Env` whose `run` drives the exchange through
`agents.player.interaction(task)`. Any verifiers runner can load it (it exports them through
`__all__`); `uv run apps/train --env verifiers:examples/verifiers-multiturn/add_then_double.py`
trains on it. Every character is in the default tiny model's vocabulary (digits, `+*=`).
"""

import verifiers.v1 as vf

__all__ = ["AddThenDoubleEnv", "AddThenDoubleTaskset"]


def _credit(reply: str, target: str) -> float:
    """Correct positions over the longer of the two (partial credit, so a tiny model learns)."""
    reply = reply.strip()
    if not reply and not target:
        return 1.0
    correct = sum(a == b for a, b in zip(reply, target, strict=False))
    return correct / max(len(reply), len(target))


class AddThenDoubleData(vf.TaskData):
    total: int


class AddThenDoubleTask(vf.Task[AddThenDoubleData]):
    @vf.reward(weight=0.5)
    async def sum_turn(self, trace: vf.Trace) -> float:
        replies = trace.assistant_messages
        return _credit(replies[0].content or "", str(self.data.total)) if replies else 0.0

    @vf.reward(weight=0.5)
    async def double_turn(self, trace: vf.Trace) -> float:
        replies = trace.assistant_messages
        if len(replies) < 2:
            return 0.0
        return _credit(replies[1].content or "", str(2 * self.data.total))


class AddThenDoubleConfig(vf.TasksetConfig):
    digits: int = 10
    """Operands 0..digits-1: digits**2 tasks."""


class AddThenDoubleTaskset(vf.Taskset[AddThenDoubleTask, AddThenDoubleConfig]):
    def load(self):
        for a in range(self.config.digits):
            for b in range(self.config.digits):
                data = AddThenDoubleData(prompt=f"{a}+{b}=", total=a + b)
                yield AddThenDoubleTask(data, self.config.task)


class AddThenDoubleEnvConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig()


class AddThenDoubleEnv(vf.Env[AddThenDoubleEnvConfig]):
    """The task's prompt opens; the environment then asks for the double."""

    async def run(self, task, agents):
        async with agents.player.interaction(task) as chat:
            first = await chat.turn()
            if not first.terminated:
                await chat.turn("*2=")
