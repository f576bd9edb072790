import subprocess
import sys

import pytest
from gen_interface import (
    BackendUnavailableError,
    GenerationConfigError,
    available_backends,
    create_generation_backend,
    load_backend,
)


def test_installed_backends_are_listed_without_importing_them():
    code = (
        "import sys; from gen_interface import available_backends; b = available_backends(); "
        "print(sorted(b)); print([m for m in ('gen_hf', 'gen_vllm', 'gen_testkit.ngram') "
        "if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    names, imported = out.stdout.strip().splitlines()
    assert "ngram" in names
    assert imported == "[]"


def test_a_backend_is_built_by_name():
    backend = create_generation_backend(
        {
            "backend": "ngram",
            "model_name": "ngram",
            "max_new_tokens": 2,
            "temperature": 1.0,
            "top_p": 1.0,
            "pad_token_id": 0,
            "stop_token_ids": [],
        }
    )
    assert type(backend).__name__ == "NgramGeneration"
    assert load_backend("ngram") is type(backend)


def test_an_unknown_backend_lists_the_installed_ones():
    with pytest.raises(BackendUnavailableError) as refused:
        create_generation_backend({"backend": "trtllm", "model_name": "m"})
    assert "trtllm" in str(refused.value)
    for name in available_backends():
        assert name in str(refused.value)
    with pytest.raises(GenerationConfigError, match="backend"):
        create_generation_backend({"model_name": "m"})
