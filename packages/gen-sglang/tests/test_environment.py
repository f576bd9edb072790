"""SGLang's managed environment and the support directory every server imports first."""

from __future__ import annotations

import os
import subprocess

from gen_sglang.environment import SGLANG_VERSION, managed_python, support_dir


def test_the_managed_environment_has_sglang_and_the_support_directory_its_imports():
    python = managed_python()
    paths = support_dir(cpu=True)
    assert len(paths) == 2 and paths[1].endswith("cpu_shims")
    check = (
        "import importlib.metadata as m, sgl_kernel, torchvision.transforms as T\n"
        "from gen_interface.sampling import processed_log_probs\n"
        "import gen_sglang_processor\n"
        "assert callable(sgl_kernel.silu_and_mul)\n"
        "assert callable(sgl_kernel.copy_all_layer_kv_cache_cpu)\n"
        "assert not hasattr(sgl_kernel, 'uint4b8'), 'SGLang detects missing kernels by name'\n"
        "assert T.InterpolationMode.BICUBIC.value == 'bicubic'\n"
        "print(m.version('sglang'))\n"
    )
    done = subprocess.run(
        [str(python), "-c", check],
        env={**os.environ, "PYTHONPATH": ":".join(paths)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == SGLANG_VERSION


def test_off_the_cpu_the_stand_ins_stay_out():
    assert [p for p in support_dir(cpu=False) if p.endswith("cpu_shims")] == []
