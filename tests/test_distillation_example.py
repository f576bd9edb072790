"""``examples/distillation.py`` in CI: the student's top-k forward KL to the teacher falls step
after step, on the student's own fresh rollouts, while its new weights go back to its
generator."""

from __future__ import annotations

import importlib.util
import itertools
import sys
from pathlib import Path
from typing import Any

from gen_testkit.models import TinyModel

EXAMPLE = Path(__file__).parents[1] / "examples" / "distillation.py"


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("distillation", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["distillation"] = module
    spec.loader.exec_module(module)
    return module


def test_the_students_kl_to_the_teacher_falls_step_after_step(
    tiny_qwen2: TinyModel, tiny_llama: TinyModel
):
    kls = _example().run(str(tiny_qwen2.path), str(tiny_llama.path), steps=4)
    assert all(later < earlier for earlier, later in itertools.pairwise(kls)), kls
    assert kls[-1] < 0.85 * kls[0], kls
