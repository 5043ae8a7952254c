"""The repository's own guards, which `make lint` runs: no big file outside the shipped data folders
(.ci/check_sizes.py), and no module of lomo_ds over 600 lines nor function over 80 (.ci/check_code_size.py)."""
import os
import runpy
import subprocess
import sys

from tests.ranks import ROOT

GUARD = runpy.run_path(os.path.join(ROOT, ".ci", "check_sizes.py"))
CODE_SIZE = runpy.run_path(os.path.join(ROOT, ".ci", "check_code_size.py"))


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


def _function(name: str, lines: int, indent: str = "") -> list[str]:
    """A function of exactly `lines` lines, from its def to its last line."""
    return [f"{indent}def {name}():"] + [f"{indent}    x = {i}" for i in range(lines - 1)]


def test_code_size_guard_names_each_long_module_and_function(tmp_path):
    limit_f, limit_m = CODE_SIZE["MAX_FUNCTION_LINES"], CODE_SIZE["MAX_FILE_LINES"]
    pkg = tmp_path / "lomo_ds" / "engine"
    pkg.mkdir(parents=True)
    # at the limits: allowed (a function of exactly 80 lines, a module of exactly 600)
    at_limit = _function("fits", limit_f)
    (pkg / "ok.py").write_text("\n".join(at_limit + ["# pad"] * (limit_m - len(at_limit))) + "\n")
    # one over: a method, a function nested in it, and a module
    method = _function("step", limit_f + 1, "    ")
    nested = ["def outer():"] + _function("inner", limit_f + 1, "    ") + ["    return inner"]
    source = ["class Engine:"] + method + nested
    (pkg / "big.py").write_text("\n".join(source + ["# pad"] * (limit_m + 1 - len(source))) + "\n")
    (pkg / "__pycache__").mkdir()
    (pkg / "__pycache__" / "big.py").write_text("x = 1\n" * (limit_m + 1))  # a cache: not the package's
    problems = CODE_SIZE["oversized"](["lomo_ds"], str(tmp_path))
    big = os.path.join("lomo_ds", "engine", "big.py")
    assert problems == [f"{big}: {limit_m + 1} lines (a module's limit is {limit_m})",
                        f"{big}:2: Engine.step is {limit_f + 1} lines (a function's limit is {limit_f})",
                        f"{big}:{limit_f + 3}: outer is {limit_f + 3} lines (a function's limit is {limit_f})",
                        f"{big}:{limit_f + 4}: outer.inner is {limit_f + 1} lines (a function's limit is {limit_f})"]
    assert CODE_SIZE["main"]([str(tmp_path / "lomo_ds")]) == 1  # make lint's exit status
    (pkg / "big.py").unlink()
    assert CODE_SIZE["main"]([str(tmp_path / "lomo_ds")]) == 0


def test_this_tree_passes_the_code_size_guard():
    assert CODE_SIZE["oversized"](["lomo_ds"], ROOT) == []
    # the script as `make lint` runs it
    proc = subprocess.run([sys.executable, os.path.join(ROOT, ".ci", "check_code_size.py")], capture_output=True,
                          text=True)
    assert (proc.returncode, proc.stderr) == (0, "")
