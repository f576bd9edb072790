"""Weight sharing between a trainer (producer) and generation backends (consumers).

Trainer, streamed through a few reusable buckets as one transaction (the usual way)::

    refitter = Refitter(generator)                      # keeps its buckets between refits
    version = refitter.refit(model.state_dict())        # after every training step

Trainer whose host weights live in shared memory: refits send handles to them, no copy::

    with share_parameters(model):                       # once; parameters now in /dev/shm
        refitter.refit(model.state_dict())              # after every training step

Trainer, one shot (all buckets at once; one complete transaction)::

    with share_weights(model.state_dict()) as shared:
        generator.update_weights_from_ipc_handles(shared.handles)

Consumer (inside a backend): ``WeightUpdates`` runs the transaction;
``read_shared_weights`` maps and verifies the buckets of one load.
"""

from gen_interface.weights.checksum import bytes_checksum, combine_checksums, weights_checksum
from gen_interface.weights.collective import (
    BroadcastBucket,
    CollectiveEndpoint,
    WeightBroadcaster,
    join_weight_group,
    receive_broadcast,
)
from gen_interface.weights.consumer import (
    TensorSpecs,
    check_update_is_complete,
    check_weights_match,
    handles_checksum,
    handles_for_device,
    iter_shared_weights,
    merge_weight_handles,
    read_shared_weights,
    release_shared_weights,
    state_dict_specs,
)
from gen_interface.weights.handles import (
    TensorSlot,
    WeightBucket,
    WeightHandles,
    describe_weight_handles,
    handles_from_json,
    handles_to_json,
)
from gen_interface.weights.in_place import SharedParameters, share_parameters, share_tensors
from gen_interface.weights.producer import DEFAULT_BUCKET_BYTES, SharedWeights, share_weights
from gen_interface.weights.stream import DEFAULT_STREAM_BUCKET_BYTES, BucketRing, Refitter, refit
from gen_interface.weights.transaction import WeightTransaction
from gen_interface.weights.updates import WeightUpdates, WeightUpdateSteps

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "DEFAULT_STREAM_BUCKET_BYTES",
    "BroadcastBucket",
    "BucketRing",
    "CollectiveEndpoint",
    "Refitter",
    "SharedParameters",
    "SharedWeights",
    "TensorSlot",
    "TensorSpecs",
    "WeightBroadcaster",
    "WeightBucket",
    "WeightHandles",
    "WeightTransaction",
    "WeightUpdateSteps",
    "WeightUpdates",
    "bytes_checksum",
    "check_update_is_complete",
    "check_weights_match",
    "combine_checksums",
    "describe_weight_handles",
    "handles_checksum",
    "handles_for_device",
    "handles_from_json",
    "handles_to_json",
    "iter_shared_weights",
    "join_weight_group",
    "merge_weight_handles",
    "read_shared_weights",
    "receive_broadcast",
    "refit",
    "release_shared_weights",
    "share_parameters",
    "share_tensors",
    "share_weights",
    "state_dict_specs",
    "weights_checksum",
]
