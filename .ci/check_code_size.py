"""Fails when a module of lomo_ds is over MAX_FILE_LINES lines, or a function in it (a method or a nested
function too) over MAX_FUNCTION_LINES, naming each with its line count.

A module past the limit holds several jobs, and every new feature lands in it; a function past it no
longer reads in one screen. Split them rather than raise a limit here.

    python3 .ci/check_code_size.py            # the package (lomo_ds/)
    python3 .ci/check_code_size.py DIR ...    # other folders, with the same limits
"""
from __future__ import annotations

import ast
import os
import sys

MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80
PACKAGE = "lomo_ds"


def python_files(folder: str) -> list[str]:
    """Every .py file under `folder`, sorted (caches skipped)."""
    out = []
    for here, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__" and not d.startswith("."))
        out += [os.path.join(here, f) for f in sorted(files) if f.endswith(".py")]
    return out


def long_functions(tree: ast.AST) -> list[tuple[str, int, int]]:
    """(qualified name, first line, lines from its `def` to its last line) of every function in
    `tree` over MAX_FUNCTION_LINES, nested ones and methods included."""
    out = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    lines = child.end_lineno - child.lineno + 1
                    if lines > MAX_FUNCTION_LINES:
                        out.append((name, child.lineno, lines))
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(tree, "")
    return out


def oversized(folders: list[str], root: str) -> list[str]:
    """One line per module over MAX_FILE_LINES and per function over MAX_FUNCTION_LINES in `folders`
    (paths relative to `root`)."""
    problems = []
    for folder in folders:
        for path in python_files(os.path.join(root, folder)):
            name = os.path.relpath(path, root)
            with open(path, encoding="utf-8") as f:
                source = f.read()
            lines = len(source.splitlines())
            if lines > MAX_FILE_LINES:
                problems.append(f"{name}: {lines} lines (a module's limit is {MAX_FILE_LINES})")
            for func, first, length in long_functions(ast.parse(source, filename=name)):
                problems.append(f"{name}:{first}: {func} is {length} lines (a function's limit is "
                                f"{MAX_FUNCTION_LINES})")
    return problems


def main(argv: list[str] | None = None) -> int:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    folders = (sys.argv[1:] if argv is None else argv) or [PACKAGE]
    problems = oversized(folders, root)
    for line in problems:
        print(line, file=sys.stderr)
    if problems:
        print(f"{len(problems)} over the size limits: split the module or the function "
              f"(.ci/check_code_size.py says why)", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
