"""``tandem generate``: stream a completion from a running frontend to the terminal."""

from __future__ import annotations

import argparse
import os
import sys

import grpc

from tandem.argtypes import non_negative_float, positive_int
from tandem.security import API_KEY_ENV, AUTHORIZATION_HEADER, parse_api_keys
from tandem.v1 import common_pb2, frontend_pb2, frontend_pb2_grpc


def add_cli(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="Stream text from a running frontend.",
                       description="Send one prompt to a running frontend and stream the completion.")
    p.add_argument("prompt", help="The prompt text (or the user message with --chat).")
    p.add_argument("--target", default=None,
                   help="Frontend HOST:PORT; default: 127.0.0.1 and --port.")
    p.add_argument("--port", type=int, default=int(os.environ.get("TANDEM_FRONTEND_PORT", "50051")),
                   help="Frontend port on 127.0.0.1 when --target is not given (env TANDEM_FRONTEND_PORT).")
    p.add_argument("--max-tokens", type=positive_int, default=64, help="Most tokens to generate.")
    p.add_argument("--temperature", type=non_negative_float, default=None,
                   help="Sampling temperature; 0: greedy. Default: the model's own setting (its "
                   "generation_config.json; the default model is greedy), else 1.0.")
    p.add_argument("--seed", type=int, default=None, help="Sampling seed; default: none (not reproducible).")
    p.add_argument("--chat", action="store_true", help="Send the prompt as one user chat message.")
    p.add_argument("--timeout", type=non_negative_float, default=300.0,
                   help="Seconds before the call is given up (its gRPC deadline).")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="Key sent as 'authorization: Bearer KEY', for a frontend started with --api-key; "
                        "prefer the env var TANDEM_API_KEY (argv is visible to other users; of a "
                        "comma-separated list there, the first key is sent). Default: none.")
    p.set_defaults(handler=run_cli)


def build_request(args: argparse.Namespace) -> frontend_pb2.GenerateRequest:
    params = common_pb2.SamplingParams(max_tokens=args.max_tokens, output_kind=common_pb2.OUTPUT_KIND_DELTA)
    if args.temperature is not None:  # unset: the frontend applies the model's own setting
        params.temperature = args.temperature
    if args.seed is not None:
        params.seed = args.seed
    req = frontend_pb2.GenerateRequest(sampling_params=params)
    if args.chat:
        req.chat.messages.add(role="user", content=args.prompt)
    else:
        req.prompt = args.prompt
    return req


def call_metadata(args: argparse.Namespace) -> tuple[tuple[str, str], ...]:
    """The API key's ``authorization`` metadata: --api-key, else TANDEM_API_KEY's first key."""
    keys = parse_api_keys([args.api_key] if args.api_key else None, os.environ.get(API_KEY_ENV, "")).keys
    return ((AUTHORIZATION_HEADER, f"Bearer {keys[0]}"),) if keys else ()


def run_cli(args: argparse.Namespace) -> int:
    target = args.target or f"127.0.0.1:{args.port}"
    with grpc.insecure_channel(target) as channel:
        stub = frontend_pb2_grpc.GenerationStub(channel)
        mid_line = False  # text written since the last newline
        try:
            for resp in stub.Generate(build_request(args), timeout=args.timeout, metadata=call_metadata(args)):
                for out in resp.outputs:
                    sys.stdout.write(out.text)
                    mid_line = mid_line or bool(out.text)
                sys.stdout.flush()
                if resp.finished:
                    reason = resp.outputs[0].finish_reason if resp.outputs else ""
                    sys.stdout.write(
                        f"\n[{reason}; {resp.usage.prompt_tokens} prompt + "
                        f"{resp.usage.completion_tokens} completion tokens]\n"
                    )
                    mid_line = False
        except grpc.RpcError as exc:
            if mid_line:
                sys.stdout.write("\n")
                sys.stdout.flush()
            print(f"tandem: error: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    return 0
