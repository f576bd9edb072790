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
        "from gen_backend_kit.sampling import processed_log_probs\n"
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


#: Runs in SGLang's environment: one forward's batch of a row whose settings cannot be read
#: beside a readable one (rows of two calls, as a failed call's rows run on in the server).
_MIXED_BATCH = """
import torch
from gen_sglang_processor import CHOICE_KEY, RowSampler

class Req:
    customized_info = None
    retraction_count = 0
    inflight_middle_chunks = 0
    output_ids = []
    def finished(self):
        return False

def params(temperature):
    return {"__req__": Req(), "seed": 3, "temperature": temperature, "top_k": None,
            "top_p": 1.0, "min_p": 0.0, "top_logprobs": 2, "processed": False}

bad, good = params("hot"), params(1.0)
logits = torch.randn(2, 11, generator=torch.Generator().manual_seed(0))
out = RowSampler()(logits, [bad, good])
(bad_choice,) = bad["__req__"].customized_info[CHOICE_KEY]
(good_choice,) = good["__req__"].customized_info[CHOICE_KEY]
assert bad_choice[0] == "error" and "could not convert" in bad_choice[1], bad_choice
assert torch.equal(out[0], logits[0]), "the failed row goes on unchanged"
token = good_choice[0]
assert out[1, token] == 0 and torch.isinf(out[1]).sum() == 10, "the good row is sampled"
print("ok")
"""


def test_a_row_whose_settings_cannot_be_read_fails_alone_in_its_batch():
    done = subprocess.run(
        [str(managed_python()), "-c", _MIXED_BATCH],
        env={**os.environ, "PYTHONPATH": ":".join(support_dir(cpu=True))},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("ok")
