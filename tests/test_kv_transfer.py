"""KV transfer between engines (disaggregated prefill and decode), engine side.

In one process: a producer EngineCore whose KvTransfer service listens on a real local
socket, a consumer EngineCore that pulls from it, and an aggregated EngineCore as the
reference. A request is prefilled on the producer (max_tokens=1; its params come back
on the finished output) and continued on the consumer with those params; its tokens
must be exactly the aggregated engine's, greedy and seeded, with prefix caching on and
off. Then the failure cases: expiry, forged params, an unauthenticated pull, a producer
gone before the pull; every block is free at the end of each.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from engine_service.config import EngineConfig
from engine_service.core import EngineCore
from engine_service.kv_transfer.grpc_connector import GrpcKvConnector
from engine_service.kv_transfer.service import KvTransferServer
from engine_service.request import RequestStatus
from tandem.protocol.kv_transfer import KvTransferParams
from tandem.protocol.outputs import EngineCoreOutput, EngineCoreRequest, FinishReason
from tandem.protocol.sampling_params import InvalidRequestError, SamplingParams
from tandem.security import EngineChannelSecurity, ServerSecurity
from tandem.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc
from tests.test_engine_parity import _workload

ARCHS = ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_qwen3_dir"]
TOKEN = "engine-secret"


def _config(model: str, caching: bool, **kw: object) -> EngineConfig:
    return EngineConfig(
        model=model,
        device="cpu",
        max_model_len=512,
        max_num_batched_tokens=1024,
        enable_prefix_caching=caching,
        **kw,  # type: ignore[arg-type]
    )


class Pair:
    """A producer (its KvTransfer service on a local port) and a consumer."""

    def __init__(self, model: str, caching: bool, expiry_s: float = 30.0, token: str = "") -> None:
        self.producer_connector = GrpcKvConnector("producer", "p-0", "", 16, expiry_s)
        self.producer = EngineCore(_config(model, caching), 0, kv_connector=self.producer_connector)
        self.server = KvTransferServer(
            self.producer_connector, security=ServerSecurity(engine_token=token)
        )
        self.producer_connector.address = self.server.address
        self.consumer_connector = GrpcKvConnector(
            "consumer", "c-1", "", 16, expiry_s, EngineChannelSecurity(engine_token=token)
        )
        self.consumer = EngineCore(_config(model, caching), 1, kv_connector=self.consumer_connector)

    def prefill(self, rid: str, prompt: list[int], params: SamplingParams) -> EngineCoreOutput:
        """The producer's run of the request with max_tokens=1: its last output."""
        first = dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))
        self.producer.add_request(
            EngineCoreRequest(
                rid, prompt, first, kv_transfer_params=KvTransferParams(do_remote_decode=True)
            )
        )
        return _run(self.producer)[rid][-1]

    def decode(
        self, rid: str, prompt: list[int], params: SamplingParams, first: EngineCoreOutput
    ) -> list[int]:
        """The consumer's continuation after the producer's first token."""
        self.consumer.add_request(
            EngineCoreRequest(
                rid,
                prompt,
                params,
                generated_token_ids=list(first.new_token_ids),
                kv_transfer_params=first.kv_transfer_params,
            )
        )
        return [t for o in _run(self.consumer)[rid] for t in o.new_token_ids]

    def close(self) -> None:
        self.server.stop()
        for core in (self.producer, self.consumer):
            core.shutdown()

    def settle(self) -> None:
        """Let the producer free what was pulled; then every block is free on both."""
        deadline = time.monotonic() + 10
        while self.producer_connector.num_held_transfers and time.monotonic() < deadline:
            self.producer.idle_tick()
            time.sleep(0.01)
        self.producer.idle_tick()
        for core in (self.producer, self.consumer):
            core.kv_manager.pool.check_all_free()


def _run(core: EngineCore) -> dict[str, list[EngineCoreOutput]]:
    outs: dict[str, list[EngineCoreOutput]] = {}
    deadline = time.monotonic() + 120
    while core.has_unfinished_requests():
        assert time.monotonic() < deadline, "the engine did not finish"
        for o in core.step().all_outputs():
            outs.setdefault(o.request_id, []).append(o)
    return outs


@pytest.fixture
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    arch, caching = request.param
    p = Pair(request.getfixturevalue(arch), caching)
    yield p
    p.close()


def _params(vocab: int, max_tokens: list[int], seeded: bool) -> list[SamplingParams]:
    if not seeded:
        return [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_tokens]
    return [
        SamplingParams(max_tokens=m, temperature=1.0, top_p=0.9, seed=1000 + i, ignore_eos=True)
        for i, m in enumerate(max_tokens)
    ]


@pytest.mark.parametrize(
    "pair",
    [(a, c) for a in ARCHS for c in (False, True)],
    indirect=True,
    ids=[
        f"{a.removeprefix('tiny_').removesuffix('_dir')}-{'prefix' if c else 'noprefix'}"
        for a in ARCHS
        for c in (False, True)
    ],
)
def test_disaggregated_equals_aggregated(pair: Pair) -> None:
    vocab = pair.producer.model_config.vocab_size
    prompts, max_tokens = _workload(vocab, seed=7)
    aggregated = EngineCore(dataclasses.replace(pair.producer.config), 2)
    try:
        for seeded in (False, True):
            params = _params(vocab, max_tokens, seeded)
            for i, (prompt, sp) in enumerate(zip(prompts, params, strict=True)):
                aggregated.add_request(EngineCoreRequest(f"a{i}", prompt, sp))
            want = {
                rid: [t for o in outs for t in o.new_token_ids]
                for rid, outs in _run(aggregated).items()
            }
            for i, (prompt, sp) in enumerate(zip(prompts, params, strict=True)):
                rid = f"{'s' if seeded else 'g'}{i}"
                first = pair.prefill(rid, prompt, sp)
                got = list(first.new_token_ids)
                assert first.finish_reason == FinishReason.LENGTH
                if sp.max_tokens == 1:
                    # Nothing left to decode: the frontend frees the transfer unpulled.
                    assert first.kv_transfer_params is not None
                    _release(pair, first.kv_transfer_params)
                else:
                    got += pair.decode(rid, prompt, sp, first)
                assert got == want[f"a{i}"], f"{rid} ({len(prompt)} prompt tokens)"
            pair.settle()
        stats = pair.consumer_connector.stats
        assert stats.loads_ok > 0 and stats.loads_failed == 0
        assert stats.bytes_received == pair.producer_connector.stats.bytes_sent > 0
        aggregated.kv_manager.pool.check_all_free()
    finally:
        aggregated.shutdown()


def _release(pair: Pair, params: KvTransferParams) -> None:
    with grpc.insecure_channel(params.remote_address) as channel:
        stub = kv_transfer_pb2_grpc.KvTransferStub(channel)
        list(
            stub.PullBlocks(
                kv_transfer_pb2.PullBlocksRequest(
                    remote_request_id=params.remote_request_id,
                    transfer_secret=params.transfer_secret,
                )
            )
        )


def test_consumer_with_the_prefix_pulls_only_the_rest(tiny_llama_dir: str) -> None:
    p = Pair(tiny_llama_dir, caching=True)
    try:
        rng_prompt = list(range(10, 10 + 70))  # 4 full blocks and 6 tokens
        sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        # The consumer already holds the first 64 tokens (4 blocks) in its prefix cache.
        p.consumer.add_request(
            EngineCoreRequest("warm", [*rng_prompt[:64], 5], SamplingParams(max_tokens=1))
        )
        _run(p.consumer)
        first = p.prefill("r", rng_prompt, sp)
        before = p.consumer_connector.stats.bytes_received
        tokens = list(first.new_token_ids) + p.decode("r", rng_prompt, sp, first)
        io = p.consumer_connector.io
        assert io is not None
        per_block = io.block_bytes * 2 * io.layout.num_layers
        assert p.consumer_connector.stats.bytes_received - before == per_block  # the 5th block only
        agg = EngineCore(_config(tiny_llama_dir, True), 2)
        agg.add_request(EngineCoreRequest("a", rng_prompt, sp))
        assert tokens == [t for o in _run(agg)["a"] for t in o.new_token_ids]
        agg.shutdown()
        p.settle()
    finally:
        p.close()


def test_transfer_expires_and_frees_its_blocks(tiny_llama_dir: str) -> None:
    p = Pair(tiny_llama_dir, caching=False, expiry_s=0.3)
    try:
        sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        prompt = list(range(3, 40))
        first = p.prefill("r", prompt, sp)
        assert p.producer_connector.num_held_transfers == 1
        assert p.producer.kv_manager.pool.num_free_blocks < p.producer.num_blocks
        time.sleep(0.4)
        p.producer.idle_tick()
        assert p.producer_connector.num_held_transfers == 0
        assert p.producer_connector.stats.expired == 1
        p.producer.kv_manager.pool.check_all_free()
        # A consumer that comes late computes the prompt itself, with the same tokens.
        tokens = list(first.new_token_ids) + p.decode("r", prompt, sp, first)
        agg = EngineCore(_config(tiny_llama_dir, False), 2)
        agg.add_request(EngineCoreRequest("a", prompt, sp))
        assert tokens == [t for o in _run(agg)["a"] for t in o.new_token_ids]
        agg.shutdown()
        p.settle()
    finally:
        p.close()


def test_forged_params_are_refused_and_leak_nothing(tiny_llama_dir: str) -> None:
    p = Pair(tiny_llama_dir, caching=False)
    try:
        sp = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        prompt = list(range(3, 50))
        first = p.prefill("r", prompt, sp)
        params = first.kv_transfer_params
        assert params is not None
        with grpc.insecure_channel(p.server.address) as channel:
            stub = kv_transfer_pb2_grpc.KvTransferStub(channel)

            def pull(**kw: object) -> grpc.StatusCode:
                fields: dict[str, object] = dict(
                    remote_request_id=params.remote_request_id,
                    transfer_secret=params.transfer_secret,
                    block_ids=params.remote_block_ids,
                )
                fields.update(kw)
                with pytest.raises(grpc.RpcError) as err:
                    list(stub.PullBlocks(kv_transfer_pb2.PullBlocksRequest(**fields)))  # type: ignore[arg-type]
                return err.value.code()

            assert pull(transfer_secret=b"x" * 16) == grpc.StatusCode.PERMISSION_DENIED
            assert pull(block_ids=[9999]) == grpc.StatusCode.INVALID_ARGUMENT
            assert pull(remote_request_id="nope") == grpc.StatusCode.NOT_FOUND
        # Refused pulls changed nothing: the real consumer still gets the blocks.
        assert p.producer_connector.num_held_transfers == 1
        forged = dataclasses.replace(params, block_hashes=[b"\0" * 32] * len(params.block_hashes))
        p.consumer.add_request(
            EngineCoreRequest(
                "f",
                prompt,
                sp,
                generated_token_ids=list(first.new_token_ids),
                kv_transfer_params=forged,
            )
        )
        _run(p.consumer)  # hashes do not match its tokens: computed locally, nothing pulled
        assert p.consumer_connector.stats.loads_ok == 0
        with pytest.raises(InvalidRequestError):
            p.consumer.add_request(
                EngineCoreRequest(
                    "g",
                    prompt,
                    sp,
                    kv_transfer_params=dataclasses.replace(params, remote_block_ids=[1]),
                )
            )
        p.settle()  # the forged request's consumer released the transfer
    finally:
        p.close()


def test_unauthenticated_pull_is_refused(tiny_llama_dir: str) -> None:
    p = Pair(tiny_llama_dir, caching=False, token=TOKEN)
    try:
        sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        prompt = list(range(3, 30))
        first = p.prefill("r", prompt, sp)
        params = first.kv_transfer_params
        assert params is not None
        request = kv_transfer_pb2.PullBlocksRequest(
            remote_request_id=params.remote_request_id,
            transfer_secret=params.transfer_secret,
            block_ids=params.remote_block_ids,
        )
        with grpc.insecure_channel(p.server.address) as channel:
            stub = kv_transfer_pb2_grpc.KvTransferStub(channel)
            with pytest.raises(grpc.RpcError) as err:
                list(stub.PullBlocks(request))
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as err:
                list(stub.PullBlocks(request, metadata=[("x-tandem-engine-token", "wrong")]))
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert p.producer_connector.num_held_transfers == 1
        # The consumer, with the token, pulls.
        p.decode("r", prompt, sp, first)
        assert p.consumer_connector.stats.loads_ok == 1
        p.settle()
    finally:
        p.close()


def test_producer_gone_before_the_pull(tiny_llama_dir: str) -> None:
    p = Pair(tiny_llama_dir, caching=False)
    try:
        sp = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
        prompt = list(range(3, 60))
        first = p.prefill("r", prompt, sp)
        p.server.stop()  # the producer is killed after the prefill
        tokens = list(first.new_token_ids) + p.decode("r", prompt, sp, first)
        assert p.consumer_connector.stats.loads_failed == 1
        agg = EngineCore(_config(tiny_llama_dir, False), 2)
        agg.add_request(EngineCoreRequest("a", prompt, sp))
        assert tokens == [t for o in _run(agg)["a"] for t in o.new_token_ids]
        agg.shutdown()
        p.consumer.kv_manager.pool.check_all_free()
    finally:
        p.close()


def test_abort_while_loading_frees_after_the_load(tiny_llama_dir: str) -> None:
    p = Pair(tiny_llama_dir, caching=False)
    try:
        sp = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
        prompt = list(range(3, 80))
        first = p.prefill("r", prompt, sp)
        p.consumer.add_request(
            EngineCoreRequest(
                "r",
                prompt,
                sp,
                generated_token_ids=list(first.new_token_ids),
                kv_transfer_params=first.kv_transfer_params,
            )
        )
        p.consumer.scheduler.schedule()  # admitted: waiting for its KV
        assert p.consumer.scheduler.requests["r"].status == RequestStatus.WAITING_FOR_REMOTE_KV
        p.consumer.abort_requests(["r"])
        ended = p.consumer.step().all_outputs()
        assert [o.finish_reason for o in ended] == [FinishReason.ABORT]
        deadline = time.monotonic() + 10
        while p.consumer.scheduler.kv_transfer.num_orphans and time.monotonic() < deadline:
            p.consumer.idle_tick()
            time.sleep(0.01)
        p.settle()
    finally:
        p.close()


def test_params_without_a_connector_are_dropped(
    tiny_llama_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    core = EngineCore(_config(tiny_llama_dir, False), 0)
    try:
        params = KvTransferParams(do_remote_decode=True)
        core.add_request(
            EngineCoreRequest(
                "r", [5, 6, 7], SamplingParams(max_tokens=2), kv_transfer_params=params
            )
        )
        outs = _run(core)["r"]
        assert outs[-1].finished and outs[-1].kv_transfer_params is None
        assert "no KV connector" in caplog.text
        core.kv_manager.pool.check_all_free()
    finally:
        core.shutdown()


def test_small_chunks_and_spans_under_the_request_trace(tiny_qwen3_dir: str) -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from tandem.telemetry import Tracing

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing = Tracing(provider.get_tracer("test"), provider)
    p = Pair(tiny_qwen3_dir, caching=False)
    try:
        p.consumer_connector.max_chunk_bytes = 1  # one block per chunk
        p.producer_connector.tracing = p.consumer_connector.tracing = tracing
        trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
        headers = {"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"}
        sp = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
        prompt = list(range(3, 100))
        first = p.prefill("r", prompt, sp)
        p.consumer.add_request(
            EngineCoreRequest(
                "r",
                prompt,
                sp,
                trace_headers=headers,
                generated_token_ids=list(first.new_token_ids),
                kv_transfer_params=first.kv_transfer_params,
            )
        )
        tokens = list(first.new_token_ids) + [
            t for o in _run(p.consumer)["r"] for t in o.new_token_ids
        ]
        agg = EngineCore(_config(tiny_qwen3_dir, False), 2)
        agg.add_request(EngineCoreRequest("a", prompt, sp))
        assert tokens == [t for o in _run(agg)["a"] for t in o.new_token_ids]
        agg.shutdown()
        p.settle()
        spans = {s.name: s for s in exporter.get_finished_spans()}
        assert {"kv_transfer_pull", "kv_transfer_send"} <= set(spans)
        for name in ("kv_transfer_pull", "kv_transfer_send"):
            assert format(spans[name].context.trace_id, "032x") == trace_id
            assert (
                spans[name].attributes["tandem.kv_transfer.bytes"]
                == p.consumer_connector.stats.bytes_received
            )
    finally:
        p.close()


def test_sleep_drops_held_transfers(tiny_llama_dir: str) -> None:
    p = Pair(tiny_llama_dir, caching=True)
    try:
        sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        prompt = list(range(3, 45))
        first = p.prefill("r", prompt, sp)
        assert p.producer_connector.num_held_transfers == 1
        p.producer.sleep(1)
        assert p.producer_connector.num_held_transfers == 0
        p.producer.kv_manager.pool.check_all_free()
        p.producer.wake_up()
        tokens = list(first.new_token_ids) + p.decode("r", prompt, sp, first)  # NOT_FOUND: computed
        assert p.consumer_connector.stats.loads_failed == 1 and len(tokens) == 4
        p.settle()
    finally:
        p.close()


def test_pull_over_mutual_tls(tiny_llama_dir: str, tmp_path: Path) -> None:
    """A producer with --tls-ca admits only consumers with a certificate of its CA."""
    from tandem.security import TlsFiles
    from tests.tls_certs import TestCA

    ca, other = TestCA(tmp_path, "tandem-ca"), TestCA(tmp_path, "other-ca")
    server, client, stranger = ca.issue("producer"), ca.issue("consumer"), other.issue("stranger")
    producer_connector = GrpcKvConnector("producer", "p-0", "", 16)
    producer = EngineCore(_config(tiny_llama_dir, False), 0, kv_connector=producer_connector)
    tls = TlsFiles(str(server.cert), str(server.key), str(ca.ca_path))
    kv_server = KvTransferServer(
        producer_connector, host="localhost", security=ServerSecurity(tls=tls)
    )
    producer_connector.address = kv_server.address
    consumers = []
    try:
        sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        prompt = list(range(3, 60))
        got = {}
        for name, files in (("stranger", stranger), ("member", client)):
            connector = GrpcKvConnector(
                "consumer",
                f"c-{name}",
                "",
                16,
                channel_security=EngineChannelSecurity(
                    TlsFiles(str(files.cert), str(files.key), str(ca.ca_path))
                ),
            )
            consumer = EngineCore(_config(tiny_llama_dir, False), 1, kv_connector=connector)
            consumers.append(consumer)
            rid = f"r-{name}"
            producer.add_request(
                EngineCoreRequest(
                    rid,
                    prompt,
                    dataclasses.replace(sp, max_tokens=1),
                    kv_transfer_params=KvTransferParams(do_remote_decode=True),
                )
            )
            first = _run(producer)[rid][-1]
            consumer.add_request(
                EngineCoreRequest(
                    rid,
                    prompt,
                    sp,
                    generated_token_ids=list(first.new_token_ids),
                    kv_transfer_params=first.kv_transfer_params,
                )
            )
            got[name] = list(first.new_token_ids) + [
                t for o in _run(consumer)[rid] for t in o.new_token_ids
            ]
            got[name + "_ok"] = connector.stats.loads_ok
        assert got["stranger_ok"] == 0 and got["member_ok"] == 1  # the stranger computed the prompt
        assert got["stranger"] == got["member"]
        # The stranger's transfer is still held (its pull was refused in the handshake): it expires.
        assert producer_connector.num_held_transfers == 1
    finally:
        kv_server.stop()
        for core in (producer, *consumers):
            core.shutdown()
