"""``examples/distillation.py`` in CI: the student's top-k forward KL to the teacher falls step
after step, on the student's own fresh rollouts, while its new weights go back to its
generator."""

from __future__ import annotations

import itertools

from example_modules import load_example
from gen_testkit.models import TinyModel


def test_the_students_kl_to_the_teacher_falls_step_after_step(
    tiny_qwen2: TinyModel, tiny_llama: TinyModel
):
    kls = load_example("distillation").run(str(tiny_qwen2.path), str(tiny_llama.path), steps=4)
    assert all(later < earlier for earlier, later in itertools.pairwise(kls)), kls
    assert kls[-1] < 0.85 * kls[0], kls
