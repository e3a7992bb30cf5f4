"""What every benchmark returns: table rows for people, one JSON object for machines."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["BenchReport"]


@dataclass
class BenchReport:
    """`rows` become the printed table; `figures` become the last-line JSON object.

    Put the headline ratio against the same-run baseline and whether the target was met in
    `figures` (e.g. `{"speedup": 4.2, "target": 3.0, "met": True}`).
    """

    title: str
    rows: list[dict[str, Any]]
    figures: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
