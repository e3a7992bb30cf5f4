"""Drop-in replacements for other RL stacks' queues, built on this package's queue.

Each module keeps the other stack's call shapes and changes only what is a defect there, each
difference documented in the module. Import the module you need (`async_queue.compat.verl`);
none of them imports the other stack.
"""

from __future__ import annotations

__all__: list[str] = []
