"""Jacobi Forcing data pipeline: trajectories, noise schedules, packing, masks, shards, datasets.

Modules (one concept each):

* :mod:`~megatron_jf.data.trajectory` -- the trajectory record schema shared with the collector.
* :mod:`~megatron_jf.data.schedule` -- noise schedules (paper Eq. 7) and noisy-state selection.
* :mod:`~megatron_jf.data.packing` -- ``[prompt, noisy B1, clean B1, ...]`` packing and the two-stream form.
* :mod:`~megatron_jf.data.masks` -- ``nc`` / ``nc_ic`` / ``clean`` attention masks (dense and FlexAttention).
* :mod:`~megatron_jf.data.shards` -- WebDataset shards, manifests.
* :mod:`~megatron_jf.data.filters` -- the repetition filter for collected responses.
* :mod:`~megatron_jf.data.dataset` -- the training dataset and collators.
"""

from .dataset import TrajectoryDataset, collate_packed, collate_two_stream
from .filters import degeneracy_reason, is_degenerate
from .masks import MASK_KINDS, block_mask, dense_mask, dense_mask_from_layout, make_mask_mod
from .packing import (
    IGNORE_INDEX,
    ROLE_CLEAN,
    ROLE_NOISY,
    ROLE_PAD,
    ROLE_PROMPT,
    PackedSample,
    TwoStreamSample,
    check_packed,
    from_two_stream,
    pack_record,
    packed_equal,
    to_two_stream,
)
from .schedule import SCHEDULES, noise_targets, select_state, unconverged_fraction, unconverged_fractions
from .shards import TrajectoryShardWriter, iter_shard, read_manifest, read_shard, write_manifest
from .trajectory import BlockTrajectory, TrajectoryRecord

__all__ = [
    "BlockTrajectory",
    "TrajectoryRecord",
    "SCHEDULES",
    "noise_targets",
    "unconverged_fraction",
    "unconverged_fractions",
    "select_state",
    "ROLE_PROMPT",
    "ROLE_NOISY",
    "ROLE_CLEAN",
    "ROLE_PAD",
    "IGNORE_INDEX",
    "PackedSample",
    "TwoStreamSample",
    "pack_record",
    "to_two_stream",
    "from_two_stream",
    "check_packed",
    "packed_equal",
    "MASK_KINDS",
    "make_mask_mod",
    "dense_mask",
    "dense_mask_from_layout",
    "block_mask",
    "TrajectoryShardWriter",
    "read_shard",
    "iter_shard",
    "write_manifest",
    "read_manifest",
    "is_degenerate",
    "degeneracy_reason",
    "TrajectoryDataset",
    "collate_packed",
    "collate_two_stream",
]
