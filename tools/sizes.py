"""Sizes against the house limits: every module under `src/` over 400 lines and every function (methods and nested
functions too) over 80 lines, one per line as `path:line name N lines` (a function's name is its qualified name).

    python tools/sizes.py

A function's lines run from its `def` (decorators not counted) to its last line, docstring and comments included.
Always exits 0: the output is the report.
"""

import ast
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODULE_LINES = 400
FUNCTION_LINES = 80


def functions(tree: ast.AST, prefix: str = ""):
    """`(qualified name, node)` of every function in `tree`, inside classes and other functions too."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            name = f"{prefix}{node.name}"
            yield name, node
            yield from functions(node, f"{name}.")
        elif isinstance(node, ast.ClassDef):
            yield from functions(node, f"{prefix}{node.name}.")
        else:
            yield from functions(node, prefix)


def oversized(path: Path) -> list[str]:
    """The report lines of one source file: the module first, then its functions in the order they start."""
    text = path.read_text()
    shown = path.relative_to(REPO)
    found = []
    lines = len(text.splitlines())
    if lines > MODULE_LINES:
        found.append(f"{shown}:1 module {lines} lines")
    for name, node in sorted(functions(ast.parse(text, str(path))), key=lambda item: item[1].lineno):
        length = node.end_lineno - node.lineno + 1
        if length > FUNCTION_LINES:
            found.append(f"{shown}:{node.lineno} {name} {length} lines")
    return found


def main() -> int:
    for path in sorted((REPO / "src").rglob("*.py")):
        for line in oversized(path):
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
