"""Drop-in async replacements for other stacks' vision steps (`mm_preprocess.compat.verl`)."""

from __future__ import annotations

__all__: list[str] = []
