"""The receiving side of weight sharing: what a backend does with the trainer's weights.

``WeightUpdates`` runs a backend's update transaction (start, loads, commit or abort) with its
checks; ``read_shared_weights`` / ``iter_shared_weights`` / ``write_shared_weights`` map and
verify the buckets of one load; ``receive_broadcast`` takes one bucket of the collective path.
The trainer's side and the handle format live in ``gen_interface.weights``.
"""

from gen_backend_kit.weights.consumer import (
    TensorSpecs,
    check_update_is_complete,
    check_weights_match,
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
from gen_backend_kit.weights.receive import receive_broadcast
from gen_backend_kit.weights.transaction import WeightTransaction, next_version
from gen_backend_kit.weights.updates import LoadWait, WeightUpdates, WeightUpdateSteps

__all__ = [
    "LoadWait",
    "LoadsInFlight",
    "TensorSpecs",
    "WeightTransaction",
    "WeightUpdateSteps",
    "WeightUpdates",
    "check_update_is_complete",
    "check_weights_match",
    "handles_checksum",
    "handles_for_device",
    "iter_shared_weights",
    "map_bucket",
    "merge_weight_handles",
    "next_version",
    "read_shared_weights",
    "receive_broadcast",
    "release_shared_weights",
    "state_dict_specs",
    "write_shared_weights",
]
