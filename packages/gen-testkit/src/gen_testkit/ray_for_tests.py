"""The local Ray that a test process shares, of one shape whichever tests start it first.

A process holds one Ray connection. Tests of several packages run in one process (``pytest
packages``), and each started Ray with resources of its own (gen-serve's and gen-remote's
fixtures without logical GPUs, gen-vllm's with them), so what a test found depended on which
package's tests ran first: gen-vllm's fake-engine tests, which need logical GPUs, failed or
were skipped after gen-serve's. Every fixture that needs a Ray starts it here.
"""

from __future__ import annotations

__all__ = ["TEST_RAY_CPUS", "TEST_RAY_GPUS", "init_test_ray"]

#: Logical CPUs: more than this machine's cores, so that the engines tests share (one CPU
#: bundle each) can all stay up at once.
TEST_RAY_CPUS = 16
#: Logical GPUs, where no GPU is present: gen-vllm's fake engine runs the CUDA code paths on
#: them (GPU bundles, sleep mode, tensor parallelism). Ray only counts them.
TEST_RAY_GPUS = 8


def init_test_ray() -> bool:
    """Start the tests' local Ray (``TEST_RAY_CPUS`` CPUs, ``TEST_RAY_GPUS`` logical GPUs, no
    dashboard) unless this process already has one; True when it was started here (the caller
    then stops it with ``ray.shutdown()`` when done)."""
    import ray

    if ray.is_initialized():
        return False
    ray.init(
        num_cpus=TEST_RAY_CPUS,
        num_gpus=TEST_RAY_GPUS,
        include_dashboard=False,
        log_to_driver=False,
    )
    return True
