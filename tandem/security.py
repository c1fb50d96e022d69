"""Who may call what: TLS material, bearer tokens, and the one interceptor that checks them.

Torch-free; both services use it. Every RPC has an ``Access`` class, looked up in
``METHOD_ACCESS`` (one table, by full method or by service):

- ``PUBLIC``: anyone who can reach the port (health, reflection, IsPaused).
- ``CLIENT``: the client API (Generate, Tokenize...). With ``--api-key`` it needs
  ``authorization: Bearer <one of the keys>``, as the HTTP API does (``ApiKeys.refusal``,
  the one rule of both edges); without, anyone.
- ``ADMIN``: operators. On the public port only with ``authorization: Bearer <admin token>``
  when ``--admin-token`` is set, and refused there when it is not; on the loopback
  ``--admin-port`` listener always allowed (it trusts every local process).
- ``FRONTEND``: the engine's Stream and GetEngineInfo, for frontends only, and the
  KvTransfer service, for other engines (they present the same credentials). With
  ``--engine-token`` set they need ``x-tandem-engine-token: <token>``; with ``--tls-ca``
  the TLS handshake already refused any client without a certificate signed by that CA.

Missing credentials answer UNAUTHENTICATED, wrong tokens PERMISSION_DENIED, a wrong API key
UNAUTHENTICATED (HTTP's 401, as OpenAI and vLLM answer it). Compared in constant time.
Admin RPCs need the admin token, not the API key (as in vLLM; ``authorization`` holds one);
the loopback ``--admin-port`` trusts every local process, for client RPCs too.
"""

from __future__ import annotations

import argparse
import enum
import hmac
import os
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc


class Access(enum.Enum):
    PUBLIC = "public"
    CLIENT = "client"
    ADMIN = "admin"
    FRONTEND = "frontend"


# Keys: "package.Service/Method" or "package.Service" (every method of it). Not listed: PUBLIC.
# IsPaused stays public: it changes nothing and load balancers may read it.
METHOD_ACCESS: Mapping[str, Access] = {
    "tandem.v1.Generation": Access.CLIENT,
    "tandem.v1.Generation/IsPaused": Access.PUBLIC,
    "tandem.v1.Generation/PauseGeneration": Access.ADMIN,
    "tandem.v1.Generation/ResumeGeneration": Access.ADMIN,
    "tandem.v1.FrontendAdmin": Access.ADMIN,
    "tandem.v1.EngineCore/ResetPrefixCache": Access.ADMIN,
    # Utility calls ride on Stream, so only authenticated frontends can make them.
    "tandem.v1.EngineCore/Stream": Access.FRONTEND,
    "tandem.v1.EngineCore/GetEngineInfo": Access.FRONTEND,
    # KV transfer between engines (disaggregated prefill/decode): a consumer engine
    # pulling from a producer presents the engine token (and certificate) as frontends do.
    "tandem.v1.KvTransfer": Access.FRONTEND,
    # vLLM's gRPC protocol (engine_service/vllm_grpc): a gateway such as SMG is a frontend;
    # what changes the engine's state for everyone is for operators.
    "vllm.grpc.engine.VllmEngine": Access.FRONTEND,
    "vllm.grpc.engine.VllmEngine/FlushCache": Access.ADMIN,
    "vllm.grpc.engine.VllmEngine/StartProfile": Access.ADMIN,
    "vllm.grpc.engine.VllmEngine/StopProfile": Access.ADMIN,
}

AUTHORIZATION_HEADER = "authorization"  # value: "Bearer <admin token>" or "Bearer <API key>"
ENGINE_TOKEN_HEADER = "x-tandem-engine-token"  # value: the engine token


def access_of(method: str) -> Access:
    """``method`` as gRPC names it: "/package.Service/Method"."""
    name = method.lstrip("/")
    service = name.split("/", 1)[0]
    return METHOD_ACCESS.get(name) or METHOD_ACCESS.get(service) or Access.PUBLIC


class SecurityConfigError(ValueError):
    """TLS or token settings that cannot work (a cert without its key, an unreadable file)."""


def _read_pem(path: str, flag: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise SecurityConfigError(f"{flag} {path}: {exc.strerror or exc}") from None


@dataclass(frozen=True)
class TlsFiles:
    """PEM files of one end of a TLS connection; all empty: plain text.

    Server end: ``cert`` + ``key`` serve TLS; ``ca`` also requires every client to
    present a certificate signed by it (mutual TLS). Client end: ``ca`` verifies the
    server (empty: the system's roots); ``cert`` + ``key`` are the client certificate.
    """

    cert: str = ""
    key: str = ""
    ca: str = ""
    flag_prefix: str = "--tls"  # names the flags in error messages

    @property
    def enabled(self) -> bool:
        return bool(self.cert or self.key or self.ca)

    def _pair(self) -> tuple[bytes, bytes] | None:
        if bool(self.cert) != bool(self.key):
            raise SecurityConfigError(
                f"{self.flag_prefix}-cert and {self.flag_prefix}-key go together: give both or neither"
            )
        if not self.cert:
            return None
        return (
            _read_pem(self.key, f"{self.flag_prefix}-key"),
            _read_pem(self.cert, f"{self.flag_prefix}-cert"),
        )

    def server_credentials(self) -> grpc.ServerCredentials | None:
        """None: serve plain text."""
        if not self.enabled:
            return None
        pair = self._pair()
        if pair is None:
            raise SecurityConfigError(f"{self.flag_prefix}-ca needs {self.flag_prefix}-cert and {self.flag_prefix}-key")
        ca = _read_pem(self.ca, f"{self.flag_prefix}-ca") if self.ca else None
        return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """None: connect in plain text."""
        if not self.enabled:
            return None
        pair = self._pair()
        return grpc.ssl_channel_credentials(
            root_certificates=_read_pem(self.ca, f"{self.flag_prefix}-ca") if self.ca else None,
            private_key=pair[0] if pair else None,
            certificate_chain=pair[1] if pair else None,
        )


def _bearer(authorization: str | None) -> str:
    """The credential of an ``authorization: Bearer <credential>`` value; "" if none."""
    scheme, _, given = (authorization or "").partition(" ")
    return given.strip() if scheme.lower() == "bearer" else ""


@dataclass(frozen=True)
class ApiKeys:
    """The keys that admit clients to the client API (``--api-key``); none: not checked."""

    keys: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.keys)

    def refusal(self, authorization: str | None) -> tuple[grpc.StatusCode, str] | None:
        """(code, message) to refuse a client call whose ``authorization`` header or
        metadata is this, or None to let it through. The rule of both edges: gRPC answers
        the code, HTTP its status (UNAUTHENTICATED: 401)."""
        if not self.keys:
            return None
        given = _bearer(authorization)
        if not given:
            return grpc.StatusCode.UNAUTHENTICATED, "this server needs an API key: send 'authorization: Bearer <key>'"
        # Every key compared, in constant time: the answer's timing tells nothing.
        if not any([_same(given, key) for key in self.keys]):
            return grpc.StatusCode.UNAUTHENTICATED, "invalid API key"
        return None


def _split_keys(value: str) -> list[str]:
    return [key.strip() for key in value.split(",") if key.strip()]


def parse_api_keys(values: Sequence[str] | None, env_value: str = "") -> ApiKeys:
    """``--api-key`` values, else the env value: each a comma-separated list of keys
    (blanks around them dropped, empty entries ignored)."""
    return ApiKeys(tuple(key for value in (values or [env_value]) for key in _split_keys(value)))


def _api_key_arg(text: str) -> str:
    if not _split_keys(text):  # e.g. --api-key "$UNSET": refuse rather than serve open
        raise argparse.ArgumentTypeError("no key in it (omit the flag to ask for none)")
    return text


@dataclass(frozen=True)
class ServerSecurity:
    """How one service's ports are protected; each field is a flag and a TANDEM_* env var."""

    tls: TlsFiles = field(default_factory=TlsFiles)  # the public port's TLS (admin port: plain text)
    admin_token: str = ""  # operators' bearer token on the public port; empty: admin RPCs refused there
    admin_port: int = 0  # loopback (127.0.0.1) listener that serves admin RPCs without a token; 0: off
    engine_token: str = ""  # engines: the token frontends must present; empty: not checked
    api_keys: ApiKeys = field(default_factory=ApiKeys)  # frontends: CLIENT RPCs need one; none: public


def _metadata(details: grpc.HandlerCallDetails) -> dict[str, str]:
    return {k: v for k, v in (details.invocation_metadata or ()) if isinstance(v, str)}


def _same(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode(), expected.encode())


class AccessInterceptor(grpc.aio.ServerInterceptor):
    """The public port's guard: refuses calls whose ``Access`` class the caller lacks.

    Runs before the request body is parsed; a refused call never reaches a servicer.
    """

    def __init__(self, security: ServerSecurity) -> None:
        self.security = security

    def refusal(self, method: str, metadata: Mapping[str, str]) -> tuple[grpc.StatusCode, str] | None:
        """(code, message) to refuse ``method`` with, or None to let it through."""
        access = access_of(method)
        if access is Access.CLIENT:
            return self.security.api_keys.refusal(metadata.get(AUTHORIZATION_HEADER))
        if access is Access.ADMIN:
            return self._check_admin(metadata)
        if access is Access.FRONTEND and self.security.engine_token:
            given = metadata.get(ENGINE_TOKEN_HEADER)
            if given is None:
                return grpc.StatusCode.UNAUTHENTICATED, f"this engine requires {ENGINE_TOKEN_HEADER} metadata (the frontend's --engine-token)"
            if not _same(given, self.security.engine_token):
                return grpc.StatusCode.PERMISSION_DENIED, "wrong engine token"
        return None

    def _check_admin(self, metadata: Mapping[str, str]) -> tuple[grpc.StatusCode, str] | None:
        token = self.security.admin_token
        if not token:
            where = (
                f"on the loopback admin port 127.0.0.1:{self.security.admin_port}"
                if self.security.admin_port
                else "on a loopback admin port (--admin-port / TANDEM_ADMIN_PORT)"
            )
            return (
                grpc.StatusCode.PERMISSION_DENIED,
                "admin RPCs are disabled on the public port: set --admin-token (TANDEM_ADMIN_TOKEN) "
                f"and send 'authorization: Bearer <token>', or call {where}",
            )
        given = _bearer(metadata.get(AUTHORIZATION_HEADER))
        if not given:
            return grpc.StatusCode.UNAUTHENTICATED, "admin RPCs need 'authorization: Bearer <admin token>' metadata"
        if not _same(given, token):
            return grpc.StatusCode.PERMISSION_DENIED, "wrong admin token"
        return None

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        refusal = self.refusal(handler_call_details.method, _metadata(handler_call_details))
        if refusal is None:
            return handler
        return _refusing_handler(handler, *refusal)


def _refusing_handler(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that ends every call with ``code``."""

    async def refuse(_request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, message)

    make = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[(handler.request_streaming, handler.response_streaming)]
    return make(
        refuse,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


# ---- the frontend's side: channels to engines --------------------------------------


class _AddsEngineToken:
    """Adds the engine token to a call's metadata."""

    def __init__(self, token: str) -> None:
        self.entry = (ENGINE_TOKEN_HEADER, token)

    def _with_token(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), self.entry)
        return grpc.aio.ClientCallDetails(
            details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
        )


# One class per call shape: a grpc.aio channel files each interceptor under the first
# shape it implements only.
class _UnaryUnaryToken(_AddsEngineToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        return await continuation(self._with_token(client_call_details), request)


class _UnaryStreamToken(_AddsEngineToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        return await continuation(self._with_token(client_call_details), request)


class _StreamStreamToken(_AddsEngineToken, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):  # type: ignore[no-untyped-def]
        return await continuation(self._with_token(client_call_details), request_iterator)


@dataclass(frozen=True)
class EngineChannelSecurity:
    """How a frontend reaches its engines: TLS (``--engine-tls-*``) and the engine token."""

    tls: TlsFiles = field(default_factory=lambda: TlsFiles(flag_prefix="--engine-tls"))
    engine_token: str = ""  # sent as x-tandem-engine-token on every engine call; empty: none

    def open_channel(self, address: str, options: Sequence[tuple[str, Any]]) -> grpc.aio.Channel:
        interceptors = (
            [kind(self.engine_token) for kind in (_UnaryUnaryToken, _UnaryStreamToken, _StreamStreamToken)]
            if self.engine_token
            else None
        )
        credentials = self.tls.channel_credentials()
        if credentials is None:
            return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
        return grpc.aio.secure_channel(address, credentials, options=options, interceptors=interceptors)


# ---- flags ---------------------------------------------------------------------------


def add_server_security_cli(p: argparse.ArgumentParser, *, engine: bool, admin_port_default: int = 0) -> None:
    """The TLS, admin and (engines) engine-token flags of a service."""
    env = os.environ.get
    client = "frontends" if engine else "clients"
    p.add_argument("--tls-cert", default=env("TANDEM_TLS_CERT", ""),
                   help="PEM certificate chain: serve TLS on the public port (env TANDEM_TLS_CERT; default: plain text).")
    p.add_argument("--tls-key", default=env("TANDEM_TLS_KEY", ""),
                   help="PEM private key of --tls-cert (env TANDEM_TLS_KEY; default: none).")
    p.add_argument("--tls-ca", default=env("TANDEM_TLS_CA", ""),
                   help=f"PEM CA bundle: require {client} to present a certificate signed by it, i.e. mutual "
                        "TLS (env TANDEM_TLS_CA; default: no client certificates).")
    p.add_argument("--admin-token", default=env("TANDEM_ADMIN_TOKEN", ""),
                   help="Bearer token that admits admin RPCs on the public port; prefer the env var "
                        "TANDEM_ADMIN_TOKEN (argv is visible to other users). Default: none, admin RPCs "
                        "are refused on the public port.")
    p.add_argument("--admin-port", type=int, default=int(env("TANDEM_ADMIN_PORT", str(admin_port_default))),
                   help="Port of a 127.0.0.1-only plain-text listener that serves every RPC, admin ones "
                        f"without a token (env TANDEM_ADMIN_PORT; default {admin_port_default}; 0: off).")
    if engine:
        p.add_argument("--engine-token", default=env("TANDEM_ENGINE_TOKEN", ""),
                       help="Shared secret frontends must send to open Stream or call GetEngineInfo; "
                            "prefer the env var TANDEM_ENGINE_TOKEN. Default: none (not checked).")
    else:
        add_api_key_cli(p)


API_KEY_ENV = "TANDEM_API_KEY"


def add_api_key_cli(p: argparse.ArgumentParser) -> None:
    """The frontend's ``--api-key`` (``tandem frontend`` and ``tandem serve``)."""
    p.add_argument("--api-key", action="append", type=_api_key_arg, default=None, metavar="KEY",
                   help="Require clients of the OpenAI API and the gRPC Generation service to send one "
                        "of the keys as 'Authorization: Bearer KEY' (vLLM's --api-key); /health, /metrics, "
                        "gRPC health, reflection and IsPaused stay open, admin RPCs keep --admin-token, and "
                        "the loopback --admin-port (it trusts local processes) asks for no key. "
                        "Several keys: repeat the flag or separate them with commas. Env "
                        f"{API_KEY_ENV} (comma-separated; preferred, argv is visible to other users), "
                        "ignored when the flag is given. Default: none, no key is asked for.")


def api_keys_from_args(args: argparse.Namespace) -> ApiKeys:
    return parse_api_keys(args.api_key, os.environ.get(API_KEY_ENV, ""))


def server_security_from_args(args: argparse.Namespace, *, engine: bool) -> ServerSecurity:
    return ServerSecurity(
        tls=TlsFiles(args.tls_cert, args.tls_key, args.tls_ca),
        admin_token=args.admin_token,
        admin_port=args.admin_port,
        engine_token=args.engine_token if engine else "",
        api_keys=ApiKeys() if engine else api_keys_from_args(args),
    )


def add_engine_channel_cli(p: argparse.ArgumentParser) -> None:
    """The frontend's flags for reaching engines."""
    env = os.environ.get
    p.add_argument("--engine-tls-ca", default=env("TANDEM_ENGINE_TLS_CA", ""),
                   help="PEM CA bundle that verifies engines' certificates; any --engine-tls-* flag "
                        "switches engine channels to TLS (env TANDEM_ENGINE_TLS_CA; default: plain "
                        "text, or the system roots when only a client certificate is given).")
    p.add_argument("--engine-tls-cert", default=env("TANDEM_ENGINE_TLS_CERT", ""),
                   help="PEM client certificate presented to engines, for mutual TLS (env "
                        "TANDEM_ENGINE_TLS_CERT; default: none).")
    p.add_argument("--engine-tls-key", default=env("TANDEM_ENGINE_TLS_KEY", ""),
                   help="PEM private key of --engine-tls-cert (env TANDEM_ENGINE_TLS_KEY; default: none).")
    p.add_argument("--engine-token", default=env("TANDEM_ENGINE_TOKEN", ""),
                   help="Token sent to engines as x-tandem-engine-token (their --engine-token); prefer "
                        "the env var TANDEM_ENGINE_TOKEN. Default: none.")


def engine_channel_from_args(args: argparse.Namespace) -> EngineChannelSecurity:
    return EngineChannelSecurity(
        tls=TlsFiles(args.engine_tls_cert, args.engine_tls_key, args.engine_tls_ca, flag_prefix="--engine-tls"),
        engine_token=args.engine_token,
    )
