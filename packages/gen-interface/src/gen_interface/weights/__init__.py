"""Weight sharing between a trainer (producer) and generation backends (consumers).

Producer::

    with share_weights(model.state_dict()) as shared:
        generator.update_weights_from_ipc_handles(shared.handles)

Consumer (inside a backend)::

    tensors = read_shared_weights(handles, expected=model_specs)   # checks, then maps
    ...load tensors...
    release_shared_weights(handles)                                # once every worker has read
"""

from gen_interface.weights.checksum import bytes_checksum, weights_checksum
from gen_interface.weights.consumer import (
    TensorSpecs,
    check_weights_match,
    handles_for_device,
    merge_weight_handles,
    read_shared_weights,
    release_shared_weights,
)
from gen_interface.weights.handles import (
    TensorSlot,
    WeightBucket,
    WeightHandles,
    describe_weight_handles,
)
from gen_interface.weights.producer import DEFAULT_BUCKET_BYTES, SharedWeights, share_weights

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "SharedWeights",
    "TensorSlot",
    "TensorSpecs",
    "WeightBucket",
    "WeightHandles",
    "bytes_checksum",
    "check_weights_match",
    "describe_weight_handles",
    "handles_for_device",
    "merge_weight_handles",
    "read_shared_weights",
    "release_shared_weights",
    "share_weights",
    "weights_checksum",
]
