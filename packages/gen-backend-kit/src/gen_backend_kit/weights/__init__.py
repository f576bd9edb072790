"""The receiving side of weight sharing: what a backend does with the trainer's weights.

``WeightUpdates`` runs a backend's update transaction (start, loads, commit or abort) with its
checks; ``CommittedWeights`` is the readable copy of the last committed weights (the base deltas
apply to, and what a replica without weights is loaded from); ``read_shared_weights`` /
``iter_shared_weights`` / ``write_shared_weights`` map and verify the buckets of one load;
``receive_broadcast`` takes one bucket of the collective path.
The trainer's side and the handle format live in ``gen_interface.weights``.
"""

from gen_backend_kit.weights.committed import CommittedWeights
from gen_backend_kit.weights.consumer import (
    TensorSpecs,
    check_update_is_complete,
    check_weights_match,
    delta_bases,
    handles_checksum,
    handles_for_device,
    iter_shared_weights,
    map_bucket,
    merge_weight_handles,
    read_shared_weights,
    release_shared_weights,
    state_dict_specs,
    write_shared_weights,
)
from gen_backend_kit.weights.loads_in_flight import LoadsInFlight
from gen_backend_kit.weights.receive import receive_broadcast, receive_broadcast_entries
from gen_backend_kit.weights.transaction import WeightTransaction, next_version
from gen_backend_kit.weights.updates import LoadWait, WeightUpdates, WeightUpdateSteps

__all__ = [
    "CommittedWeights",
    "LoadWait",
    "LoadsInFlight",
    "TensorSpecs",
    "WeightTransaction",
    "WeightUpdateSteps",
    "WeightUpdates",
    "check_update_is_complete",
    "check_weights_match",
    "delta_bases",
    "handles_checksum",
    "handles_for_device",
    "iter_shared_weights",
    "map_bucket",
    "merge_weight_handles",
    "next_version",
    "read_shared_weights",
    "receive_broadcast",
    "receive_broadcast_entries",
    "release_shared_weights",
    "state_dict_specs",
    "write_shared_weights",
]
