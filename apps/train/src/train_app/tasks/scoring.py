"""Reward helpers shared by the tasks."""

from __future__ import annotations

__all__ = ["partial_credit"]


def partial_credit(output: str, target: str, ended: bool) -> float:
    """Correct positions / max(output, target length); halved when the model did not stop."""
    if not target and not output:
        return 1.0 if ended else 0.5
    correct = sum(a == b for a, b in zip(output, target, strict=False))
    score = correct / max(len(output), len(target))
    return score if ended else score / 2
