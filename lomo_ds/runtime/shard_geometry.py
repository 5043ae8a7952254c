"""Where a rank's piece of a parameter lies under ZeRO-3, and how an engine state names the tensors
that are such pieces: the facts both the update (engine/update) and the rank-count-free checkpoint
(storage/engine_state.py) build on, kept below both so that neither imports the other.

ZeRO-3 cuts a parameter of `numel` elements into pieces of `part = ceil(numel / world)`: rank r
holds flat elements [r*part, min((r+1)*part, numel)); the last ranks may carry padding, and a rank
may hold no real element at all when numel < world. Any state tensor cut the same way (a rule's
per-element state) is one piece of a global flat tensor of `numel` elements, cut on dimension 0.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

# The key of an engine state's declaration of its pieces: {path: numel}, where `path` is a tensor's
# path of keys inside the state (("shards", name), ("rule", "state", name, ...)) and `numel` the
# elements of the global flat tensor it is this rank's piece of. Every tensor of the state not
# declared there is the same on every rank (replicated). Built by the engine's updater from the
# shards it holds and its rule's declaration; read by the checkpoint, which knows no rule.
PIECES = "pieces"


@dataclass(frozen=True)
class ShardGeometry:
    numel: int
    world: int
    rank: int

    @property
    def part(self) -> int:
        return math.ceil(self.numel / self.world)

    @property
    def start(self) -> int:
        return self.rank * self.part

    @property
    def local(self) -> int:
        """Real (unpadded) elements of the parameter on this rank."""
        return max(0, min(self.part, self.numel - self.start))

def chunk_bounds(n: int, size: int, start: int = 0, align: int = 1) -> list[tuple[int, int]]:
    """[a, b) pieces of a slice of n elements starting at flat element `start` of its parameter,
    each at most `size` elements (at least `align`, rounded down to a multiple of it), their ends at
    multiples of that size in the parameter's flat index: with `align` a matrix's row length, every
    whole row of the slice falls in one chunk."""
    size = max(align, size // align * align)
    bounds, a = [], 0
    while a < n:
        b = min(n, ((start + a) // size + 1) * size - start)
        bounds.append((a, b))
        a = b
    return bounds
