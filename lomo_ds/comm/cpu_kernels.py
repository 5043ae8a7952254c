"""Fused passes over fp32 gradients for CPU ranks (cpu_kernels.c), built on first use.

On a CPU, what LOMO adds to a step is passes over the gradient's bytes (pack the payload, sum it
for the non-finite flag, sum the ranks' rows, check the sum, step the weights), and each pass is
bound by memory bandwidth, not arithmetic. torch has no op that copies and sums, adds and sums,
or adds and steps, in one read, so these few loops are C: the shared-memory transport packs its
payload and sums it for the flag in one pass, reduces the ranks' rows and checks them in one, and
plain LOMO's SGD pass steps each shard as it sums the rows (fused_update.ShardUpdater.apply_rows).

Built like DeepSpeed's CPU ops, by the host's C compiler at first use (`cc -O3 -march=native`,
well under a second), into a cache keyed by the source and this CPU, and loaded with ctypes (no
torch headers, no build step at install). Where there is no compiler, or `LOMO_DS_CPU_KERNELS=0`,
`load()` returns None and the callers run the same passes as torch ops: the same results (but for
the fused SGD step's last-bit rounding: it computes `w * decay + alpha * g` as C does, torch's
`add_` as torch does), more time.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.c")
ENV = "LOMO_DS_CPU_KERNELS"  # "0": never build or use them; "1" (the default): where they build
FLAGS = ["-O3", "-march=native", "-shared", "-fPIC", "-std=c11"]

_lib: "Kernels | None | bool" = False  # False: not tried yet in this process


def enabled() -> bool:
    value = os.environ.get(ENV, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{ENV}: expected 0 (torch ops only) or 1 (build the fused CPU kernels), got {value!r}")
    return value == "1"


def _cpu_id() -> str:
    """What -march=native compiles for: the CPU's model and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    return "\n".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags"))}))


def cache_dirs() -> list[Path]:
    """Where the built library is kept: the user's cache, else (a home that cannot be written) a
    folder of this user's in the temporary directory."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    user = os.getuid() if hasattr(os, "getuid") else "user"
    return [Path(root) / "lomo_ds" / "kernels", Path(tempfile.gettempdir()) / f"lomo_ds_kernels_{user}"]


def _writable(folder: Path) -> bool:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(folder, os.W_OK)


def _build() -> Path:
    """The shared library for this source and CPU: from the cache, else compiled into it
    (written under a temporary name and renamed, so ranks building at once never see half a file)."""
    compiler = shlex.split(os.environ.get("CC", "")) or [shutil.which("cc") or shutil.which("gcc")]
    if compiler[0] is None:
        raise RuntimeError("no C compiler (cc, gcc, or $CC) on PATH")
    key = hashlib.sha256(SOURCE.read_bytes() + _cpu_id().encode() + " ".join(FLAGS).encode()).hexdigest()[:16]
    name = f"cpu_kernels_{key}.so"
    for folder in cache_dirs():
        if (folder / name).exists():
            return folder / name
    folder = next((f for f in cache_dirs() if _writable(f)), None)
    if folder is None:
        raise RuntimeError(f"no writable folder to build into (tried {', '.join(map(str, cache_dirs()))})")
    target = folder / name
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=".so")
    os.close(fd)
    try:
        done = subprocess.run([*compiler, *FLAGS, "-o", tmp, str(SOURCE)], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(compiler)} failed on {SOURCE.name}: {done.stderr.strip()[-500:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return target


class Kernels:
    """The loaded library: each call takes contiguous fp32 CPU tensors (the caller's promise:
    checked by `usable`); the passes that write a sum return it, the SGD step a count."""

    def __init__(self, path: Path):
        lib = ctypes.CDLL(str(path))
        f32p, i64 = ctypes.c_void_p, ctypes.c_int64
        f32, i32 = ctypes.c_float, ctypes.c_int32
        for name, args, result in (("lomo_copy_abs_sum_f32", [f32p, f32p, i64], f32),
                                   ("lomo_add2_sum_f32", [f32p, f32p, f32p, i64], f32),
                                   ("lomo_sgd_rows_f32", [f32p, f32p, i32, i64, f32, f32, f32, f32], i64)):
            getattr(lib, name).argtypes = args
            getattr(lib, name).restype = result
        self._copy_abs_sum, self._add2_sum = lib.lomo_copy_abs_sum_f32, lib.lomo_add2_sum_f32
        self._sgd_rows = lib.lomo_sgd_rows_f32
        self.path = path

    @staticmethod
    def usable(*tensors: torch.Tensor) -> bool:
        return all(t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous() for t in tensors)

    def copy_abs_sum(self, dst: torch.Tensor, src: torch.Tensor) -> float:
        """dst.copy_(src) and src.abs().sum(), in one read of src: not finite where some element
        is not, and at least the largest |element|."""
        if dst.numel() != src.numel():
            raise ValueError(f"copy_abs_sum: {dst.numel()} elements to receive {src.numel()}")
        return self._copy_abs_sum(dst.data_ptr(), src.data_ptr(), src.numel())

    def sum_rows(self, out: torch.Tensor, rows: list[torch.Tensor]) -> float:
        """out = rows[0] + rows[1] + ... (in that order, as torch's adds), and out.sum()."""
        n = out.numel()
        if not rows or any(r.numel() != n for r in rows):
            raise ValueError(f"sum_rows: expected rows of {n} elements, got {[r.numel() for r in rows]}")
        if len(rows) == 1:
            out.copy_(rows[0])
            return float(out.sum(dtype=torch.float32))
        total = self._add2_sum(out.data_ptr(), rows[0].data_ptr(), rows[1].data_ptr(), n)
        for row in rows[2:]:
            total = self._add2_sum(out.data_ptr(), out.data_ptr(), row.data_ptr(), n)
        return total

    def sgd_rows(self, weights: torch.Tensor, rows: list[torch.Tensor], lr: float, scale: float,
                 clip_value: float | None, weight_decay: float) -> int:
        """The SGD step of `weights` by the sum of `rows` (never stored): g = sum(rows) * scale,
        value-clipped when `clip_value`; weights = weights * (1 - lr * weight_decay) - lr * g.
        Elements whose sum is not finite are left unchanged; returns how many there were."""
        n = weights.numel()
        if not rows or any(r.numel() != n for r in rows):
            raise ValueError(f"sgd_rows: expected rows of {n} elements, got {[r.numel() for r in rows]}")
        if clip_value is not None and not clip_value > 0:
            raise ValueError(f"sgd_rows: clip_value must be > 0, got {clip_value}")
        ptrs = (ctypes.c_void_p * len(rows))(*[r.data_ptr() for r in rows])
        # Without a value clip the scale folds into the step's multiplier, as the torch update does.
        alpha = -lr if clip_value is not None else -lr * scale
        return self._sgd_rows(weights.data_ptr(), ptrs, len(rows), n, scale, clip_value or 0.0, alpha,
                              1.0 - lr * weight_decay)


def load() -> Kernels | None:
    """The kernels, built once per process; None where LOMO_DS_CPU_KERNELS=0 (read at each call:
    an engine made after it is set runs torch ops) or where they cannot be built (one warning
    saying why)."""
    global _lib
    if not enabled():
        return None
    if _lib is False:
        try:
            _lib = Kernels(_build())
        except (OSError, RuntimeError) as err:
            _lib = None
            log.warning("lomo_ds: fused CPU kernels unavailable (%s): the shared-memory transport runs torch ops, "
                        "slower; set %s=0 to skip building them", err, ENV)
    return _lib
