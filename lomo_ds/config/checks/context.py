"""What a feature's check may know besides the validated config."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Loading:
    written: frozenset[str]  # the top-level keys the config wrote (overrides applied), null sections included
    check_files: bool  # whether local paths must exist now
