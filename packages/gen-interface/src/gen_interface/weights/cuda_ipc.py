"""CUDA IPC buckets: GPU memory shared with another process on the same GPU, with no copy.

Used only for CUDA tensors; importing this module never touches CUDA.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch

from gen_interface.errors import WeightUpdateError

__all__ = ["device_index", "device_uuid", "export_cuda_bucket", "import_cuda_bucket"]

# Position of the device index in torch's rebuild_cuda_tensor arguments.
_STORAGE_DEVICE_ARG = 6


def device_uuid(device: torch.device | int) -> str:
    """The UUID of a CUDA device (``"GPU-5b2c..."``): stable across processes, unlike indices."""
    props = torch.cuda.get_device_properties(device)
    return f"GPU-{props.uuid}"


def device_index(uuid: str) -> int:
    """This process's index of the GPU with UUID ``uuid``.

    Raises:
        ValueError: no visible GPU has that UUID.
    """
    for index in range(torch.cuda.device_count()):
        if device_uuid(index) == uuid:
            return index
    raise ValueError(f"no GPU visible to this process has UUID {uuid}")


def export_cuda_bucket(bucket: torch.Tensor) -> bytes:
    """Pickled arguments that let another process rebuild ``bucket`` (a CUDA uint8 tensor).

    The caller keeps ``bucket`` alive until every consumer has read it.
    """
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(bucket)
    return pickle.dumps(args)


def import_cuda_bucket(ipc_args: bytes, bucket_uuid: str) -> torch.Tensor:
    """Rebuild a CUDA bucket exported by ``export_cuda_bucket`` on this process's own GPU.

    Raises:
        WeightUpdateError: no CUDA here, or the bucket lives on another GPU.
    """
    if not torch.cuda.is_available():
        raise WeightUpdateError("weights were shared as CUDA IPC handles but CUDA is unavailable")
    here = torch.cuda.current_device()
    if device_uuid(here) != bucket_uuid:
        raise WeightUpdateError(
            f"CUDA IPC bucket lives on {bucket_uuid}, this worker runs on {device_uuid(here)}"
        )
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    args: list[Any] = list(pickle.loads(ipc_args))
    # Indices differ between processes (CUDA_VISIBLE_DEVICES); the UUID matched, so use ours.
    args[_STORAGE_DEVICE_ARG] = here
    return rebuild_cuda_tensor(*args)
