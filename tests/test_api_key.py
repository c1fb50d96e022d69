"""``--api-key`` (vLLM's): clients of the OpenAI HTTP API and of the gRPC Generation
service must send ``Authorization: Bearer <key>``; health, /metrics, reflection and
IsPaused stay open; admin RPCs keep their own token (tandem/security.py).

One ``tandem serve --frontends 2`` for the module, with two keys given as a repeated flag
(which replaces the env var TANDEM_API_KEY it also gets): the extra frontend process gets
them through its environment, as a comma-separated TANDEM_API_KEY. Requests go out on
fresh connections, so the kernel spreads them over both frontends.
"""

from __future__ import annotations

import http.client
import json
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from benchmarks.split_cost import cmdline, descendants
from tandem.cli import build_parser
from tandem.security import ApiKeys, parse_api_keys
from tandem.serve import engine_env, frontend_processes
from tandem.v1 import common_pb2, frontend_pb2, frontend_pb2_grpc
from tests.e2e_helpers import (
    ADMIN_METADATA,
    ENGINE_ARGS,
    START_TIMEOUT,
    ServiceProcess,
    child_env,
    free_port,
    tandem_command,
)

pytestmark = pytest.mark.timeout(180)

KEYS = ("key-one", "key-two")
ENV_KEY = "ignored-key"  # serve's TANDEM_API_KEY, replaced by its --api-key flags
CALL_TIMEOUT = 60.0
FRESH = [("grpc.use_local_subchannel_pool", 1)]  # a connection of its own per channel


def bearer(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


@dataclass
class Served:
    proc: ServiceProcess
    http_port: int
    model: str

    @property
    def address(self) -> str:
        return self.proc.address

    def openai(self, key: str) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"http://127.0.0.1:{self.http_port}/v1",
            api_key=key,
            timeout=CALL_TIMEOUT,
            max_retries=0,
        )

    def http(
        self, method: str, path: str, headers: dict[str, str] | None = None
    ) -> tuple[int, bytes, dict[str, str]]:
        conn = http.client.HTTPConnection("127.0.0.1", self.http_port, timeout=CALL_TIMEOUT)
        try:
            body = json.dumps({"prompt": "Hi"}) if method == "POST" else None
            conn.request(
                method, path, body, {"content-type": "application/json", **(headers or {})}
            )
            reply = conn.getresponse()
            return reply.status, reply.read(), {k.lower(): v for k, v in reply.getheaders()}
        finally:
            conn.close()


@pytest.fixture(scope="module")
def served(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    port, http_port = free_port(), free_port()
    # fmt: off
    args = [
        "serve", "--model", tiny_llama_dir, "--frontends", "2", "--host", "127.0.0.1", "--port", str(port),
        "--http-port", str(http_port), "--metrics-port", "0", "--admin-port", "0",
        "--engine-base-port", str(free_port()), "--engine-metrics-base-port", "0",
        "--api-key", KEYS[0], "--api-key", KEYS[1], "--", *ENGINE_ARGS,
    ]
    # fmt: on
    proc = ServiceProcess.spawn(
        "serve",
        args,
        f"127.0.0.1:{port}",
        tmp_path_factory.mktemp("api_key"),
        env={"TANDEM_API_KEY": ENV_KEY},
    )
    try:
        proc.wait_serving(2 * START_TIMEOUT)
        yield Served(proc, http_port, tiny_llama_dir)
    finally:
        proc.stop(timeout=90)


def generate(address: str, metadata: tuple[tuple[str, str], ...] = ()) -> grpc.StatusCode:
    request = frontend_pb2.GenerateRequest(
        prompt="Hi",
        sampling_params=common_pb2.SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
    )
    with grpc.insecure_channel(address, options=FRESH) as channel:
        try:
            replies = list(
                frontend_pb2_grpc.GenerationStub(channel).Generate(
                    request, timeout=CALL_TIMEOUT, metadata=metadata
                )
            )
        except grpc.RpcError as exc:
            return exc.code()
    assert replies[-1].finished
    return grpc.StatusCode.OK


# ---- the OpenAI HTTP API -------------------------------------------------------------------


def test_the_openai_sdk_is_refused_without_a_right_key_and_served_with_either(
    served: Served,
) -> None:
    for key in ("wrong", ENV_KEY, KEYS[0] + "x") * 2:
        with pytest.raises(openai.AuthenticationError) as refused:
            served.openai(key).completions.create(model=served.model, prompt="Hi", max_tokens=2)
        assert refused.value.status_code == 401
    for key in KEYS * 3:  # a fresh client, a fresh connection, each time
        reply = served.openai(key).completions.create(model=served.model, prompt="Hi", max_tokens=2)
        assert reply.choices[0].finish_reason in ("length", "stop")
    assert served.openai(KEYS[1]).models.list().data


def test_a_refusal_is_a_401_in_openai_error_shape(served: Served) -> None:
    for headers in ({}, {"authorization": "Basic a2V5LW9uZQ=="}, {"authorization": "Bearer nope"}):
        for method, path in (
            ("POST", "/v1/completions"),
            ("GET", "/v1/models"),
            ("POST", "/tokenize"),
        ):
            status, body, reply_headers = served.http(method, path, headers)
            assert status == 401, (method, path, headers, body)
            error = json.loads(body)["error"]
            assert (
                error["type"] == "authentication_error"
                and error["code"] == 401
                and error["message"]
            )
            assert reply_headers["www-authenticate"] == "Bearer"
    status, body, _ = served.http("POST", "/tokenize", {"authorization": f"bearer {KEYS[0]}"})
    assert status == 200 and json.loads(body)["count"] > 0


def test_health_and_metrics_need_no_key(served: Served) -> None:
    for _ in range(4):
        assert served.http("GET", "/health")[0] == 200
        status, body, _ = served.http("GET", "/metrics")
        assert status == 200 and b"tandem:" in body


# ---- gRPC ----------------------------------------------------------------------------------


def test_grpc_generate_needs_the_key(served: Served) -> None:
    for _ in range(4):
        assert generate(served.address) == grpc.StatusCode.UNAUTHENTICATED
        assert generate(served.address, bearer("wrong")) == grpc.StatusCode.UNAUTHENTICATED
        admin_token = generate(served.address, ADMIN_METADATA)  # not an API key
        assert admin_token == grpc.StatusCode.UNAUTHENTICATED
    for key in KEYS * 4:
        assert generate(served.address, bearer(key)) == grpc.StatusCode.OK


def test_grpc_open_and_admin_rpcs_keep_their_own_rules(served: Served) -> None:
    with grpc.insecure_channel(served.address, options=FRESH) as channel:
        front = frontend_pb2_grpc.GenerationStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            front.Tokenize(frontend_pb2.TokenizeRequest(prompt="Hi"), timeout=CALL_TIMEOUT)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert front.Tokenize(
            frontend_pb2.TokenizeRequest(prompt="Hi"),
            timeout=CALL_TIMEOUT,
            metadata=bearer(KEYS[1]),
        )
        # Open: health (probes) and IsPaused (load balancers).
        check = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=CALL_TIMEOUT
        )
        assert check.status == health_pb2.HealthCheckResponse.SERVING
        assert not front.IsPaused(frontend_pb2.IsPausedRequest(), timeout=CALL_TIMEOUT).paused
        # Admin RPCs: the admin token (the e2e children's TANDEM_ADMIN_TOKEN), not an API key.
        admin = frontend_pb2_grpc.FrontendAdminStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            admin.ListEngines(
                frontend_pb2.ListEnginesRequest(), timeout=CALL_TIMEOUT, metadata=bearer(KEYS[0])
            )
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert admin.ListEngines(
            frontend_pb2.ListEnginesRequest(), timeout=CALL_TIMEOUT, metadata=ADMIN_METADATA
        )


def test_the_keys_reach_the_extra_frontend_by_environment_not_argv(served: Served) -> None:
    children = [cmdline(pid) for pid in descendants(served.proc.proc.pid)]
    frontends = [argv for argv in children if "frontend" in argv]
    assert len(frontends) == 1, children
    assert not {"--api-key", *KEYS} & set(frontends[0])
    assert all(key not in " ".join(argv) for argv in children for key in KEYS)


def test_tandem_generate_sends_the_key(served: Served) -> None:
    def run(*flags: str, env_key: str) -> subprocess.CompletedProcess[str]:
        env = {**child_env(), "TANDEM_API_KEY": env_key}
        argv = tandem_command(
            "generate", "Hi", "--target", served.address, "--max-tokens", "2", *flags
        )
        return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=CALL_TIMEOUT)

    ok = run(env_key=f"{KEYS[1]},unused")  # the first key of the list is sent
    assert ok.returncode == 0, ok.stderr
    assert "completion tokens]" in ok.stdout
    refused = run("--api-key", "wrong", env_key=KEYS[0])  # the flag wins over the env var
    assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr


# ---- the rule, without sockets -------------------------------------------------------------


def test_keys_come_from_the_flags_else_the_env_var_each_comma_separated() -> None:
    assert parse_api_keys(None, "") == ApiKeys()
    assert not parse_api_keys(None, " , ")
    assert parse_api_keys(None, "a, b,,c ").keys == ("a", "b", "c")
    assert parse_api_keys(["x", "y,z"], "a,b").keys == ("x", "y", "z")
    keys = ApiKeys(("a", "b"))
    assert (
        keys.refusal(None) == keys.refusal("") == keys.refusal("Basic a") == keys.refusal("Bearer ")
    )
    assert keys.refusal(None)[0] == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[index]
    assert keys.refusal("Bearer c")[0] == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[index]
    assert keys.refusal("Bearer a") is keys.refusal("bearer  b ") is None
    assert ApiKeys().refusal(None) is None


def test_serve_hands_the_keys_to_frontends_by_env_and_keeps_them_from_engines(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TANDEM_API_KEY", "from-env")
    parser = build_parser(["serve"])
    args = parser.parse_args(["serve", "--frontends", "2", "--api-key", "k1,k2", "--api-key", "k3"])
    (child,) = frontend_processes(args, "/model", ["127.0.0.1:1"])
    assert child.env["TANDEM_API_KEY"] == "k1,k2,k3"
    assert not {"k1", "k2", "k3", "k1,k2"} & set(child.argv)
    assert "TANDEM_API_KEY" not in engine_env(args)
    # Without the flag, the env var's keys go on as they are; an empty flag is refused.
    (child,) = frontend_processes(
        parser.parse_args(["serve", "--frontends", "2"]), "/model", ["127.0.0.1:1"]
    )
    assert child.env["TANDEM_API_KEY"] == "from-env"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--api-key", " "])
    monkeypatch.delenv("TANDEM_API_KEY")
    (child,) = frontend_processes(
        parser.parse_args(["serve", "--frontends", "2"]), "/model", ["127.0.0.1:1"]
    )
    assert "TANDEM_API_KEY" not in child.env
