"""AST checker: finds blocking calls inside `async def` bodies.

Used by `test_no_blocking_calls.py` over every file under packages/ and apps/. Nested plain
`def`s and lambdas are skipped on purpose: they are what gets handed to an executor. A line
that blocks on purpose (a test's negative control) says so with `# blocking-on-purpose`.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

# Fully-qualified callables that block the event loop.
BLOCKING_CALLS = {
    "ray.get": "await the ref instead",
    "time.sleep": "use asyncio.sleep",
    "PIL.Image.open": "decode images in an executor",
    "qwen_vl_utils.process_vision_info": "run it in a bounded executor",
    "qwen_vl_utils.vision_process.process_vision_info": "run it in a bounded executor",
    # What environment and tool code typically calls (multi-turn episodes): run it in the
    # rollouter's tool pool (a SyncEnvironment, or `await rollout_engine.run_blocking(...)`).
    "subprocess.run": "use asyncio.create_subprocess_exec or the tool pool",
    "subprocess.call": "use asyncio.create_subprocess_exec or the tool pool",
    "subprocess.check_call": "use asyncio.create_subprocess_exec or the tool pool",
    "subprocess.check_output": "use asyncio.create_subprocess_exec or the tool pool",
    "os.system": "use asyncio.create_subprocess_shell or the tool pool",
    "urllib.request.urlopen": "use an async HTTP client or the tool pool",
    "socket.create_connection": "use asyncio.open_connection",
}
BLOCKING_MODULES = {"requests": "use an async HTTP client or an executor"}


@dataclass(frozen=True)
class Finding:
    path: str
    line: int
    function: str
    call: str
    advice: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line} in async {self.function}(): {self.call} ({self.advice})"


def _aliases(tree: ast.Module) -> dict[str, str]:
    """Local name -> fully-qualified name, from the file's imports."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    names[alias.asname] = alias.name
                else:
                    root = alias.name.split(".")[0]
                    names[root] = root
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def _dotted(node: ast.expr, aliases: dict[str, str]) -> str | None:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(aliases.get(node.id, node.id))
    return ".".join(reversed(parts))


def _is_zero_timeout_wait(call: ast.Call) -> bool:
    for keyword in call.keywords:
        if keyword.arg == "timeout":
            return isinstance(keyword.value, ast.Constant) and keyword.value.value == 0
    return False


def _check_call(call: ast.Call, aliases: dict[str, str]) -> tuple[str, str] | None:
    func = call.func
    name = _dotted(func, aliases)
    if name is not None:
        if name in BLOCKING_CALLS:
            return name, BLOCKING_CALLS[name]
        if name == "ray.wait" and not _is_zero_timeout_wait(call):
            return name, "ray.wait blocks unless timeout=0; await the refs"
        root = name.split(".")[0]
        if root in BLOCKING_MODULES and "." in name:
            return name, BLOCKING_MODULES[root]
    if isinstance(func, ast.Attribute) and func.attr == "result" and not call.args:
        return ".result()", "Future.result() blocks; await asyncio.wrap_future(fut)"
    return None


PRAGMA = "# blocking-on-purpose"


class _AsyncBodyVisitor(ast.NodeVisitor):
    def __init__(self, path: str, function: str, aliases: dict[str, str], lines: list[str]) -> None:
        self.path, self.function, self.aliases, self.lines = path, function, aliases, lines
        self.findings: list[Finding] = []

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        return  # a sync helper: typically run in an executor

    def visit_AsyncFunctionDef(self, node: ast.AsyncFunctionDef) -> None:
        return  # checked on its own

    def visit_Lambda(self, node: ast.Lambda) -> None:
        return

    def visit_Call(self, node: ast.Call) -> None:
        hit = _check_call(node, self.aliases)
        if hit is not None and PRAGMA not in self.lines[node.lineno - 1]:
            self.findings.append(Finding(self.path, node.lineno, self.function, *hit))
        self.generic_visit(node)


def check_source(source: str, path: str = "<string>") -> list[Finding]:
    tree = ast.parse(source, filename=path)
    aliases = _aliases(tree)
    lines = source.splitlines()
    findings: list[Finding] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.AsyncFunctionDef):
            visitor = _AsyncBodyVisitor(path, node.name, aliases, lines)
            for statement in node.body:
                visitor.visit(statement)
            findings.extend(visitor.findings)
    return findings


def check_tree(*roots: Path) -> list[Finding]:
    findings: list[Finding] = []
    for root in roots:
        for file in sorted(root.rglob("*.py")):
            if ".venv" in file.parts:
                continue
            findings.extend(check_source(file.read_text(), str(file)))
    return findings
