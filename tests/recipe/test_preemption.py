"""Preemption (lomo_ds/runtime/preemption.py): a signal at a random moment stops every rank at the next
optimizer-step boundary with a checkpoint; resuming gives the uninterrupted run's weights exactly.
A second signal during the checkpoint's write leaves the previous checkpoint whole and `latest`;
a repeat within the window (a launcher's copy of the job's signal) is no second signal; the second
signal ends a rank whose main thread is blocked in C. tests/recipe/test_launcher_preemption.py runs
the real launchers.

The matrix runs the training program in the 2- and 3-rank launches of the multi-rank checks
(tests/ranks.py run_here), the signal sent by a timer thread to this very process; the
second-signal check is a launch of its own (the process it stops is the launch's), a long check
(LOMO_DS_LONG_TESTS=1, as CI runs it).
"""
import contextlib
import json
import os
import pathlib
import random
import signal
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from devkit.launch_local import local_ranks
from lomo_ds.runtime.preemption import PREEMPTED_EXIT, REPEAT_WINDOW_S, UNSAVED_EXIT, Preemption, read_marker
from tests.ranks import LONG_TESTS, ROOT, multi_rank, ok, run_here, work_dir
from tests.recipe.test_train import TRAIN_SCRIPT, logged_steps, run_train, train_args, write_tiny_run

STEPS = 6
# (optimizer, accumulation): SGD and AdaLomo, K = 1 and K = 2, each on 2 and on 3 ranks where the long
# checks run (CI); a newcomer's suite takes the two corners that differ in both, on 2 ranks.
MATRIX = ([("sgd", 1), ("sgd", 2), ("adalomo", 1), ("adalomo", 2)] if LONG_TESTS
          else [("sgd", 1), ("adalomo", 2)])



def _args(root, out, optimizer, k):
    return ["--config", str(root / "run.json"), "--output-dir", str(out), "--max-steps", str(STEPS),
            "--accumulation-steps", str(k), "--set", f"lomo.optimizer={optimizer}",
            "--set", "output.checkpoint_every=100", "--set", "eval.at_end=false"]


def random_moment(key: str, straight, world: int) -> dict:
    """A moment drawn at random (seeded by `key`) in a run like the finished one in `straight`: a
    step, a point within it (a fraction of that run's typical step), a rank. Never in the run's last
    step (a run with K = 2 ends its epoch before --max-steps): the stop must come before its end."""
    seconds = _step_seconds(straight)
    rng = random.Random(key)
    step, who = rng.randrange(len(seconds) - 1), rng.randrange(world)
    delay = rng.uniform(0.0, 1.0) * sorted(seconds)[len(seconds) // 2]
    return {"step": step, "delay": delay, "rank": who, "steps": len(seconds)}


@contextlib.contextmanager
def signal_during_training(moment: dict):
    """SIGTERM to this process `delay` seconds after step `step` (0-based) starts, on rank `rank`
    alone (random_moment's): the others learn of it at the next step boundary, through the ranks'
    agreement. By the end of the second-last step at the latest (before that boundary's agreement):
    steps quicker than the straight run's (whose step time set `delay`) must not carry the signal
    into the run's final step, after which nothing stops it."""
    from lomo_ds.recipe.train import TrainRecipe

    step, delay, only_rank, last = moment["step"], moment["delay"], moment["rank"], moment["steps"] - 2

    sent = threading.Lock()

    def send():  # once, from the timer or at the end of step `last`, whichever comes first
        if sent.acquire(blocking=False):
            os.kill(os.getpid(), signal.SIGTERM)

    timer = threading.Timer(delay, send)
    train_step = TrainRecipe.train_step

    def the_clock_runs_from_the_step(recipe, at):
        signalled = torch.distributed.get_rank() == only_rank
        if signalled and at == step:
            timer.start()
        record = train_step(recipe, at)
        if signalled and at == last:
            timer.cancel()
            if timer.is_alive():
                timer.join()  # a signal the timer is sending now lands before the agreement
            send()
        return record

    TrainRecipe.train_step = the_clock_runs_from_the_step
    try:
        yield
    finally:
        TrainRecipe.train_step = train_step
        timer.cancel()


def _step_seconds(out_dir) -> list[float]:
    return [row["step_seconds"] for row in map(json.loads, open(out_dir / "metrics.jsonl")) if "step_seconds" in row]


def preempt_matrix() -> dict:
    from lomo_ds.recipe.train import main

    world = torch.distributed.get_world_size()
    base = pathlib.Path(work_dir()) / f"preempt_{world}"
    if torch.distributed.get_rank() == 0:
        write_tiny_run(base)
    torch.distributed.barrier()
    out = {}
    for optimizer, k in MATRIX:
        name = f"{optimizer}_k{k}"
        straight = run_here(main, _args(base, base / f"{name}_straight", optimizer, k))
        moment = random_moment(f"{world}-{name}", base / f"{name}_straight", world)
        with signal_during_training(moment):
            stopped = run_here(main, _args(base, base / f"{name}_stopped", optimizer, k))
        marker = read_marker(str(base / f"{name}_stopped"))  # what a batch script reads to requeue
        resumed = run_here(main, [*_args(base, base / f"{name}_stopped", optimizer, k), "--resume"])
        out[name] = {"straight": straight["rc"], "stopped": stopped["rc"], "resumed": resumed["rc"],
                     "marker": marker, "marker_after_resume": read_marker(str(base / f"{name}_stopped")),
                     **moment, "dir": str(base),
                     "resumed_stdout": resumed["stdout"][-2000:]}
    return out


# On 2 ranks in every suite; on 3 ranks, and the whole matrix, where the long checks run (CI).
preempt_matrix = multi_rank(worlds=[2, 3] if LONG_TESTS else [2])(preempt_matrix)


def _export(path) -> dict:
    return load_file(path / "hf_model" / "model.safetensors")


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.long)])
def test_a_signal_at_a_random_moment_then_resume_gives_the_uninterrupted_weights(rank_results, world):
    r = ok(rank_results(world), preempt_matrix)
    for name, run in r.items():
        base = pathlib.Path(run["dir"])
        assert run["straight"] == 0 and run["resumed"] == 0, run
        assert run["stopped"] == PREEMPTED_EXIT, run  # stopped with a checkpoint, not finished
        rows = [json.loads(line) for line in open(base / f"{name}_stopped" / "metrics.jsonl")]
        (stop,) = [row for row in rows if row.get("phase") == "preempted"]
        print(f"{world} ranks, {name}: SIGTERM to rank {run['rank']} {run['delay']:.3f} s into step "
              f"{run['step'] + 1}; stopped after step {stop['step']} of {run['steps']}")
        assert 1 <= stop["step"] < run["steps"] and stop["checkpoint"].endswith(f"step_{stop['step']:08d}")
        assert run["marker"] == {"exit": PREEMPTED_EXIT, "step": stop["step"], "checkpoint": stop["checkpoint"]}, run
        assert run["marker_after_resume"] is None  # the resumed run finished: nothing to requeue
        assert f"at step {stop['step']}" in run["resumed_stdout"]
        a, b = _export(base / f"{name}_straight"), _export(base / f"{name}_stopped")
        assert a.keys() == b.keys()
        diffs = {k: (a[k] - b[k]).abs().max().item() for k in a}
        assert max(diffs.values()) == 0.0, (name, diffs)


def _wait_for(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)
    return cond()


def test_a_second_signal_or_the_deadline_stops_at_once():
    """The handler alone: the first signal only asks; a second, or the deadline after the first,
    ends the process (here: records the exit it would make)."""
    exits = []
    p = Preemption(["SIGUSR1"], None, say=lambda m: None, exit_now=exits.append, repeat_window_s=0)
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert _wait_for(lambda: p.requested_at is not None) and exits == []
        assert p.agreed()  # one process: its own flag
        os.kill(os.getpid(), signal.SIGUSR1)
        assert _wait_for(lambda: exits == [UNSAVED_EXIT]), exits
    finally:
        p.restore()
    p = Preemption(["SIGUSR2"], 0.2, say=lambda m: None, exit_now=exits.append)
    try:
        assert not p.agreed()
        os.kill(os.getpid(), signal.SIGUSR2)
        assert _wait_for(lambda: len(exits) == 2), exits
        assert exits == [UNSAVED_EXIT, UNSAVED_EXIT]
    finally:
        p.restore()
    assert signal.getsignal(signal.SIGUSR2) is signal.SIG_DFL  # put back


def test_a_launchers_forward_is_the_same_request_and_after_the_checkpoint_a_signal_exits_75(tmp_path):
    """A repeat within the window (the job's signal again, through the launcher) changes nothing;
    after the stop's checkpoint is whole (stopped) a signal exits 75 with the marker written, and so
    does one landing after restore(), where the action was the default one (to end the process)."""
    exits = []
    p = Preemption(["SIGUSR1"], None, say=lambda m: None, exit_now=exits.append, repeat_window_s=60,
                   marker_dir=str(tmp_path))
    try:
        for _ in range(3):
            os.kill(os.getpid(), signal.SIGUSR1)
        assert _wait_for(lambda: p.requested_at is not None)
        time.sleep(0.3)
        assert exits == []  # not the second signal: no 76
        assert read_marker(str(tmp_path)) is None
        p.stopped(4, "ckpt/step_00000004")
        assert read_marker(str(tmp_path)) == {"exit": PREEMPTED_EXIT, "step": 4, "checkpoint": "ckpt/step_00000004"}
        os.kill(os.getpid(), signal.SIGUSR1)
        assert _wait_for(lambda: exits == [PREEMPTED_EXIT]), exits
    finally:
        p.restore()
    assert signal.getsignal(signal.SIGUSR1) is not signal.SIG_DFL  # a late forward: 75, not death by signal
    signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    # A new run removes the marker of the one before.
    Preemption([], None, marker_dir=str(tmp_path)).restore()
    assert read_marker(str(tmp_path)) is None


_BLOCKED_IN_C = """
import ctypes, importlib.util, sys
spec = importlib.util.spec_from_file_location("preemption", "lomo_ds/runtime/preemption.py")
preemption = importlib.util.module_from_spec(spec)  # the module alone: no package import, no torch
spec.loader.exec_module(preemption)
preemption.Preemption(["SIGTERM"], None, repeat_window_s=0.5)
print("ready", flush=True)
ctypes.CDLL(None).system(b"sleep 60")  # the main thread in C, retrying on EINTR (as a collective does)
sys.exit(3)
"""


def test_the_second_signal_ends_a_process_whose_main_thread_is_blocked_in_c():
    """A rank waiting in a collective on a dead peer runs no Python signal handler until the call
    returns: the second signal must end it anyway, with 76, not leave it to the launcher's SIGKILL."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", _BLOCKED_IN_C], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "RANK": "1"}, start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.5)  # inside system()
        proc.send_signal(signal.SIGTERM)
        time.sleep(1.0)  # past the repeat window
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == UNSAVED_EXIT
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_cleanup_keeps_the_handlers_until_its_last_wait_and_a_setup_error_releases_them(monkeypatch):
    """cleanup() puts the signals back only after its last barrier (a launcher's forward landing in
    that barrier is the same request, not death by SIGTERM: 143); a setup error puts them back before
    stop_every_rank's wait, which a launcher's SIGTERM must end."""
    from lomo_ds.recipe import train
    from lomo_ds.recipe.train import TrainRecipe

    recipe = TrainRecipe(None)
    seen = []
    recipe.preemption = Preemption(["SIGTERM"], None, say=lambda m: None)
    recipe.metrics = type("Metrics", (), {"close": lambda self: None})()
    recipe.barrier = lambda: seen.append(signal.getsignal(signal.SIGTERM))
    recipe.cleanup()
    assert seen and seen[0] not in (signal.SIG_DFL, None), seen
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL

    def setup_fails(self):
        self.preemption = Preemption(["SIGTERM"], None, say=lambda m: None)
        raise train.DataError("data.path: no such file")

    slept = []
    monkeypatch.setattr(TrainRecipe, "setup", setup_fails)
    monkeypatch.setattr(train.time, "sleep", lambda s: slept.append(signal.getsignal(signal.SIGTERM)))
    monkeypatch.setattr(train, "load_run_config", lambda *a: type("Cfg", (), {})())
    monkeypatch.setattr(train, "check_model_on_disk", lambda cfg: None)
    monkeypatch.setattr(train, "check_runtime", lambda cfg: None)
    monkeypatch.setattr(train, "show_what_matters", lambda rank: None)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert train.main(["--config", "unused.json"]) == 2
    assert slept == [signal.SIG_DFL], slept


def test_a_checkpoint_is_latest_as_soon_as_it_is_whole(tmp_path):
    """A process killed after the checkpoint's rename and before the pointer's leaves `latest` one
    behind: the newer whole checkpoint is the one to resume from."""
    from lomo_ds.storage.checkpoint import latest_checkpoint

    root = tmp_path / "checkpoints"
    for step in (2, 4):
        (root / f"step_{step:08d}").mkdir(parents=True)
        (root / f"step_{step:08d}" / "meta.json").write_text("{}")
    (root / ".step_00000006.partial").mkdir()  # not whole: never taken
    (root / "latest").write_text("step_00000002")
    assert latest_checkpoint(str(tmp_path)) == str(root / "step_00000004")
    (root / "latest").write_text("step_00000004")
    assert latest_checkpoint(str(tmp_path)) == str(root / "step_00000004")


# Rank 0's checkpoint seal (meta.json) takes this long: the second signal, sent once the repeat
# window after the first has passed (before it, a repeat is a launcher's copy), lands inside it.
SLOW_SEAL_S = REPEAT_WINDOW_S + 10


@pytest.mark.ranks
@pytest.mark.long
def test_a_second_signal_during_the_checkpoint_write_keeps_the_previous_one(tmp_path):
    import psutil

    config = write_tiny_run(tmp_path)
    out = tmp_path / "run"
    slow = ["-m", "tests.slow_io_run", str(SLOW_SEAL_S), "600"]
    args = train_args(slow, config, out, "--max-steps", "8", "--set", "output.checkpoint_every=2",
                      "--set", "eval.at_end=false")
    with open(tmp_path / "launch.log", "w") as log, local_ranks(args, 2, cwd=ROOT, stdout=log, stderr=log) as proc:
        deadline = time.monotonic() + 600
        while 3 not in logged_steps(out):  # step 2's checkpoint is sealed before step 3 starts
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended before the signal"
            time.sleep(0.01)
        ranks = [p for p in psutil.Process(proc.pid).children(recursive=True) if p.environ().get("RANK")]
        for p in ranks:
            p.send_signal(signal.SIGTERM)
        first = time.monotonic()
        # The stop's checkpoint (step 4: the next boundary) is being written: its staging folder is there.
        ckpts = out / "checkpoints"
        while not any(n.endswith(".partial") for n in os.listdir(ckpts)):
            assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint write to interrupt"
            time.sleep(0.01)
        time.sleep(max(0.0, first + REPEAT_WINDOW_S + 1 - time.monotonic()))
        assert any(n.endswith(".partial") for n in os.listdir(ckpts)), "the write ended before the second signal"
        for p in ranks:
            p.send_signal(signal.SIGTERM)
        proc.wait(timeout=300)
    assert read_marker(str(out)) == {"exit": UNSAVED_EXIT, "step": None, "checkpoint": None}
    log = (tmp_path / "launch.log").read_text()
    assert f"exitcode  : {UNSAVED_EXIT}" in log or f"exit code {UNSAVED_EXIT}" in log, log[-3000:]
    assert (ckpts / "latest").read_text() == "step_00000002"
    assert not (ckpts / "step_00000004").exists()
    resumed = run_train(TRAIN_SCRIPT, config, out, "--max-steps", "8", "--set", "eval.at_end=false", "--resume")
    assert "at step 2" in resumed.stdout
