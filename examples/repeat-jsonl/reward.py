"""Reward of the `repeat` example: partial credit, as the built-in `repeat` task scores.

Correct positions / max(completion, answer length), halved when the model did not stop (no
EOS): a random-init model gets a signal from its first steps, which exact match would not give.
"""


def repeat_reward(completion: str, answer: str, finished: bool) -> float:
    if not answer and not completion:
        return 1.0 if finished else 0.5
    correct = sum(a == b for a, b in zip(completion, answer, strict=False))
    score = correct / max(len(completion), len(answer))
    return score if finished else score / 2
