"""The repository's own guards: the size guard of .ci/run (.ci/check_sizes.py)."""
import os
import runpy
import subprocess

from tests.ranks import ROOT

GUARD = runpy.run_path(os.path.join(ROOT, ".ci", "check_sizes.py"))


def git(cwd, *args):
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True)


def test_size_guard_flags_big_files_outside_the_data_folders(tmp_path):
    git(tmp_path, "init", "-q")
    big = b"x" * (GUARD["MAX_BYTES"] + 1)
    data_dir = tmp_path / GUARD["DATA_FOLDERS"][0]
    data_dir.mkdir(parents=True)
    (data_dir / "train.jsonl").write_bytes(big)  # shipped data: allowed
    (tmp_path / "small.txt").write_bytes(b"x" * GUARD["MAX_BYTES"])  # at the limit: allowed
    (tmp_path / "wheel.whl").write_bytes(big)
    (tmp_path / "untracked.bin").write_bytes(big)  # not tracked: not the guard's business
    git(tmp_path, "add", "-f", GUARD["DATA_FOLDERS"][0], "small.txt", "wheel.whl")
    assert GUARD["oversized"](str(tmp_path)) == [("wheel.whl", GUARD["MAX_BYTES"] + 1)]


def test_this_tree_passes_the_size_guard():
    assert GUARD["oversized"](ROOT) == []
