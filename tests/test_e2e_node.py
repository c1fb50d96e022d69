"""A Node.js client (@grpc/grpc-js + @grpc/proto-loader on the .proto files) against the
shared stack: the same greedy tokens as a Python client."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from tandem.v1 import common_pb2, frontend_pb2
from tests.e2e_helpers import REPO_ROOT, Stack

pytest_plugins = ["tests.e2e_helpers"]

NODE = shutil.which("node")
CLIENT = REPO_ROOT / "tests" / "node" / "generate_client.js"
PROMPT = "Tandem speaks gRPC to every language"
MAX_TOKENS = 20

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(NODE is None, reason="node is not installed"),
    pytest.mark.skipif(
        not (REPO_ROOT / "node_modules" / "@grpc" / "grpc-js").is_dir()
        or not (REPO_ROOT / "node_modules" / "@grpc" / "proto-loader").is_dir(),
        reason="node_modules/@grpc is missing (run `npm install`)",
    ),
]


def test_node_client_matches_python_client(e2e_stack: Stack) -> None:
    assert NODE is not None
    done = subprocess.run(
        [NODE, str(CLIENT), e2e_stack.address, PROMPT, str(MAX_TOKENS)],
        capture_output=True, text=True, timeout=120, cwd=REPO_ROOT, check=False,
    )
    assert done.returncode == 0, done.stderr
    node = json.loads(done.stdout)

    sp = common_pb2.SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, output_kind=common_pb2.OUTPUT_KIND_DELTA
    )
    responses = list(
        e2e_stack.generation_stub().Generate(frontend_pb2.GenerateRequest(prompt=PROMPT, sampling_params=sp), timeout=60)
    )
    ids = [t for r in responses for o in r.outputs for t in o.token_ids]
    text = "".join(o.text for r in responses for o in r.outputs)

    assert node["num_tokens"] == MAX_TOKENS
    assert node["token_ids"] == ids
    assert node["text"] == text
    assert node["finish_reason"] == "length"
    assert node["prompt_token_ids"] == list(responses[0].prompt_token_ids)
    assert node["messages"] > 1  # streamed, not one final message


SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "rank": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["city", "rank"],
    "additionalProperties": False,
}


def test_node_client_json_schema_request(e2e_stack: Stack) -> None:
    """Structured output from a client generated from the .proto files alone."""
    import jsonschema

    assert NODE is not None
    done = subprocess.run(
        [NODE, str(CLIENT), e2e_stack.address, PROMPT, "96", json.dumps(SCHEMA)],
        capture_output=True, text=True, timeout=120, cwd=REPO_ROOT, check=False,
    )
    assert done.returncode == 0, done.stderr
    node = json.loads(done.stdout)
    assert node["finish_reason"] == "stop", node
    jsonschema.validate(json.loads(node["text"]), SCHEMA)

    sp = common_pb2.SamplingParams(
        temperature=0.0,
        max_tokens=96,
        output_kind=common_pb2.OUTPUT_KIND_DELTA,
        structured_outputs=common_pb2.StructuredOutputs(json=json.dumps(SCHEMA), disable_any_whitespace=True),
    )
    responses = list(
        e2e_stack.generation_stub().Generate(frontend_pb2.GenerateRequest(prompt=PROMPT, sampling_params=sp), timeout=60)
    )
    assert node["token_ids"] == [t for r in responses for o in r.outputs for t in o.token_ids]
