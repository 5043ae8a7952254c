"""Fails when a tracked file over MAX_BYTES lies outside the shipped data folders.

Large files belong in a data folder the package ships (and then in DATA_FOLDERS, this one list);
anything else that big (a wheel, a checkpoint, a log) is a mistake to commit.

    python3 .ci/check_sizes.py
"""
from __future__ import annotations

import os
import subprocess
import sys

MAX_BYTES = 1_000_000
# The shipped data folders: a new one joins this list, nowhere else.
DATA_FOLDERS = ("lomo_ds/data/builtin/",)


def oversized(root: str) -> list[tuple[str, int]]:
    """Tracked files over MAX_BYTES outside DATA_FOLDERS, with their sizes."""
    names = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True).stdout
    out = []
    for name in filter(None, names.decode().split("\0")):
        path = os.path.join(root, name)
        if os.path.isfile(path) and not name.startswith(DATA_FOLDERS):
            size = os.path.getsize(path)
            if size > MAX_BYTES:
                out.append((name, size))
    return out


def main() -> int:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    bad = oversized(root)
    for name, size in bad:
        print(f"{name}: {size / 1e6:.1f} MB tracked; files over {MAX_BYTES / 1e6:.0f} MB belong in a shipped data "
              f"folder ({', '.join(DATA_FOLDERS)}; new ones join DATA_FOLDERS in .ci/check_sizes.py)", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
