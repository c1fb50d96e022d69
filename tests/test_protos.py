"""The tandem.v1 contract: generated stubs import, match the .proto files, lint clean."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
from pathlib import Path
from types import ModuleType

import pytest
from google.protobuf import descriptor_pb2

from tandem.protocol.outputs import FinishReason
from tandem.protocol.sampling_params import RequestOutputKind
from tandem.v1 import (
    common_pb2,
    engine_pb2,
    engine_pb2_grpc,
    frontend_pb2,
    frontend_pb2_grpc,
    kv_transfer_pb2,
    kv_transfer_pb2_grpc,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = REPO_ROOT / "protos"
STUB_DIR = REPO_ROOT / "tandem" / "v1"
BUF = REPO_ROOT / "node_modules" / ".bin" / "buf"
REGENERATE = "run `python scripts/gen_protos.py` and commit the result"

COMMITTED: dict[str, ModuleType] = {
    "tandem/v1/common.proto": common_pb2,
    "tandem/v1/engine.proto": engine_pb2,
    "tandem/v1/frontend.proto": frontend_pb2,
    "tandem/v1/kv_transfer.proto": kv_transfer_pb2,
}


def _load_gen_protos() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_protos", REPO_ROOT / "scripts" / "gen_protos.py")
    if spec is None or spec.loader is None:
        raise ImportError("scripts/gen_protos.py not found")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _normalized(fdp: descriptor_pb2.FileDescriptorProto) -> descriptor_pb2.FileDescriptorProto:
    """Drop what differs between protoc outputs but not on the wire: source info and
    json_name (descriptor sets carry it, embedded Python descriptors do not)."""
    out = descriptor_pb2.FileDescriptorProto()
    out.CopyFrom(fdp)
    out.ClearField("source_code_info")

    def strip(messages: list[descriptor_pb2.DescriptorProto]) -> None:
        for message in messages:
            for f in [*message.field, *message.extension]:
                f.ClearField("json_name")
            strip(list(message.nested_type))

    strip(list(out.message_type))
    for f in out.extension:
        f.ClearField("json_name")
    return out


def test_stubs_import_and_expose_services() -> None:
    assert hasattr(engine_pb2_grpc, "EngineCoreStub")
    assert hasattr(engine_pb2_grpc, "add_EngineCoreServicer_to_server")
    assert hasattr(frontend_pb2_grpc, "GenerationStub")
    assert hasattr(frontend_pb2_grpc, "add_GenerationServicer_to_server")
    engine = engine_pb2.DESCRIPTOR.services_by_name["EngineCore"]
    stream = engine.methods_by_name["Stream"]
    assert stream.client_streaming and stream.server_streaming
    assert stream.input_type.full_name == "tandem.v1.EngineCoreInput"
    assert stream.output_type.full_name == "tandem.v1.EngineCoreOutputs"
    assert {"GetEngineInfo", "ResetPrefixCache"} <= set(engine.methods_by_name)
    assert hasattr(kv_transfer_pb2_grpc, "add_KvTransferServicer_to_server")
    pull = kv_transfer_pb2.DESCRIPTOR.services_by_name["KvTransfer"].methods_by_name["PullBlocks"]
    assert pull.server_streaming and not pull.client_streaming
    generation = frontend_pb2.DESCRIPTOR.services_by_name["Generation"]
    generate = generation.methods_by_name["Generate"]
    assert generate.server_streaming and not generate.client_streaming
    assert {
        "Abort",
        "Tokenize",
        "Detokenize",
        "GetModelInfo",
        "PauseGeneration",
        "ResumeGeneration",
        "IsPaused",
    } <= set(generation.methods_by_name)


def test_committed_stubs_match_protos(tmp_path: Path) -> None:
    gen = _load_gen_protos()
    protos = {str(p) for p in gen.proto_files()}
    assert protos == set(COMMITTED), f"new or removed .proto file: update this test and {REGENERATE}"

    descriptor_set = tmp_path / "set.binpb"
    gen.write_descriptor_set(descriptor_set)
    fresh = descriptor_pb2.FileDescriptorSet.FromString(descriptor_set.read_bytes())
    for fdp in fresh.file:
        committed = descriptor_pb2.FileDescriptorProto.FromString(
            COMMITTED[fdp.name].DESCRIPTOR.serialized_pb
        )
        assert _normalized(committed) == _normalized(fdp), (
            f"tandem/v1 stubs of {fdp.name} are out of date: {REGENERATE}"
        )

    # The .pyi and _grpc files are separate outputs that can go stale on their own:
    # compare what they declare (stable across grpcio-tools versions, unlike text).
    gen.generate(tmp_path)
    for proto in sorted(protos):
        stem = Path(proto).stem
        for suffix, pattern in (
            ("_pb2.pyi", r"^class (\w+)\(|^\s+(\w+_FIELD_NUMBER)\b"),
            ("_pb2_grpc.py", r"'(/tandem\.v1\.\w+/\w+)'"),
        ):
            name = f"{stem}{suffix}"
            committed_file = STUB_DIR / name
            assert committed_file.exists(), f"{committed_file} missing: {REGENERATE}"
            declared = [
                set(re.findall(pattern, path.read_text(), flags=re.MULTILINE))
                for path in (committed_file, tmp_path / "tandem" / "v1" / name)
            ]
            assert declared[0] == declared[1], f"tandem/v1/{name} is out of date: {REGENERATE}"


def test_no_stale_stubs() -> None:
    stems = {Path(p).stem for p in COMMITTED}
    for path in STUB_DIR.glob("*_pb2*"):
        stem = path.name.split("_pb2")[0]
        assert stem in stems, f"{path} has no .proto source: delete it or {REGENERATE}"


def test_buf_lint() -> None:
    if not BUF.exists() or shutil.which("node") is None:
        pytest.skip("buf not installed: run `npm install` at the repo root (the Makefile does)")
    result = subprocess.run(
        [str(BUF), "lint"], cwd=PROTO_DIR, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, f"buf lint failed:\n{result.stdout}{result.stderr}"


def test_optional_presence_round_trips() -> None:
    zero = common_pb2.SamplingParams(temperature=0.0, seed=0, logprobs=0, top_k=0)
    unset = common_pb2.SamplingParams()
    zero_back = common_pb2.SamplingParams.FromString(zero.SerializeToString())
    unset_back = common_pb2.SamplingParams.FromString(unset.SerializeToString())
    for name in ("temperature", "seed", "logprobs", "top_k"):
        assert zero_back.HasField(name), name
        assert getattr(zero_back, name) == 0
        assert not unset_back.HasField(name), name
    # A plain (non-optional) scalar has no presence: zero is indistinguishable from unset.
    assert common_pb2.SamplingParams(min_tokens=0).SerializeToString() == b""


def test_enums_match_domain() -> None:
    assert common_pb2.FINISH_REASON_UNSPECIFIED == 0
    for reason in FinishReason:
        assert common_pb2.FinishReason.Value(f"FINISH_REASON_{reason.name}") == reason.value
    assert len(common_pb2.FinishReason.values()) == len(FinishReason) + 1
    assert common_pb2.OUTPUT_KIND_UNSPECIFIED == 0
    for kind in RequestOutputKind:
        assert common_pb2.OutputKind.Value(f"OUTPUT_KIND_{kind.name}") == kind.value + 1


def test_repeated_scalars_are_packed() -> None:
    # 100 one-byte varints: packed is 1 tag + 1 length + 100 bytes, unpacked 200 bytes.
    msg = engine_pb2.EngineCoreOutput(new_token_ids=[1] * 100)
    assert msg.ByteSize() == 102


def test_every_file_names_one_documented_go_package() -> None:
    """Go users generate the contract without M mappings: one go_package, in every file,
    as docs/serving.md states it (buf's FILE_SAME_GO_PACKAGE asks the same)."""
    packages = {name: module.DESCRIPTOR.GetOptions().go_package for name, module in COMMITTED.items()}
    assert len(set(packages.values())) == 1 and all(packages.values()), packages
    go_package = next(iter(packages.values()))
    import_path, _, package_name = go_package.partition(";")
    assert import_path.endswith("/tandem/v1") and package_name == "tandemv1", go_package
    serving = " ".join((REPO_ROOT / "docs" / "serving.md").read_text().split())
    assert f'option go_package = "{go_package}"' in serving, "docs/serving.md does not state the go_package"
