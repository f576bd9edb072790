"""A package's smoke test, run inside a fresh environment that holds it: ``python smoke.py NAME``.

Standalone on purpose (the environment holds only the package and what it declares). Each test
exercises the package through gen-interface's discovery, as a training loop reaches it; exits 0
with one line of what it did, or raises.
"""

from __future__ import annotations

import importlib
import sys
import tempfile
from importlib.metadata import entry_points


def _backends_of(distribution: str) -> dict[str, object]:
    """The backends this distribution registers, each loaded through gen-interface."""
    from gen_interface import available_backends, load_backend

    names = [
        ep.name
        for ep in entry_points(group="gen_interface.backends")
        if ep.dist is not None and ep.dist.name == distribution
    ]
    assert set(names) <= set(available_backends()), (names, available_backends())
    return {name: load_backend(name) for name in names}


def _config(backend: str, model: str, vocab: int) -> dict[str, object]:
    return {
        "backend": backend,
        "model_name": model,
        "max_new_tokens": 4,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": None,
        "seed": 0,
        "pad_token_id": 0,
        "stop_token_ids": [],
    }


def _prompts():
    import torch
    from gen_interface import BatchedDataDict

    return BatchedDataDict(
        input_ids=torch.tensor([[0, 5, 6], [7, 8, 9]]),
        attention_mask=torch.tensor([[0, 1, 1], [1, 1, 1]]),
    )


def _generate_and_refit(backend, state_dict) -> str:
    """Generate, refit with the same weights through a Refitter, generate again: the same."""
    import torch
    from gen_interface.weights import Refitter

    backend.prepare_for_generation()
    first = backend.generate(_prompts(), greedy=True)
    with Refitter(backend) as refitter:
        version = refitter.refit(state_dict)
    again = backend.generate(_prompts(), greedy=True)
    assert torch.equal(first["output_ids"], again["output_ids"]), "a refit of the same weights"
    assert int(again["weight_version"][0]) == version == 1
    backend.shutdown()
    return f"generated {tuple(first['output_ids'].shape)}, refitted to version {version}"


def smoke_in_process(distribution: str, backend_name: str) -> str:
    from gen_interface import configure_generation_config, create_generation_backend

    backend_cls = _backends_of(distribution)[backend_name]
    extra = {"ngram": {"vocab_size": 64}} if backend_name == "ngram" else {}
    config = configure_generation_config({**_config(backend_name, backend_name, 64), **extra}, None)
    backend = create_generation_backend(config)
    assert isinstance(backend, backend_cls)  # type: ignore[arg-type]
    return _generate_and_refit(backend, backend.state_dict())  # type: ignore[attr-defined]


def smoke_hf() -> str:
    """A tiny random Llama saved to disk, served by gen-hf through the interface."""
    from gen_interface import configure_generation_config, create_generation_backend
    from transformers import LlamaConfig, LlamaForCausalLM

    _backends_of("gen-hf")
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=32,
        )
    )
    with tempfile.TemporaryDirectory() as directory:
        model.save_pretrained(directory)
        config = configure_generation_config(_config("hf", directory, 64), None)
        backend = create_generation_backend(config)
        return _generate_and_refit(backend, model.state_dict())


def smoke_config_only(distribution: str, backend_name: str, extra: dict[str, object]) -> str:
    """Backends whose engines are too heavy to start here: discovery and config completion."""
    from gen_interface import GenerationConfigError

    backend_cls = _backends_of(distribution)[backend_name]
    config = {**_config(backend_name, "/nonexistent/model", 64), **extra}
    completed = backend_cls.complete_config(config)  # type: ignore[attr-defined]
    try:
        backend_cls.complete_config({**config, "max_new_token": 4})  # type: ignore[attr-defined]
    except GenerationConfigError as refused:
        assert "max_new_tokens" in str(refused), refused
    else:
        raise AssertionError("a misspelt key was accepted")
    return f"{backend_name}: config completed ({len(completed)} keys), a misspelt key refused"


def smoke_remote() -> str:
    """The remote client against a port where nothing listens: a typed error, at once."""
    from gen_interface import (
        BackendUnavailableError,
        configure_generation_config,
        create_generation_backend,
    )

    _backends_of("gen-remote")
    config = configure_generation_config(
        {**_config("remote", "m", 64), "remote_cfg": {"base_url": "http://127.0.0.1:9"}}, None
    )
    try:
        create_generation_backend(config)
    except BackendUnavailableError as refused:
        return f"remote: unreachable server refused as {type(refused).__name__}"
    raise AssertionError("a backend was built against a port where nothing listens")


def smoke_serve() -> str:
    """gen-serve's application and command line load with no backend installed."""
    cli = importlib.import_module("gen_serve.cli")
    try:
        cli.main(["--help"])
    except SystemExit as done:
        assert done.code == 0, done.code
    return "gen-serve: command line loads"


def smoke_interface_alone() -> str:
    """gen-interface alone serves a training loop's imports and loads no kit, backend or engine;
    with no backend installed, asking for one is a typed error that says so."""
    from gen_interface import (
        BackendUnavailableError,
        BatchedDataDict,
        GenerationConfig,
        GenerationDatumSpec,
        GenerationInterface,
        GenerationOutputSpec,
        available_backends,
        configure_generation_config,
        create_generation_backend,
    )
    from gen_interface.seeds import derive_sample_seeds
    from gen_interface.weights import Refitter, WeightBroadcaster, share_parameters, share_weights

    del BatchedDataDict, GenerationConfig, GenerationDatumSpec, GenerationOutputSpec
    del GenerationInterface, derive_sample_seeds, Refitter, WeightBroadcaster
    del share_parameters, share_weights
    forbidden = ("ray", "vllm", "transformers", "gen_backend_kit", "gen_hf", "gen_vllm")
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in forbidden)
    assert not loaded, f"a training loop's imports loaded {loaded}"
    assert available_backends() == {}, available_backends()
    try:
        create_generation_backend(configure_generation_config(_config("hf", "m", 64), None))
    except BackendUnavailableError as refused:
        assert "hf" in str(refused), refused
    else:
        raise AssertionError("a backend was built with none installed")
    return "gen-interface alone: a training loop's imports, no kit or backend loaded"


def smoke_kit() -> str:
    """The kit's builders on one call: validated input, resolved sampling, the output layout."""
    import torch
    from gen_backend_kit import RowResult, build_generation_output, normalize_generation_input
    from gen_backend_kit.row_sampling import resolve_sampling

    prompts = normalize_generation_input(_prompts(), pad_token_id=0, vocab_size=64)
    sampling = resolve_sampling({**_config("kit", "m", 64), "seed": 7}, prompts, greedy=False)
    rows = [RowResult([1, 2], [-0.5, -0.25], truncated=True) for _ in range(prompts.size)]
    out = build_generation_output(prompts, rows, 0)
    assert out["output_ids"].shape == (2, 5) and out["logprobs"].dtype == torch.float32
    assert len({row.seed for row in sampling.rows}) == 2
    return (
        f"gen-backend-kit: a call validated, sampled and laid out {tuple(out['output_ids'].shape)}"
    )


def import_every_module(distribution: str) -> int:
    """Import every module of the distribution's package (code run elsewhere excepted)."""
    import pkgutil

    package = importlib.import_module(distribution.replace("-", "_"))
    count = 1
    for module in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        if ".server_side" not in module.name:  # gen-sglang's, run inside SGLang's environment
            importlib.import_module(module.name)
            count += 1
    return count


SMOKE = {
    "gen-interface": smoke_interface_alone,
    "gen-backend-kit": smoke_kit,
    "gen-hf": smoke_hf,
    "gen-vllm": lambda: smoke_config_only("gen-vllm", "vllm", {}),
    "gen-sglang": lambda: smoke_config_only("gen-sglang", "sglang", {}),
    "gen-remote": smoke_remote,
    "gen-serve": smoke_serve,
    "gen-testkit": lambda: smoke_in_process("gen-testkit", "ngram"),
    "gen-toy": lambda: smoke_in_process("gen-toy", "toy"),
}

if __name__ == "__main__":
    name = sys.argv[1]
    modules = import_every_module(name)
    print(f"{SMOKE[name]()} ({modules} modules imported)")
