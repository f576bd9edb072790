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

Deltas: a ``Refitter`` or ``WeightBroadcaster`` with ``deltas`` on sends each tensor whole or as
what changed since the version the backend holds (``weight_base()``), whichever is smaller::

    refitter = Refitter(generator, deltas=True)          # default on the collective path

The other end, inside a backend, is the backend kit's (``gen_backend_kit.weights``):
``WeightUpdates`` runs the transaction; ``read_shared_weights`` maps and verifies the buckets of
one load. This package holds the trainer's side and the handle format both ends share.
"""

from gen_interface.weights.checksum import (
    bytes_checksum,
    combine_checksums,
    named_checksums,
    weights_checksum,
)
from gen_interface.weights.collective import (
    BroadcastBucket,
    CollectiveEndpoint,
    WeightBroadcaster,
    join_weight_group,
)
from gen_interface.weights.delta import (
    DELTA_ENCODING,
    TensorDelta,
    TensorDiff,
    apply_delta,
    diff_tensors,
    encode_delta,
)
from gen_interface.weights.handles import (
    DeltaSlot,
    LoadSize,
    TensorSlot,
    WeightBase,
    WeightBucket,
    WeightHandles,
    describe_weight_handles,
    handles_from_json,
    handles_to_json,
)
from gen_interface.weights.in_place import SharedParameters, share_parameters, share_tensors
from gen_interface.weights.producer import DEFAULT_BUCKET_BYTES, SharedWeights, share_weights
from gen_interface.weights.sent import SentWeights
from gen_interface.weights.stream import DEFAULT_STREAM_BUCKET_BYTES, BucketRing, Refitter, refit

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "DEFAULT_STREAM_BUCKET_BYTES",
    "DELTA_ENCODING",
    "BroadcastBucket",
    "BucketRing",
    "CollectiveEndpoint",
    "DeltaSlot",
    "LoadSize",
    "Refitter",
    "SentWeights",
    "SharedParameters",
    "SharedWeights",
    "TensorDelta",
    "TensorDiff",
    "TensorSlot",
    "WeightBase",
    "WeightBroadcaster",
    "WeightBucket",
    "WeightHandles",
    "apply_delta",
    "bytes_checksum",
    "combine_checksums",
    "describe_weight_handles",
    "diff_tensors",
    "encode_delta",
    "handles_from_json",
    "handles_to_json",
    "join_weight_group",
    "named_checksums",
    "refit",
    "share_parameters",
    "share_tensors",
    "share_weights",
    "weights_checksum",
]
