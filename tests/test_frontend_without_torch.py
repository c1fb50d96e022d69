"""The frontend runs where torch is not installed (``pip install tandem``, no ``engine`` extra).

No virtualenv is built and nothing is downloaded: the test lays out a site directory of
symlinks to exactly the distributions that ``pip install tandem`` would install, the base
``dependencies`` of pyproject.toml and what they require in turn, taken from the current
environment's installed metadata. Python runs with ``-S`` (no site-packages) and
``PYTHONPATH=<that dir>:<repo root>``, so torch, triton and everything else outside the
base install genuinely cannot be imported, and transformers sees no torch either. In that
environment the frontend imports, and a real frontend serves Generate and Tokenize for a
real engine started normally; its answers match those of a frontend in the full install.
"""

from __future__ import annotations

import http.client
import importlib.metadata
import json
import os
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tandem.v1 import common_pb2, frontend_pb2, frontend_pb2_grpc
from tests.e2e_helpers import (
    REPO_ROOT,
    START_TIMEOUT,
    ServiceProcess,
    free_port,
    launch,
    start_engine,
    start_frontend,
)

pytest_plugins = ["tests.e2e_helpers"]
pytestmark = pytest.mark.timeout(300)

# Distributions only the engine needs: none may be reachable from the frontend's install.
ENGINE_ONLY = ("torch", "triton", "ninja")
CALL_TIMEOUT = 60.0
TORCH_FREE_HTTP_PORT = [free_port()]  # the torch-free frontend's OpenAI-compatible API


def base_requirements() -> list[Requirement]:
    """pyproject.toml's [project] dependencies: what `pip install tandem` installs."""
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    return [Requirement(r) for r in project["dependencies"]]


def install_closure(roots: list[Requirement]) -> dict[str, importlib.metadata.Distribution]:
    """The installed distributions that ``roots`` pull in (markers evaluated, no extras)."""
    found: dict[str, importlib.metadata.Distribution] = {}
    todo = list(roots)
    while todo:
        req = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = canonicalize_name(req.name)
        if name in found:
            continue
        try:
            dist = importlib.metadata.distribution(req.name)
        except importlib.metadata.PackageNotFoundError:
            raise AssertionError(f"{req.name} (required by the base install) is not installed") from None
        assert req.specifier.contains(dist.version, prereleases=True), f"{req} but {dist.version} installed"
        found[name] = dist
        todo += [Requirement(r) for r in dist.requires or []]
    return found


def link_site(dists: dict[str, importlib.metadata.Distribution], site: Path) -> None:
    """Symlink every top-level entry (packages, modules, .dist-info) the dists installed."""
    site.mkdir(parents=True, exist_ok=True)
    for dist in dists.values():
        for file in dist.files or []:
            top = file.parts[0]
            if top in {"..", "__pycache__"} or top.endswith(".pth"):  # scripts; bytecode; hooks
                continue
            link = site / top
            if not link.exists():
                link.symlink_to(Path(str(dist.locate_file(top))))


@pytest.fixture(scope="module")
def frontend_install(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Environment variables that make ``python -S`` see only the frontend's install."""
    dists = install_closure(base_requirements())
    pulled_in = sorted(set(dists) & {canonicalize_name(n) for n in ENGINE_ONLY})
    assert not pulled_in, f"the base install pulls in engine-only packages: {pulled_in}"
    site = tmp_path_factory.mktemp("frontend_site")
    link_site(dists, site)
    return {"PYTHONPATH": os.pathsep.join([str(site), str(REPO_ROOT)]), "PYTHONNOUSERSITE": "1"}


def run_python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-S", "-c", code], env={**os.environ, **env}, cwd=REPO_ROOT,
        capture_output=True, text=True, timeout=120,
    )


# ---- the import graph ---------------------------------------------------------------------


def test_torch_is_not_importable_there(frontend_install: dict[str, str]) -> None:
    proc = run_python(
        "import importlib.metadata as m, importlib.util as u\n"
        f"for name in {ENGINE_ONLY!r}:\n"
        "    assert u.find_spec(name) is None, name\n"
        "    try:\n"
        "        m.distribution(name)\n"
        "    except m.PackageNotFoundError:\n"
        "        continue\n"
        "    raise AssertionError(name + ' metadata visible')\n"
        "from transformers.utils import is_torch_available\n"
        "assert not is_torch_available()\n",
        frontend_install,
    )
    assert proc.returncode == 0, proc.stderr


def test_frontend_imports_without_torch(frontend_install: dict[str, str]) -> None:
    proc = run_python(
        "import sys\n"
        "import frontend_service.server, frontend_service.async_llm, tandem.protocol.convert\n"
        "from tandem.cli import build_parser\n"
        "sub = build_parser()._subparsers._group_actions[0].choices\n"
        "assert 'torch' not in sys.modules\n"
        "print(' '.join(sorted(sub)))\n",
        frontend_install,
    )
    assert proc.returncode == 0, proc.stderr
    # The engine's subcommands need torch; the frontend's and the client's do not.
    subcommands = set(proc.stdout.split())
    assert {"frontend", "generate"} <= subcommands
    assert not subcommands & {"engine", "run", "make-model"}, subcommands


def test_frontend_imports_no_torch_in_the_full_install() -> None:
    """With torch installed, importing the frontend still leaves it unloaded."""
    proc = subprocess.run(
        [sys.executable, "-c", "import frontend_service.server, sys; assert 'torch' not in sys.modules"],
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, cwd=REPO_ROOT,
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr


def test_a_gguf_file_is_read_without_torch(frontend_install: dict[str, str], tmp_path: Path) -> None:
    """The frontend reads a GGUF file's config, tokenizer and chat template from its metadata
    in the torch-free install; the result equals the full install's (transformers' own GGUF
    tokenizer, which needs torch there)."""
    from tandem.model_source import default_model_file

    gguf_file = default_model_file()
    code = (
        "import sys, json\n"
        "from tandem.model_source import resolve_model\n"
        "from transformers import AutoTokenizer\n"
        f"d = resolve_model({gguf_file!r})\n"
        "tok = AutoTokenizer.from_pretrained(d)\n"
        "assert 'torch' not in sys.modules\n"
        "msgs = [{'role': 'user', 'content': 'What is the capital of France?'}]\n"
        "print(json.dumps([tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),\n"
        "                  tok.encode('The capital of France is Paris.'), json.load(open(d + '/config.json'))]))\n"
    )
    proc = run_python(code, {**frontend_install, "TANDEM_CACHE_DIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    rendered, ids, config = json.loads(proc.stdout)
    from transformers import AutoTokenizer

    folder, name = os.path.split(gguf_file)
    theirs = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    assert rendered == theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ids == theirs.encode("The capital of France is Paris.")
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_hidden_layers"] == 30


# ---- a real frontend, end to end ------------------------------------------------------------


def start_torch_free_frontend(
    model_dir: str, engine: str, log_dir: Path, env: dict[str, str], http_port: int = 0
) -> ServiceProcess:
    port = free_port()
    argv = [
        sys.executable, "-S", "-m", "tandem.cli", "frontend", "--model", model_dir,
        "--engine", engine, "--host", "127.0.0.1", "--port", str(port),
        "--connect-timeout", str(START_TIMEOUT), "--metrics-port", "0", "--http-port", str(http_port),
    ]
    log_path = log_dir / "frontend-no-torch.log"
    with open(log_path, "wb") as log:
        proc = launch(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    return ServiceProcess("frontend-no-torch", proc, f"127.0.0.1:{port}", log_path)


@pytest.fixture(scope="module")
def frontends(
    tiny_llama_dir: str, frontend_install: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ServiceProcess, ServiceProcess, ServiceProcess]]:
    """(torch-free frontend, full-install frontend, their engine)."""
    log_dir = tmp_path_factory.mktemp("no_torch_logs")
    started: list[ServiceProcess] = []
    try:
        engine = start_engine(tiny_llama_dir, 0, log_dir)
        started.append(engine)
        started.append(start_torch_free_frontend(
            tiny_llama_dir, engine.address, log_dir, frontend_install, http_port=TORCH_FREE_HTTP_PORT[0]
        ))
        started.append(start_frontend(tiny_llama_dir, [engine.address], log_dir))
        for proc in started:
            proc.wait_serving()
        yield started[1], started[2], engine
    finally:
        for proc in reversed(started):
            proc.stop()


def _mapped_files(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux /proc to list mapped libraries")
def test_serving_frontend_has_no_torch_loaded(
    frontends: tuple[ServiceProcess, ServiceProcess, ServiceProcess],
) -> None:
    torch_free, _, engine = frontends
    assert "libtorch" in _mapped_files(engine.proc.pid)  # what a process with torch maps
    assert "libtorch" not in _mapped_files(torch_free.proc.pid)


def _greedy(max_tokens: int) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(
        output_kind=common_pb2.OUTPUT_KIND_DELTA, temperature=0.0, max_tokens=max_tokens, ignore_eos=True
    )


def _generate(stub: frontend_pb2_grpc.GenerationStub, request: frontend_pb2.GenerateRequest) -> tuple[list[int], list[int], str]:
    """(prompt ids, generated ids, generated text) of one streamed Generate call."""
    responses = list(stub.Generate(request, timeout=CALL_TIMEOUT))
    assert responses and responses[-1].finished
    ids = [t for r in responses for o in r.outputs for t in o.token_ids]
    text = "".join(o.text for r in responses for o in r.outputs)
    return list(responses[0].prompt_token_ids), ids, text


def test_torch_free_frontend_serves_like_the_full_one(
    frontends: tuple[ServiceProcess, ServiceProcess, ServiceProcess],
) -> None:
    chat = frontend_pb2.ChatMessages(messages=[
        frontend_pb2.ChatMessage(role="system", content="You are terse."),
        frontend_pb2.ChatMessage(role="user", content="Say hello in two words."),
    ])
    requests = [
        frontend_pb2.GenerateRequest(prompt="The quick brown fox jumps over", sampling_params=_greedy(16)),
        frontend_pb2.GenerateRequest(chat=chat, sampling_params=_greedy(8)),
    ]
    tokenizes = [
        frontend_pb2.TokenizeRequest(prompt="Tokenize me, héllo wörld", return_token_strings=True),
        frontend_pb2.TokenizeRequest(chat=chat, add_generation_prompt=True),
    ]
    answers = []
    for proc in frontends[:2]:
        with grpc.insecure_channel(proc.address) as channel:
            stub = frontend_pb2_grpc.GenerationStub(channel)
            generated = [_generate(stub, r) for r in requests]
            tokenized = [stub.Tokenize(r, timeout=CALL_TIMEOUT) for r in tokenizes]
            answers.append((generated, tokenized))
    (torch_free_gen, torch_free_tok), (full_gen, full_tok) = answers
    for (prompt_ids, ids, text), (want_prompt, want_ids, want_text), max_tokens in zip(
        torch_free_gen, full_gen, (16, 8)
    ):
        assert len(ids) == max_tokens and text
        assert (prompt_ids, ids, text) == (want_prompt, want_ids, want_text)
    for got, want in zip(torch_free_tok, full_tok):
        assert got.token_ids and got == want
    assert len(torch_free_tok[0].token_strings) == len(torch_free_tok[0].token_ids)
    # The chat's rendered prompt is what Generate placed on the engine.
    assert list(torch_free_tok[1].token_ids) == torch_free_gen[1][0]


def test_torch_free_frontend_serves_http(
    frontends: tuple[ServiceProcess, ServiceProcess, ServiceProcess],
) -> None:
    """The OpenAI-compatible API runs on the base install too, with the gRPC answer's text."""
    conn = http.client.HTTPConnection("127.0.0.1", TORCH_FREE_HTTP_PORT[0], timeout=CALL_TIMEOUT)
    try:
        conn.request("GET", "/health")
        health = conn.getresponse()
        health.read()
        assert health.status == 200
        body = {"prompt": "The quick brown fox jumps over", "max_tokens": 16, "temperature": 0,
                "ignore_eos": True}
        conn.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
        reply = conn.getresponse()
        completion = json.loads(reply.read())
    finally:
        conn.close()
    assert reply.status == 200, completion
    with grpc.insecure_channel(frontends[1].address) as channel:
        request = frontend_pb2.GenerateRequest(prompt=body["prompt"], sampling_params=_greedy(16))
        _, _, text = _generate(frontend_pb2_grpc.GenerationStub(channel), request)
    assert completion["choices"][0]["text"] == text
