"""Importing the interface loads the interface alone: no backend kit, backend or engine."""

import subprocess
import sys

#: What a training loop imports from the interface.
TRAINING_LOOP_IMPORTS = (
    "import sys, gen_interface; "
    "from gen_interface import (BatchedDataDict, GenerationConfig, GenerationDatumSpec, "
    "GenerationOutputSpec, GenerationInterface, configure_generation_config, "
    "create_generation_backend, GenerationError); "
    "from gen_interface.weights import Refitter, WeightBroadcaster, share_weights, "
    "share_parameters; "
    "from gen_interface.seeds import derive_sample_seeds; "
)
FORBIDDEN = (
    "ray",
    "vllm",
    "transformers",
    "gen_backend_kit",
    "gen_hf",
    "gen_vllm",
    "gen_serve",
    "gen_remote",
    "gen_sglang",
    "gen_testkit",
)


def test_a_training_loops_imports_load_no_kit_backend_or_engine():
    code = TRAINING_LOOP_IMPORTS + (
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_check_above_sees_a_kit_import():
    code = TRAINING_LOOP_IMPORTS + "import gen_backend_kit; print('gen_backend_kit' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"
