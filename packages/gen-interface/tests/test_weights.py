import gc
import os
import pickle
import socket
import subprocess
import sys

import pytest
import torch
from gen_backend_kit.weights import (
    check_weights_match,
    handles_for_device,
    merge_weight_handles,
    read_shared_weights,
    release_shared_weights,
)
from gen_interface import WeightUpdateError
from gen_interface.weights import (
    bytes_checksum,
    describe_weight_handles,
    share_weights,
    weights_checksum,
)
from gen_interface.weights.handles import HANDLES_FORMAT
from hypothesis import given, settings
from hypothesis import strategies as st

# A separate interpreter reads the handles, releases them when asked and pickles back what it read.
_READER = """
import pickle, sys
from gen_backend_kit.weights import read_shared_weights, release_shared_weights
handles, release = pickle.load(sys.stdin.buffer)
tensors = [(name, t.cpu().clone()) for name, t in read_shared_weights(handles)]
if release:
    release_shared_weights(handles)
pickle.dump(tensors, sys.stdout.buffer)
"""


def _read_in_another_process(handles, release: bool):
    done = subprocess.run(
        [sys.executable, "-c", _READER],
        input=pickle.dumps((handles, release)),
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    return pickle.loads(done.stdout)


DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int8, torch.bool]


@st.composite
def state_dicts(draw):
    count = draw(st.integers(1, 6))
    out = {}
    for i in range(count):
        shape = draw(st.lists(st.integers(0, 7), min_size=0, max_size=3))
        dtype = draw(st.sampled_from(DTYPES))
        gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
        values = torch.randn(shape, generator=gen) * 50
        out[f"layer.{i}.weight"] = values > 0 if dtype == torch.bool else values.to(dtype)
    return out


def _segments(handles):
    return [b["location"] for b in handles["buckets"] if b["transport"] == "shm"]


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


@settings(max_examples=6)
@given(weights=state_dicts(), bucket_bytes=st.sampled_from([64, 256, 1 << 20]))
def test_shared_weights_read_back_bit_identical_in_another_process(weights, bucket_bytes):
    with share_weights(weights, bucket_bytes=bucket_bytes) as shared:
        segments = _segments(shared.handles)
        payload = _read_in_another_process(shared.handles, release=True)
        assert [name for name, _ in payload] == list(weights)
        for name, tensor in payload:
            assert _bitwise_equal(tensor, weights[name]), name
        # the consumer released the segments: none is left behind
        assert not any(os.path.exists(s) for s in segments)


def test_closing_the_producer_unlinks_segments_and_garbage_collection_does_too():
    shared = share_weights({"a": torch.ones(3)})
    (segment,) = _segments(shared.handles)
    assert os.path.exists(segment)
    shared.close()
    shared.close()  # idempotent
    assert not os.path.exists(segment) and shared.closed
    shared = share_weights({"a": torch.ones(3)})
    (segment,) = _segments(shared.handles)
    del shared
    gc.collect()
    assert not os.path.exists(segment)


def test_buckets_group_tensors_and_a_large_tensor_gets_its_own():
    weights = {
        "a": torch.zeros(16),
        "b": torch.zeros(16),
        "big": torch.zeros(1000),
        "c": torch.zeros(4),
    }
    with share_weights(weights, bucket_bytes=256) as shared:
        groups = [[t["name"] for t in b["tensors"]] for b in shared.handles["buckets"]]
        assert groups == [["a", "b"], ["big"], ["c"]]
        offsets = [t["offset"] for b in shared.handles["buckets"] for t in b["tensors"]]
        assert all(o % 64 == 0 for o in offsets)
        assert describe_weight_handles(shared.handles)["big"] == (torch.Size([1000]), torch.float32)


def test_mismatches_are_refused_before_any_bucket_is_mapped():
    with share_weights({"w": torch.ones(2, 3), "extra": torch.ones(1)}) as shared:
        model = {"w": (torch.Size([3, 2]), torch.float32)}
        with pytest.raises(WeightUpdateError) as refused:
            read_shared_weights(shared.handles, expected=model)
        message = str(refused.value)
        assert "'extra' is not a weight of the model" in message and "shape [2, 3]" in message
    with pytest.raises(WeightUpdateError, match="is int32, the model's is float32"):
        check_weights_match(
            {"w": (torch.Size([2]), torch.int32)}, {"w": (torch.Size([2]), torch.float32)}
        )
    # floating-point weights in another floating-point dtype are cast on the way
    check_weights_match(
        {"w": (torch.Size([2]), torch.bfloat16)}, {"w": (torch.Size([2]), torch.float32)}
    )


def test_a_bucket_changed_after_sharing_is_refused():
    with share_weights({"w": torch.ones(8)}) as shared:
        tensors = read_shared_weights(shared.handles)
        tensors[0][1][0] = 5.0  # the views write through to the segment
        with pytest.raises(WeightUpdateError, match="checksum"):
            read_shared_weights(shared.handles)


def test_segments_on_another_host_or_already_released_are_refused():
    with share_weights({"w": torch.ones(2)}) as shared:
        elsewhere = dict(shared.handles, host=socket.gethostname() + "-other")
        with pytest.raises(WeightUpdateError, match="same machine"):
            read_shared_weights(elsewhere)
        assert release_shared_weights(shared.handles) == 1
        assert release_shared_weights(shared.handles) == 0
        with pytest.raises(WeightUpdateError, match="already consumed"):
            read_shared_weights(shared.handles)


def test_malformed_handles_are_refused():
    with pytest.raises(WeightUpdateError, match="format"):
        describe_weight_handles({"buckets": []})
    with pytest.raises(WeightUpdateError, match="malformed"):
        describe_weight_handles(
            {"format": HANDLES_FORMAT, "host": "h", "buckets": [{"tensors": [{}]}]}
        )


def test_checksums_see_changed_and_moved_bytes():
    a = torch.arange(64, dtype=torch.float32)
    assert bytes_checksum(a) == bytes_checksum(a.clone())
    assert bytes_checksum(a) != bytes_checksum(a.flip(0))
    b = a.clone()
    b[10] += 1e-3
    assert bytes_checksum(a) != bytes_checksum(b)
    assert weights_checksum([("x", a), ("y", b)]) == weights_checksum([("y", b), ("x", a)])
    assert weights_checksum([("x", a), ("y", b)]) != weights_checksum([("x", b), ("y", a)])


@pytest.mark.gpu
def test_cuda_tensors_share_through_ipc_handles():
    weights = {"w": torch.randn(128, 64, device="cuda"), "b": torch.randn(64, device="cuda")}
    with share_weights(weights) as shared:
        assert {b["transport"] for b in shared.handles["buckets"]} == {"cuda_ipc"}
        payload = _read_in_another_process(shared.handles, release=False)
    for name, tensor in payload:
        assert torch.equal(tensor.cpu(), weights[name].cpu())


def _gpu_copy(uuid: str, names: list[str], shape: list[int] | None = None) -> dict:
    """A CUDA IPC bucket's description (no GPU needed to describe one)."""
    shape = shape or [4]
    slots = [
        {"name": n, "dtype": "float32", "shape": shape, "offset": 64 * i, "nbytes": 4 * shape[0]}
        for i, n in enumerate(names)
    ]
    return {
        "transport": "cuda_ipc",
        "location": "",
        "ipc_args": b"",
        "device_uuid": uuid,
        "nbytes": 64 * len(names),
        "checksum": 0,
        "tensors": slots,
    }


def _handles(*buckets, host="h") -> dict:
    return {
        "format": HANDLES_FORMAT,
        "host": host,
        "buckets": list(buckets),
        "release_after_read": True,
    }


def test_each_worker_reads_the_copy_on_its_own_gpu():
    """Two generation GPUs, one copy of the weights on each: every worker finds its own."""
    handles = _handles(_gpu_copy("GPU-a", ["w", "b"]), _gpu_copy("GPU-b", ["w", "b"]))
    assert set(describe_weight_handles(handles)) == {"w", "b"}  # names repeat across GPUs
    for uuid in ("GPU-a", "GPU-b"):
        mine = handles_for_device(handles, uuid)["buckets"]
        assert [b["device_uuid"] for b in mine] == [uuid]
    with pytest.raises(WeightUpdateError, match=r"on GPUs \['GPU-a', 'GPU-b'\].*devices="):
        handles_for_device(handles, "GPU-c")
    with pytest.raises(WeightUpdateError, match="the CPU"):
        handles_for_device(handles, None)


def test_a_worker_without_a_copy_on_its_gpu_reads_host_memory():
    with share_weights({"w": torch.ones(4), "b": torch.zeros(4)}) as shared:
        merged = merge_weight_handles(
            [shared.handles, _handles(_gpu_copy("GPU-a", ["w", "b"]), host=shared.handles["host"])]
        )
        assert handles_for_device(merged, "GPU-a")["buckets"][0]["transport"] == "cuda_ipc"
        assert {b["transport"] for b in handles_for_device(merged, "GPU-z")["buckets"]} == {"shm"}
        assert {b["transport"] for b in handles_for_device(merged, None)["buckets"]} == {"shm"}


def test_merging_refuses_copies_that_clash_or_differ():
    a, b = _handles(_gpu_copy("GPU-a", ["w"])), _handles(_gpu_copy("GPU-b", ["w"]))
    assert len(merge_weight_handles([a, b])["buckets"]) == 2
    with pytest.raises(WeightUpdateError, match="both hold weights in GPU-a"):
        merge_weight_handles([a, a])
    with pytest.raises(WeightUpdateError, match="different tensors in GPU-a and in GPU-b"):
        merge_weight_handles([a, _handles(_gpu_copy("GPU-b", ["w"], shape=[8]))])
    with pytest.raises(WeightUpdateError, match="different hosts"):
        merge_weight_handles([a, _handles(_gpu_copy("GPU-b", ["w"]), host="elsewhere")])
    with pytest.raises(WeightUpdateError, match="twice in GPU-a"):
        describe_weight_handles(_handles(_gpu_copy("GPU-a", ["w"]), _gpu_copy("GPU-a", ["w"])))


@pytest.mark.gpu
def test_a_copy_on_every_gpu_reaches_a_reader_on_each():
    """``share_weights(devices=...)`` places one copy per GPU; each reads bit-identical tensors."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    weights = {"w": torch.randn(128, 64, device="cuda:0"), "b": torch.randn(64, device="cuda:0")}
    with share_weights(weights, devices=[0, 1]) as shared:
        places = {b["device_uuid"] for b in shared.handles["buckets"]}
        assert len(places) == 2
        for index in (0, 1):
            with torch.cuda.device(index):
                uuid = torch.cuda.get_device_properties(index).uuid
                mine = handles_for_device(shared.handles, f"GPU-{uuid}")
                for name, tensor in read_shared_weights(mine):
                    assert tensor.device.index == index
                    assert torch.equal(tensor.cpu(), weights[name].cpu())


def test_a_closed_broadcaster_refuses_a_refit_and_touches_no_backend():
    from gen_interface.weights import WeightBroadcaster
    from gen_interface.weights.collective import WeightGroup

    class Untouched:
        def __getattr__(self, name):
            raise AssertionError(f"the backend was asked for {name!r}")

    broadcaster = WeightBroadcaster(Untouched(), WeightGroup(None, 0, torch.device("cpu")))
    broadcaster.close()
    with pytest.raises(WeightUpdateError, match="closed"):
        broadcaster.refit({"w": torch.zeros(2)})
