"""The KV-transfer contract: params round-trip between domain and wire, on requests and
outputs; the producer's held-block table (claims, refusals, expiry) leaks nothing."""

from __future__ import annotations

import random

import grpc
import pytest

from engine_service.kv_cache.block_pool import BlockPool
from engine_service.kv_cache.manager import KVBlocks
from engine_service.kv_transfer.base import FinishedLoad, KvConnector
from engine_service.kv_transfer.held import HeldTransfer, HeldTransfers, TransferRefused
from tandem.protocol import convert
from tandem.protocol.kv_transfer import KvTransferParams
from tandem.protocol.outputs import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
)
from tandem.protocol.sampling_params import InvalidRequestError, SamplingParams
from tandem.v1 import engine_pb2


def _params(rng: random.Random) -> KvTransferParams:
    n = rng.randrange(1, 200)
    bs = rng.choice([1, 8, 16])
    return KvTransferParams(
        do_remote_decode=rng.random() < 0.5,
        do_remote_prefill=rng.random() < 0.5,
        remote_engine_id=f"engine-{rng.randrange(100)}",
        remote_address=f"10.0.0.{rng.randrange(255)}:{rng.randrange(1, 65535)}",
        remote_request_id=f"req-{rng.randrange(1000)}",
        remote_block_ids=rng.sample(range(10_000), -(-n // bs)),
        block_hashes=[rng.randbytes(32) for _ in range(n // bs)],
        num_tokens=n,
        block_size=bs,
        expires_at=rng.uniform(1e9, 2e9),
        transfer_secret=rng.randbytes(16),
    )


def _wire(msg):  # type: ignore[no-untyped-def]
    return type(msg).FromString(msg.SerializeToString())


def test_params_round_trip_on_requests_and_outputs() -> None:
    rng = random.Random(5)
    for _ in range(50):
        params = _params(rng)
        assert (
            convert.kv_transfer_params_from_proto(
                _wire(convert.kv_transfer_params_to_proto(params))
            )
            == params
        )
        req = EngineCoreRequest(
            "r", [1, 2, 3], SamplingParams(max_tokens=4), kv_transfer_params=params
        )
        back = convert.engine_core_request_from_proto(
            _wire(convert.engine_core_request_to_proto(req))
        )
        assert back == req and back.kv_transfer_params == params
        out = EngineCoreOutput(
            "r", [7], finish_reason=FinishReason.LENGTH, kv_transfer_params=params
        )
        outs = EngineCoreOutputs(outputs=[out])
        got = convert.engine_core_outputs_from_proto(
            _wire(convert.engine_core_outputs_to_proto(outs))
        )
        assert got.outputs[0].kv_transfer_params == params


def test_absent_params_stay_absent() -> None:
    req = EngineCoreRequest("r", [1], SamplingParams())
    msg = convert.engine_core_request_to_proto(req)
    assert not msg.HasField("kv_transfer_params")
    assert convert.engine_core_request_from_proto(msg).kv_transfer_params is None
    out = convert.engine_core_output_to_proto(
        EngineCoreOutput("r", [1], finish_reason=FinishReason.STOP)
    )
    assert not out.HasField("kv_transfer_params")
    assert isinstance(out, engine_pb2.EngineCoreOutput)


def test_an_output_with_params_never_travels_in_the_columns() -> None:
    params = _params(random.Random(1))
    outs = EngineCoreOutputs(outputs=[EngineCoreOutput("r", [7], kv_transfer_params=params)])
    msg = convert.engine_core_outputs_to_proto(outs)
    assert not msg.HasField("token_columns") and msg.outputs[0].HasField("kv_transfer_params")


def test_validate_remote_names_the_bad_field() -> None:
    good = _params(random.Random(3))
    good.validate_remote()
    for change, field in [
        ({"remote_address": ""}, "remote_address"),
        ({"remote_block_ids": []}, "remote_block_ids"),
        ({"block_size": 0}, "block_size"),
        ({"transfer_secret": b""}, "transfer_secret"),
        ({"block_hashes": [b"x"] * (good.num_tokens // good.block_size + 1)}, "block_hashes"),
    ]:
        bad = KvTransferParams(**{**good.__dict__, **change})
        with pytest.raises(InvalidRequestError) as err:
            bad.validate_remote()
        assert err.value.field == f"kv_transfer_params.{field}"


def _hold(
    pool: BlockPool, table: HeldTransfers, rid: str, n: int, expires_at: float
) -> HeldTransfer:
    blocks = KVBlocks(tuple(pool.get_new_blocks(n)), 4)
    held = HeldTransfer(rid, blocks, blocks.block_ids, b"s" * 16, expires_at)
    table.hold(held)
    return held


def _free(pool: BlockPool, table: HeldTransfers, now: float) -> None:
    for blocks in table.take_released(now):
        pool.free_blocks(reversed(blocks.blocks))


def test_held_transfers_free_on_pull_and_on_expiry() -> None:
    pool = BlockPool(32, enable_caching=True)
    table = HeldTransfers()
    pulled = _hold(pool, table, "a", 3, expires_at=100.0)
    _hold(pool, table, "b", 2, expires_at=50.0)
    claimed = _hold(pool, table, "c", 4, expires_at=10.0)
    assert table.claim("c", b"s" * 16, claimed.block_ids[:2], now=5.0) is claimed
    _free(pool, table, now=60.0)  # b expired; c is being pulled past its expiry: kept
    assert len(table) == 2 and table.num_expired == 1
    table.release(claimed)
    assert table.claim("a", b"s" * 16, pulled.block_ids, now=61.0) is pulled
    table.release(pulled)
    _free(pool, table, now=61.0)
    assert len(table) == 0
    pool.check_all_free()


@pytest.mark.parametrize(
    "rid, secret, ids, code",
    [
        ("a", b"t" * 16, None, grpc.StatusCode.PERMISSION_DENIED),
        ("zz", b"s" * 16, None, grpc.StatusCode.NOT_FOUND),
        ("a", b"s" * 16, [999], grpc.StatusCode.INVALID_ARGUMENT),
    ],
)
def test_refused_claims_change_nothing(
    rid: str, secret: bytes, ids: list[int] | None, code: grpc.StatusCode
) -> None:
    pool = BlockPool(8, enable_caching=False)
    table = HeldTransfers()
    held = _hold(pool, table, "a", 2, expires_at=100.0)
    with pytest.raises(TransferRefused) as err:
        table.claim(rid, secret, held.block_ids if ids is None else ids, now=1.0)
    assert err.value.code == code
    assert table.claim("a", b"s" * 16, held.block_ids, now=1.0) is held  # the real pull still works
    with pytest.raises(TransferRefused) as err:
        table.claim("a", b"s" * 16, held.block_ids, now=1.0)
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION  # one pull at a time
    table.release(held)
    _free(pool, table, now=1.0)
    pool.check_all_free()


def test_expired_transfer_is_not_found_and_dropped() -> None:
    pool = BlockPool(8, enable_caching=False)
    table = HeldTransfers()
    held = _hold(pool, table, "a", 2, expires_at=10.0)
    with pytest.raises(TransferRefused) as err:
        table.claim("a", b"s" * 16, held.block_ids, now=11.0)
    assert err.value.code == grpc.StatusCode.NOT_FOUND
    _free(pool, table, now=11.0)
    pool.check_all_free()


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_blocks_round_trip_through_bytes(dtype: str) -> None:
    import torch

    from engine_service.kv_transfer.base import CacheLayout
    from engine_service.kv_transfer.blocks import DTYPES, KvBlockIO

    layout = CacheLayout(dtype, num_layers=2, block_size=4, num_kv_heads=2, head_dim=8)
    shape = (6, 4, 2, 8)
    src = [
        (torch.randn(shape).to(DTYPES[dtype]), torch.randn(shape).to(DTYPES[dtype]))
        for _ in range(2)
    ]
    dst = [
        (torch.zeros(shape, dtype=DTYPES[dtype]), torch.zeros(shape, dtype=DTYPES[dtype]))
        for _ in range(2)
    ]
    reader, writer = KvBlockIO(lambda: src, layout), KvBlockIO(lambda: dst, layout)
    for layer in range(2):
        for kind in (0, 1):
            data = reader.read(layer, kind, [5, 1])
            assert len(data) == 2 * reader.block_bytes
            writer.write(layer, kind, [0, 3], writer.decode(data, 2))
            assert torch.equal(dst[layer][kind][0], src[layer][kind][5])
            assert torch.equal(dst[layer][kind][3], src[layer][kind][1])
    with pytest.raises(ValueError):
        writer.decode(b"\0" * 3, 1)


# ---- the seam: a connector of another kind plugs into the scheduler as it is ----------


class LocalConnector(KvConnector):
    """A toy connector (as a shared-memory or host-offload one would be): every request
    with params loads all but its last token; loads end when ``finish`` says so."""

    def __init__(self) -> None:
        self.started: dict[str, tuple[list[int], int]] = {}
        self.finished: list[FinishedLoad] = []

    def get_num_external_tokens(self, request, num_local_tokens):  # type: ignore[no-untyped-def]
        if request.kv_transfer_params is None or request.request_id in self.started:
            return 0
        return request.num_tokens - 1 - num_local_tokens

    def start_load(self, request, block_ids, num_local_tokens):  # type: ignore[no-untyped-def]
        self.started[request.request_id] = (list(block_ids), request.num_tokens - 1)

    def finish(self, request_id: str, ok: bool = True) -> None:
        self.finished.append(FinishedLoad(request_id, self.started[request_id][1] if ok else 0))

    def poll_finished_loads(self):  # type: ignore[no-untyped-def]
        done, self.finished = self.finished, []
        return done


def test_a_loading_request_waits_in_its_own_state_and_then_runs() -> None:
    from engine_service.kv_cache.manager import KVCacheManager
    from engine_service.request import RequestStatus
    from engine_service.scheduler import Scheduler
    from tests.factories import fake_step, make_request

    connector = LocalConnector()
    scheduler = Scheduler(KVCacheManager(64, 4, True), 8, 64, 128, kv_connector=connector)
    remote = make_request(30, max_tokens=3)
    remote.kv_transfer_params = KvTransferParams(do_remote_prefill=True)
    local = make_request(10, max_tokens=3)
    scheduler.add_request(remote)
    scheduler.add_request(local)
    out, _ = fake_step(scheduler)
    assert [s.request for s in out.scheduled] == [local]  # the step did not wait for the load
    assert remote.status == RequestStatus.WAITING_FOR_REMOTE_KV and scheduler.kv_transfer.num_loading == 1
    assert len(connector.started[remote.request_id][0]) == 8  # blocks for 29 tokens
    assert scheduler.stats().num_waiting_reqs == 1
    connector.finish(remote.request_id)
    out, _ = fake_step(scheduler)
    entry = next(s for s in out.scheduled if s.request is remote)
    assert entry.num_new_tokens == 1 and entry.samples  # 29 loaded: the last token computes
    while scheduler.num_unfinished:
        fake_step(scheduler)
    scheduler.kv.pool.check_all_free()


def test_a_failed_load_computes_and_an_abort_while_loading_frees_after_the_load() -> None:
    from engine_service.kv_cache.manager import KVCacheManager
    from engine_service.request import RequestStatus
    from engine_service.scheduler import Scheduler
    from tests.factories import fake_step, make_request

    connector = LocalConnector()
    scheduler = Scheduler(KVCacheManager(64, 4, True), 8, 64, 128, kv_connector=connector)
    failing, aborted = make_request(20, max_tokens=2), make_request(20, max_tokens=2)
    for r in (failing, aborted):
        r.kv_transfer_params = KvTransferParams(do_remote_prefill=True)
        scheduler.add_request(r)
    fake_step(scheduler)
    assert failing.status == aborted.status == RequestStatus.WAITING_FOR_REMOTE_KV
    scheduler.abort([aborted.request_id])
    assert (
        aborted.is_finished and scheduler.kv.pool.num_free_blocks < 64
    )  # blocks kept: load running
    connector.finish(failing.request_id, ok=False)
    connector.finish(aborted.request_id)
    out, _ = fake_step(scheduler)
    entry = next(s for s in out.scheduled if s.request is failing)
    assert entry.num_new_tokens == 20  # the whole prompt, computed here
    while scheduler.num_unfinished:
        fake_step(scheduler)
    scheduler.kv.pool.check_all_free()
