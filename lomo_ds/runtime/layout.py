"""The parallel layout of a run: how the ranks divide into data-parallel replicas and sequence-parallel
(SP) groups, and what that division requires of a model and of a batch.

One layout is built per process and SP size, from the config's train.sequence_parallel_size and the
world, the first time any layer asks (`ParallelLayout.build`, collective then); the recipe, the
engine, its sequence-parallel loss and the Trainer integration all take that same object and none
of them derives these facts again:

- sizes and ranks: the world, this rank, its SP group and place in it, the data-parallel replicas
  (world / sp) and this rank's replica;
- the model: attention heads and key/value heads Ulysses can split over the SP ranks, an attention
  implementation it can wrap here (checked once per model config; `check_model`), and the routing
  of that model's attention through Ulysses (`route_attention`, lomo_ds/runtime/sequence_parallel.py);
- the batch: rows right-padded to a multiple of the SP size (`pad_rows`), and this rank's slice of
  positions (`sp.local_part`, which the engine's sequence-parallel loss takes).

Ranks are cut into SP groups of consecutive ranks (0..sp-1, sp..2sp-1, ...; DeepSpeed's layout):
the ranks of one group hold slices of the same sequences, and the groups are the data-parallel
replicas. ZeRO-3 keeps sharding every parameter over the whole world, and the gradient is
reduce-scattered over the whole world too: each SP rank's gradient is that of its own slice of
positions, so the world's sum is the sum over replicas of whole sequences' gradients, exactly what
the update needs (nothing is reduced twice). The group every parameter is sharded over and every
step statistic is reduced over is therefore the whole world (`group`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from lomo_ds.data.sequence_split import pad_to_multiple, split_batch
from lomo_ds.runtime import sequence_parallel as seqpar

_BUILT: dict[tuple[int, int, int], ParallelLayout] = {}  # (sp size, world, rank) -> this process's layout


@dataclass(frozen=True)
class SequenceParallel:
    """This rank's place among the ranks that share sequences, and among the replicas."""
    size: int  # ranks per sequence
    group: Any  # this rank's SP group (None when size is 1)
    rank: int  # this rank's place in it
    dp_size: int  # data-parallel replicas: world / size
    dp_rank: int

    def pad_rows(self, batch: dict[str, Any], pad_id: int) -> dict[str, Any]:
        """A whole batch as the SP ranks can split it: rows right-padded to a multiple of the SP
        size (pad ids, mask 0, labels -100: nothing learns from the padding)."""
        return batch if self.size == 1 else pad_to_multiple(batch, self.size, pad_id)

    def local_part(self, batch: dict[str, Any]) -> dict[str, Any]:
        """This rank's slice of a whole batch: input_ids, position_ids and shift_labels of its
        positions (data/sequence_split.py); refuses rows not a multiple of the SP size long."""
        return split_batch(batch, self.rank, self.size)


@dataclass(frozen=True, eq=False)
class ParallelLayout:
    world: int
    rank: int
    sp: SequenceParallel
    device_type: str  # where the ranks compute: which attention implementations Ulysses can wrap
    group: Any = None  # the group parameters are sharded and step statistics reduced over: the world
    _checked: set = field(default_factory=set, repr=False)  # model facts already checked

    @property
    def sp_size(self) -> int:
        return self.sp.size

    @property
    def dp_size(self) -> int:
        return self.sp.dp_size

    @property
    def dp_rank(self) -> int:
        return self.sp.dp_rank

    # ---------------------------------------------------------------- building
    @classmethod
    def plan(cls, sp_size: int, world: int, rank: int, device_type: str = "cpu", sp_group: Any = None,
             group: Any = None) -> ParallelLayout:
        """The layout of `world` ranks seen from `rank`, with no collective (the process groups are
        `build`'s); refuses an SP size that does not divide the world."""
        if sp_size < 1:
            raise ValueError(f"train.sequence_parallel_size: expected a positive number of ranks, got {sp_size}")
        if world % sp_size:
            raise ValueError(f"train.sequence_parallel_size {sp_size} does not divide the {world} ranks: the "
                             f"data-parallel groups would be uneven; use a divisor of {world}")
        sp = SequenceParallel(sp_size, sp_group if sp_size > 1 else None, rank % sp_size, world // sp_size,
                              rank // sp_size)
        return cls(world, rank, sp, device_type, group)

    @classmethod
    def build(cls, sp_size: int) -> ParallelLayout:
        """This process's layout for `sp_size` (started process group): built on the first call,
        collectively (every rank makes every SP group, in the same order), then the same object."""
        from lomo_ds.runtime.device import accelerator_device

        world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
        key = (sp_size, world, rank)
        if key not in _BUILT:
            plan = cls.plan(sp_size, world, rank)  # refuses an uneven world before any group is made
            mine = None
            if sp_size > 1:
                for first in range(0, world, sp_size):
                    ranks = list(range(first, first + sp_size))
                    made = torch.distributed.new_group(ranks)
                    if rank in ranks:
                        mine = made
            _BUILT[key] = cls.plan(plan.sp_size, world, rank, accelerator_device().type, mine,
                                   torch.distributed.group.WORLD)
        return _BUILT[key]

    # ---------------------------------------------------------------- the model
    def check_model(self, hf_config: Any) -> None:
        """Refuse, before any model is built or partitioned, a model Ulysses cannot split over the SP
        ranks (its heads, key/value heads and attention implementation). A model config is checked
        once: the recipe checks it from the model's files before loading, the engine the built model."""
        if self.sp_size == 1:
            return
        facts = seqpar.model_facts(hf_config, self.sp_size)
        if facts in self._checked:
            return
        seqpar.check_model_facts(*facts, self.sp_size, self.device_type)
        self._checked.add(facts)

    def route_attention(self, model: torch.nn.Module) -> None:
        """Route `model`'s attention (its alone) through Ulysses over this rank's SP group while it
        trains; its evaluation, and every other model of the process, attend as before."""
        if self.sp_size > 1:
            seqpar.route(model, self.sp.group)

    # ---------------------------------------------------------------- the batch
    def pad_rows(self, batch: dict[str, Any], pad_id: int) -> dict[str, Any]:
        return self.sp.pad_rows(batch, pad_id)
