"""Authentication, TLS and the admin surface (tandem/security.py, tandem/grpc_server.py).

In-process servers with stand-in servicers check the access rules cheaply; one real
engine + frontend pair checks them end to end: the engine requires mutual TLS, the
engine token and the admin token; the frontend serves TLS, reaches the engine with a
client certificate and the token, and has no admin token (admin RPCs on its loopback
admin port only).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from frontend_service.engine_client import EngineUnavailableError
from frontend_service.engine_group import EngineGroup
from tandem.grpc_server import BindError, MessageLimits, ServiceServer
from tandem.protocol import convert
from tandem.security import (
    ENGINE_TOKEN_HEADER,
    Access,
    EngineChannelSecurity,
    ServerSecurity,
    TlsFiles,
    access_of,
)
from tandem.v1 import common_pb2, engine_pb2, engine_pb2_grpc, frontend_pb2, frontend_pb2_grpc
from tests.e2e_helpers import (
    ADMIN_METADATA,
    ADMIN_TOKEN,
    ENGINE_ARGS,
    START_TIMEOUT,
    ServiceProcess,
    free_port,
    launch,
    tandem_command,
)
from tests.tls_certs import CertFiles, TestCA

pytestmark = pytest.mark.timeout(180)

ENGINE_TOKEN = "engine-secret"
LIMITS = MessageLimits(max_receive_bytes=1 << 20, max_send_bytes=1 << 20)
CALL_TIMEOUT = 30.0
ENGINE_SERVICE = "tandem.v1.EngineCore"
FRONTEND_SERVICE = "tandem.v1.Generation"


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def code_of(rpc: Callable[..., Any], *args: Any, **kwargs: Any) -> grpc.StatusCode:
    """The status code ``rpc(*args, **kwargs)`` (a sync gRPC call) ends with."""
    try:
        result = rpc(*args, **kwargs)
        if isinstance(result, Iterator):
            list(result)
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


# ---- in-process servers with stand-in servicers -----------------------------------------


class StubFrontend(frontend_pb2_grpc.GenerationServicer):
    def __init__(self) -> None:
        self.paused = False

    async def PauseGeneration(self, request, context):  # type: ignore[no-untyped-def]
        self.paused = True
        return frontend_pb2.PauseGenerationResponse()

    async def ResumeGeneration(self, request, context):  # type: ignore[no-untyped-def]
        self.paused = False
        return frontend_pb2.ResumeGenerationResponse()

    async def IsPaused(self, request, context):  # type: ignore[no-untyped-def]
        return frontend_pb2.IsPausedResponse(paused=self.paused)


class StubEngine(engine_pb2_grpc.EngineCoreServicer):
    def __init__(self) -> None:
        self.resets = 0
        self.streams = 0

    async def ResetPrefixCache(self, request, context):  # type: ignore[no-untyped-def]
        self.resets += 1
        return engine_pb2.ResetPrefixCacheResponse(success=True)

    async def GetEngineInfo(self, request, context):  # type: ignore[no-untyped-def]
        return engine_pb2.GetEngineInfoResponse(engine_index=7)

    async def Stream(self, request_iterator, context) -> AsyncIterator[engine_pb2.EngineCoreOutputs]:  # type: ignore[no-untyped-def,override]
        self.streams += 1
        async for _ in request_iterator:
            yield engine_pb2.EngineCoreOutputs(engine_index=7)


@dataclass
class Served:
    server: ServiceServer
    frontend: StubFrontend
    engine: StubEngine

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    @property
    def admin_address(self) -> str:
        return f"127.0.0.1:{self.server.admin_port}"


@contextlib.contextmanager
def serving(security: ServerSecurity, port: int = 0) -> Iterator[Served]:
    """A ServiceServer on its own event-loop thread with both stand-in servicers."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    frontend, engine = StubFrontend(), StubEngine()

    async def build() -> ServiceServer:
        server = ServiceServer("127.0.0.1", port, security, LIMITS)
        frontend_pb2_grpc.add_GenerationServicer_to_server(frontend, server)
        engine_pb2_grpc.add_EngineCoreServicer_to_server(engine, server)
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        server.enable_reflection((FRONTEND_SERVICE, ENGINE_SERVICE))
        await server.start()
        return server

    try:
        server = asyncio.run_coroutine_threadsafe(build(), loop).result(30)
        try:
            yield Served(server, frontend, engine)
        finally:
            asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(30)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def test_the_access_table_classes_operator_and_engine_rpcs() -> None:
    assert access_of("/tandem.v1.Generation/PauseGeneration") is Access.ADMIN
    assert access_of("/tandem.v1.Generation/ResumeGeneration") is Access.ADMIN
    assert access_of("/tandem.v1.FrontendAdmin/AddEngine") is Access.ADMIN
    assert access_of("/tandem.v1.EngineCore/ResetPrefixCache") is Access.ADMIN
    assert access_of("/tandem.v1.EngineCore/Stream") is Access.FRONTEND
    assert access_of("/tandem.v1.EngineCore/GetEngineInfo") is Access.FRONTEND
    for client in ("Generate", "GenerateSession", "Embed", "Abort", "Tokenize", "Detokenize", "GetModelInfo"):
        assert access_of(f"/tandem.v1.Generation/{client}") is Access.CLIENT  # --api-key, when set
    assert access_of("/tandem.v1.Generation/IsPaused") is Access.PUBLIC
    assert access_of("/grpc.health.v1.Health/Check") is Access.PUBLIC
    assert access_of("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo") is Access.PUBLIC


def test_admin_rpcs_need_the_admin_token_on_the_public_port() -> None:
    with serving(ServerSecurity(admin_token="s3cret")) as served, grpc.insecure_channel(served.address) as ch:
        front, engine = frontend_pb2_grpc.GenerationStub(ch), engine_pb2_grpc.EngineCoreStub(ch)
        pause = frontend_pb2.PauseGenerationRequest()
        reset = engine_pb2.ResetPrefixCacheRequest()
        for rpc, request in ((front.PauseGeneration, pause), (engine.ResetPrefixCache, reset)):
            assert code_of(rpc, request, timeout=CALL_TIMEOUT) == grpc.StatusCode.UNAUTHENTICATED
            basic = (("authorization", "Basic czNjcmV0"),)
            assert code_of(rpc, request, timeout=CALL_TIMEOUT, metadata=basic) == grpc.StatusCode.UNAUTHENTICATED
            wrong = bearer("s3cret-not")
            assert code_of(rpc, request, timeout=CALL_TIMEOUT, metadata=wrong) == grpc.StatusCode.PERMISSION_DENIED
        assert not served.frontend.paused and served.engine.resets == 0  # refused before the servicer
        front.PauseGeneration(pause, timeout=CALL_TIMEOUT, metadata=bearer("s3cret"))
        engine.ResetPrefixCache(reset, timeout=CALL_TIMEOUT, metadata=bearer("s3cret"))
        assert served.frontend.paused and served.engine.resets == 1
        # Public RPCs need nothing; IsPaused is public.
        assert front.IsPaused(frontend_pb2.IsPausedRequest(), timeout=CALL_TIMEOUT).paused
        front.ResumeGeneration(frontend_pb2.ResumeGenerationRequest(), timeout=CALL_TIMEOUT, metadata=bearer("s3cret"))
        assert not served.frontend.paused


def test_without_a_token_admin_rpcs_are_served_only_on_the_loopback_admin_port() -> None:
    security = ServerSecurity(admin_port=free_port())
    with serving(security) as served:
        with grpc.insecure_channel(served.address) as ch:
            front, engine = frontend_pb2_grpc.GenerationStub(ch), engine_pb2_grpc.EngineCoreStub(ch)
            for metadata in ((), bearer("anything")):
                with pytest.raises(grpc.RpcError) as refused:
                    front.PauseGeneration(frontend_pb2.PauseGenerationRequest(), timeout=CALL_TIMEOUT, metadata=metadata)
                assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
                assert "--admin-token" in refused.value.details()
                assert str(served.server.admin_port) in refused.value.details()
                reset = engine.ResetPrefixCache
                request = engine_pb2.ResetPrefixCacheRequest()
                code = code_of(reset, request, timeout=CALL_TIMEOUT, metadata=metadata)
                assert code == grpc.StatusCode.PERMISSION_DENIED
        assert not served.frontend.paused and served.engine.resets == 0
        with grpc.insecure_channel(served.admin_address) as ch:
            frontend_pb2_grpc.GenerationStub(ch).PauseGeneration(frontend_pb2.PauseGenerationRequest(), timeout=CALL_TIMEOUT)
            engine_pb2_grpc.EngineCoreStub(ch).ResetPrefixCache(engine_pb2.ResetPrefixCacheRequest(), timeout=CALL_TIMEOUT)
        assert served.frontend.paused and served.engine.resets == 1
        # The admin listener is bound to loopback only: this host's other address finds nothing.
        own_ip = socket.gethostbyname(socket.gethostname())
        if not own_ip.startswith("127."):
            with socket.socket() as sock:
                sock.settimeout(5)
                assert sock.connect_ex((own_ip, served.server.admin_port)) != 0


def test_engine_rpcs_need_the_engine_token_but_health_does_not() -> None:
    with serving(ServerSecurity(engine_token=ENGINE_TOKEN)) as served, grpc.insecure_channel(served.address) as ch:
        engine = engine_pb2_grpc.EngineCoreStub(ch)
        hello = convert.hello_input(0)

        def stream(metadata: tuple[tuple[str, str], ...]) -> grpc.StatusCode:
            return code_of(engine.Stream, iter([hello]), timeout=CALL_TIMEOUT, metadata=metadata)

        def info(metadata: tuple[tuple[str, str], ...]) -> grpc.StatusCode:
            return code_of(engine.GetEngineInfo, engine_pb2.GetEngineInfoRequest(), timeout=CALL_TIMEOUT, metadata=metadata)

        for rpc in (stream, info):
            assert rpc(()) == grpc.StatusCode.UNAUTHENTICATED
            assert rpc(((ENGINE_TOKEN_HEADER, "nope"),)) == grpc.StatusCode.PERMISSION_DENIED
            assert rpc(((ENGINE_TOKEN_HEADER, ENGINE_TOKEN),)) == grpc.StatusCode.OK
        assert served.engine.streams == 1
        # A bearer header is not the engine token.
        assert info(bearer(ENGINE_TOKEN)) == grpc.StatusCode.UNAUTHENTICATED
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=CALL_TIMEOUT)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_a_held_port_fails_the_bind_naming_the_address() -> None:
    admin_port = free_port()
    with serving(ServerSecurity(admin_port=admin_port)) as served:
        port = served.server.port
        with pytest.raises(BindError, match=f"127.0.0.1:{port}"), serving(ServerSecurity(), port=port):
            pass
        with pytest.raises(BindError, match=f"127.0.0.1:{admin_port}"), serving(ServerSecurity(admin_port=admin_port)):
            pass


def test_an_engine_on_a_held_port_exits_with_one_line_naming_it(tiny_llama_dir: str, tmp_path: Path) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        proc = launch(
            tandem_command("engine", "--model", tiny_llama_dir, "--host", "127.0.0.1", "--port", str(port),
                           "--metrics-port", "0", *ENGINE_ARGS),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )
        out, _ = proc.communicate(timeout=START_TIMEOUT)
    text = out.decode(errors="replace")
    assert proc.returncode == 1, text
    assert f"127.0.0.1:{port}" in text
    assert "Traceback" not in text


def _reflection_list(channel: grpc.Channel, service: str) -> set[str]:
    call = channel.stream_stream(
        f"/{service}/ServerReflectionInfo",
        request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
        response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
    )
    requests = [
        reflection_pb2.ServerReflectionRequest(list_services=""),
        reflection_pb2.ServerReflectionRequest(file_containing_symbol="grpc.reflection.v1.ServerReflection"),
    ]
    listed, described = list(call(iter(requests), timeout=CALL_TIMEOUT))
    assert described.WhichOneof("message_response") == "file_descriptor_response", described
    return {s.name for s in listed.list_services_response.service}


def test_reflection_v1_and_v1alpha_list_the_services() -> None:
    with serving(ServerSecurity()) as served, grpc.insecure_channel(served.address) as ch:
        expected = {
            FRONTEND_SERVICE, ENGINE_SERVICE, "grpc.health.v1.Health",
            "grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection",
        }
        assert _reflection_list(ch, "grpc.reflection.v1.ServerReflection") == expected
        assert _reflection_list(ch, "grpc.reflection.v1alpha.ServerReflection") == expected
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        (reply,) = stub.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(file_containing_symbol=ENGINE_SERVICE)]), timeout=CALL_TIMEOUT
        )
        assert reply.file_descriptor_response.file_descriptor_proto


# ---- a real engine (mTLS, engine token, admin token) and frontend (TLS) ------------------


@dataclass
class Pki:
    ca: TestCA
    other_ca: TestCA
    engine: CertFiles
    frontend: CertFiles
    client: CertFiles
    stranger: CertFiles  # signed by other_ca

    def credentials(self, files: CertFiles | None, ca: TestCA | None = None) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=(ca or self.ca).ca_path.read_bytes(),
            private_key=files.key.read_bytes() if files else None,
            certificate_chain=files.cert.read_bytes() if files else None,
        )


@dataclass
class SecureStack:
    pki: Pki
    engine: ServiceProcess  # .address: the engine's plain-text admin port (health polling)
    engine_address: str  # its mutual-TLS public port
    frontend: ServiceProcess  # .address: the frontend's admin port
    frontend_address: str  # its TLS public port
    health_addresses: tuple[str, str]  # engine's, frontend's plain-text health ports


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    directory = tmp_path_factory.mktemp("pki")
    ca, other = TestCA(directory, "tandem-ca"), TestCA(directory, "other-ca")
    return Pki(ca, other, ca.issue("engine"), ca.issue("frontend"), ca.issue("client"), other.issue("stranger"))


@pytest.fixture(scope="module")
def secure_stack(pki: Pki, tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureStack]:
    logs = tmp_path_factory.mktemp("secure_stack_logs")
    engine_port, engine_admin, front_port, front_admin, engine_health, front_health = (
        free_port() for _ in range(6)
    )
    engine = ServiceProcess.spawn(
        "engine",
        ["engine", "--model", tiny_llama_dir, "--host", "127.0.0.1", "--port", str(engine_port),
         "--metrics-port", "0", "--admin-port", str(engine_admin), "--health-port", str(engine_health),
         *ENGINE_ARGS],
        f"127.0.0.1:{engine_admin}", logs,
        env={"TANDEM_TLS_CERT": str(pki.engine.cert), "TANDEM_TLS_KEY": str(pki.engine.key),
             "TANDEM_TLS_CA": str(pki.ca.ca_path), "TANDEM_ENGINE_TOKEN": ENGINE_TOKEN},
    )
    frontend = ServiceProcess.spawn(
        "frontend",
        ["frontend", "--model", tiny_llama_dir, "--host", "127.0.0.1", "--port", str(front_port),
         "--metrics-port", "0", "--http-port", "0", "--admin-port", str(front_admin),
         "--health-port", str(front_health),
         "--engine", f"127.0.0.1:{engine_port}",
         "--connect-timeout", str(START_TIMEOUT),
         "--tls-cert", str(pki.frontend.cert), "--tls-key", str(pki.frontend.key),
         "--engine-tls-ca", str(pki.ca.ca_path), "--engine-tls-cert", str(pki.frontend.cert),
         "--engine-tls-key", str(pki.frontend.key)],
        f"127.0.0.1:{front_admin}", logs,
        env={"TANDEM_ENGINE_TOKEN": ENGINE_TOKEN, "TANDEM_ADMIN_TOKEN": ""},
    )
    try:
        engine.wait_serving()
        frontend.wait_serving()
        yield SecureStack(
            pki, engine, f"127.0.0.1:{engine_port}", frontend, f"127.0.0.1:{front_port}",
            (f"127.0.0.1:{engine_health}", f"127.0.0.1:{front_health}"),
        )
    finally:
        for proc in (frontend, engine):
            with contextlib.suppress(Exception):
                proc.stop()


def test_a_frontend_with_the_right_certificate_and_token_generates_end_to_end(secure_stack: SecureStack) -> None:
    pki = secure_stack.pki
    with grpc.secure_channel(secure_stack.frontend_address, pki.credentials(None)) as ch:
        request = frontend_pb2.GenerateRequest(
            prompt="The quick brown fox",
            sampling_params=common_pb2.SamplingParams(
                max_tokens=8, temperature=0.0, ignore_eos=True, output_kind=common_pb2.OUTPUT_KIND_DELTA
            ),
        )
        replies = list(frontend_pb2_grpc.GenerationStub(ch).Generate(request, timeout=CALL_TIMEOUT * 2))
    tokens = [t for r in replies for c in r.outputs for t in c.token_ids]
    assert len(tokens) == 8
    # The frontend's public port speaks TLS only.
    with grpc.insecure_channel(secure_stack.frontend_address) as ch:
        check = health_pb2_grpc.HealthStub(ch).Check
        assert code_of(check, health_pb2.HealthCheckRequest(), timeout=5) == grpc.StatusCode.UNAVAILABLE


def test_a_mutual_tls_engine_refuses_clients_without_a_certificate_from_its_ca(secure_stack: SecureStack) -> None:
    pki, address = secure_stack.pki, secure_stack.engine_address
    info = engine_pb2.GetEngineInfoRequest()
    token = ((ENGINE_TOKEN_HEADER, ENGINE_TOKEN),)
    channels = {
        "plain text": grpc.insecure_channel(address),
        "TLS without a client certificate": grpc.secure_channel(address, pki.credentials(None)),
        "a certificate from another CA": grpc.secure_channel(address, pki.credentials(pki.stranger)),
    }
    try:
        for what, ch in channels.items():
            call = engine_pb2_grpc.EngineCoreStub(ch).GetEngineInfo
            assert code_of(call, info, timeout=10, metadata=token) == grpc.StatusCode.UNAVAILABLE, what
    finally:
        for ch in channels.values():
            ch.close()
    with grpc.secure_channel(address, pki.credentials(pki.client)) as ch:
        stub = engine_pb2_grpc.EngineCoreStub(ch)
        assert stub.GetEngineInfo(info, timeout=CALL_TIMEOUT, metadata=token).max_model_len > 0
        # Certified, but without (or with a wrong) engine token: no Stream.
        hello = convert.hello_input(5)
        assert code_of(stub.Stream, iter([hello]), timeout=CALL_TIMEOUT) == grpc.StatusCode.UNAUTHENTICATED
        wrong = ((ENGINE_TOKEN_HEADER, "guess"),)
        assert code_of(stub.Stream, iter([hello]), timeout=CALL_TIMEOUT, metadata=wrong) == grpc.StatusCode.PERMISSION_DENIED


@pytest.mark.parametrize(("token", "code"), [("", "UNAUTHENTICATED"), ("wrong", "PERMISSION_DENIED")])
def test_a_frontend_without_the_engine_token_cannot_connect(secure_stack: SecureStack, token: str, code: str) -> None:
    pki = secure_stack.pki
    channel = EngineChannelSecurity(
        TlsFiles(str(pki.client.cert), str(pki.client.key), str(pki.ca.ca_path), flag_prefix="--engine-tls"),
        engine_token=token,
    )

    async def connect() -> None:
        group = EngineGroup([secure_stack.engine_address], 3, lambda e, o: None, lambda e, r: None, channel=channel)
        try:
            await group.connect("", timeout=10)
        finally:
            await group.close()

    with pytest.raises(EngineUnavailableError, match=code):
        asyncio.run(connect())


def test_engine_reset_prefix_cache_needs_the_admin_token(secure_stack: SecureStack) -> None:
    pki = secure_stack.pki
    token = ((ENGINE_TOKEN_HEADER, ENGINE_TOKEN),)
    with grpc.secure_channel(secure_stack.engine_address, pki.credentials(pki.client)) as ch:
        reset = engine_pb2_grpc.EngineCoreStub(ch).ResetPrefixCache
        request = engine_pb2.ResetPrefixCacheRequest()
        assert code_of(reset, request, timeout=CALL_TIMEOUT, metadata=token) == grpc.StatusCode.UNAUTHENTICATED
        wrong = (*token, *bearer("not-" + ADMIN_TOKEN))
        assert code_of(reset, request, timeout=CALL_TIMEOUT, metadata=wrong) == grpc.StatusCode.PERMISSION_DENIED
        # The admin token alone suffices: ResetPrefixCache is an admin RPC, not a frontend one.
        assert reset(request, timeout=CALL_TIMEOUT, metadata=ADMIN_METADATA).success


def test_frontend_pause_is_refused_publicly_without_a_token_and_served_on_its_admin_port(
    secure_stack: SecureStack,
) -> None:
    pki = secure_stack.pki
    with grpc.secure_channel(secure_stack.frontend_address, pki.credentials(None)) as public:
        stub = frontend_pb2_grpc.GenerationStub(public)
        pause = stub.PauseGeneration
        assert code_of(pause, frontend_pb2.PauseGenerationRequest(), timeout=CALL_TIMEOUT) == grpc.StatusCode.PERMISSION_DENIED
        assert not stub.IsPaused(frontend_pb2.IsPausedRequest(), timeout=CALL_TIMEOUT).paused
        with grpc.insecure_channel(secure_stack.frontend.address) as admin:
            admin_stub = frontend_pb2_grpc.GenerationStub(admin)
            admin_stub.PauseGeneration(frontend_pb2.PauseGenerationRequest(), timeout=CALL_TIMEOUT)
            try:
                assert stub.IsPaused(frontend_pb2.IsPausedRequest(), timeout=CALL_TIMEOUT).paused
            finally:
                admin_stub.ResumeGeneration(frontend_pb2.ResumeGenerationRequest(), timeout=CALL_TIMEOUT)
        assert not stub.IsPaused(frontend_pb2.IsPausedRequest(), timeout=CALL_TIMEOUT).paused


def test_reflection_v1_on_a_real_engine(secure_stack: SecureStack) -> None:
    with grpc.insecure_channel(secure_stack.engine.address) as ch:
        listed = _reflection_list(ch, "grpc.reflection.v1.ServerReflection")
    assert {ENGINE_SERVICE, "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection"} <= listed


def test_the_frontend_channel_sends_the_engine_token_on_every_call_shape() -> None:
    with serving(ServerSecurity(engine_token=ENGINE_TOKEN)) as served:

        async def calls() -> tuple[int, int]:
            channel = EngineChannelSecurity(engine_token=ENGINE_TOKEN).open_channel(served.address, [])
            try:
                stub = engine_pb2_grpc.EngineCoreStub(channel)
                info = await stub.GetEngineInfo(engine_pb2.GetEngineInfoRequest(), timeout=CALL_TIMEOUT)
                replies = [m async for m in stub.Stream(iter([convert.hello_input(0)]), timeout=CALL_TIMEOUT)]
                return info.engine_index, len(replies)
            finally:
                await channel.close()

        assert asyncio.run(calls()) == (7, 1)


def test_the_plain_text_health_port_serves_health_and_nothing_else(secure_stack: SecureStack) -> None:
    """For probes that cannot speak TLS (Kubernetes' gRPC probes)."""
    serving = health_pb2.HealthCheckResponse.SERVING
    for address in secure_stack.health_addresses:
        with grpc.insecure_channel(address) as ch:
            check = health_pb2_grpc.HealthStub(ch).Check
            for service in ("", "liveness", "readiness"):
                assert check(health_pb2.HealthCheckRequest(service=service), timeout=10).status == serving
            info = engine_pb2_grpc.EngineCoreStub(ch).GetEngineInfo
            assert code_of(info, engine_pb2.GetEngineInfoRequest(), timeout=10) == grpc.StatusCode.UNIMPLEMENTED
            generate = frontend_pb2_grpc.GenerationStub(ch).Tokenize
            assert code_of(generate, frontend_pb2.TokenizeRequest(prompt="x"), timeout=10) == (
                grpc.StatusCode.UNIMPLEMENTED
            )
