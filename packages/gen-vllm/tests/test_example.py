"""The seed document's usage example runs as written (examples/vllm_generation.py)."""

import runpy
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "vllm_generation.py"


def test_the_usage_example_runs(ray_session, tiny_qwen2, capsys):
    main = runpy.run_path(str(EXAMPLE))["main"]
    output = main(["--model", str(tiny_qwen2.path), "--cpu"])  # the test Ray has logical GPUs
    assert output["output_ids"].shape[0] == 2
    assert bool((output["generation_lengths"] >= 1).all())
    printed = capsys.readouterr().out
    assert "'The policy samples' ->" in printed
