"""``gen-serve``: any installed backend behind vLLM's HTTP protocol.

    uv run gen-serve --backend hf --model DIR [--host 127.0.0.1] [--port 8000] [--config FILE]

``--config`` is a YAML or JSON generation config (checked like every config); the command line
fills ``backend`` and ``model_name`` and the server-side settings; ``--speculative JSON`` sets
the config's ``speculative`` section (speculative decoding, where the backend offers it).
``--replicas`` reaches backends whose ``create`` takes it (gen-vllm). The server listens on
127.0.0.1 unless told otherwise, and stops cleanly on SIGTERM, sent to it alone, to its process
group or to every process of the service: requests in flight get ``--graceful-seconds`` to
finish, then the backend shuts down.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn

__all__ = ["main", "parse_args", "serve_backend_config"]

logger = logging.getLogger("gen_serve")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="gen-serve", description=__doc__.splitlines()[0])
    parser.add_argument("--backend", help="registered backend name (hf, vllm, ...)")
    parser.add_argument("--model", help="model directory or hub name")
    parser.add_argument("--config", help="a YAML or JSON generation config")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", help="the name clients send as `model`")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("GEN_SERVE_API_KEY"),
        help="guards every route but /health (default: $GEN_SERVE_API_KEY)",
    )
    parser.add_argument("--replicas", type=int, help="engines, for backends that take it")
    parser.add_argument("--dtype", help="model dtype (overrides the config's)")
    parser.add_argument("--max-model-len", type=int, help="context limit (vLLM's name)")
    parser.add_argument(
        "--speculative",
        metavar="JSON",
        help="speculative decoding, the config's `speculative` section as JSON (overrides the "
        'config\'s), e.g. \'{"method": "ngram", "num_speculative_tokens": 3}\'',
    )
    parser.add_argument("--max-requests", type=int, default=1024)
    parser.add_argument("--max-rows-per-request", type=int, default=1024)
    parser.add_argument("--max-body-bytes", type=int, default=32 << 20)
    parser.add_argument("--max-logprobs", type=int, default=20)
    parser.add_argument("--no-control-routes", action="store_true")
    parser.add_argument("--no-weight-routes", action="store_true")
    parser.add_argument("--graceful-seconds", type=float, default=10.0)
    parser.add_argument("--log-level", default="info")
    return parser.parse_args(argv)


def serve_backend_config(args: argparse.Namespace) -> dict[str, Any]:
    """The generation config the server's backend is built from."""
    config: dict[str, Any] = {}
    if args.config:
        text = Path(args.config).read_text()
        if args.config.endswith((".yaml", ".yml")):
            import yaml

            config = yaml.safe_load(text) or {}
        else:
            config = json.loads(text)
    if args.backend:
        config["backend"] = args.backend
    if args.model:
        config["model_name"] = args.model
    if args.dtype:
        config["dtype"] = args.dtype
    if args.max_model_len:
        key = {"vllm": "vllm_cfg", "hf": "hf_cfg"}.get(str(config.get("backend")))
        if key is None:
            raise SystemExit(
                f"--max-model-len: backend {config.get('backend')!r} has no such setting"
            )
        config.setdefault(key, {})["max_model_len"] = args.max_model_len
    if args.speculative:
        config["speculative"] = _speculative_section(args.speculative)
    missing = [k for k in ("backend", "model_name") if not config.get(k)]
    if missing:
        raise SystemExit(f"gen-serve needs {missing}: give --backend and --model, or a --config")
    # Requests carry their own sampling settings; the config's are the defaults of none.
    config.setdefault("seed", None)
    return config


def _speculative_section(text: str) -> dict[str, Any]:
    """``--speculative``'s JSON object (its keys are checked with the rest of the config)."""
    try:
        section = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SystemExit(f"--speculative must be a JSON object: {exc}") from exc
    if not isinstance(section, dict):
        raise SystemExit(
            f"--speculative must be a JSON object such as "
            f'\'{{"method": "ngram", "num_speculative_tokens": 3}}\', got {text!r}'
        )
    return section


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    from gen_interface import configure_generation_config, create_generation_backend

    from gen_serve.app import build_app, sampling_defaults
    from gen_serve.codec import TextCodec
    from gen_serve.state import ServerSettings

    config = serve_backend_config(args)
    model = str(config["model_name"])
    codec = TextCodec.from_model_dir(model) if (Path(model) / "tokenizer.json").is_file() else None
    tokenizer = _Tokens(codec.pad_token_id, codec.eos_token_id) if codec else None
    config = configure_generation_config(config, tokenizer)
    kwargs = {"replicas": args.replicas} if args.replicas else {}
    logger.info("starting backend %s for %s", config["backend"], model)
    backend = create_generation_backend(config, **kwargs)
    settings = ServerSettings(
        model_name=args.served_model_name or model,
        model_path=model,
        api_key=args.api_key,
        max_requests=args.max_requests,
        max_rows_per_request=args.max_rows_per_request,
        max_body_bytes=args.max_body_bytes,
        max_logprobs=args.max_logprobs,
        control_routes=not args.no_control_routes,
        weight_routes=not args.no_weight_routes,
        defaults=sampling_defaults(model),
    )
    app = build_app(backend, settings, codec=codec)
    server = _Server(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            timeout_graceful_shutdown=args.graceful_seconds,
        )
    )
    server.run()


class _Server(uvicorn.Server):
    """uvicorn's server, exiting 0 after a clean stop on SIGTERM or SIGINT (uvicorn raises the
    signal again once stopped; under Ray's handler that became exit status 15). The app drains
    from the signal on (``ServerState.begin_draining``): a request that comes while the
    requests in flight finish gets 503 at once."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        server_state = getattr(getattr(self.config.app, "state", None), "server", None)
        if server_state is not None:
            server_state.begin_draining()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            yield
            self._captured_signals.clear()


class _Tokens:
    """What ``configure_generation_config`` reads of a tokenizer."""

    def __init__(self, pad: int | None, eos: int | None):
        self.pad_token_id = pad if pad is not None else eos
        self.eos_token_id = eos


if __name__ == "__main__":
    main()
