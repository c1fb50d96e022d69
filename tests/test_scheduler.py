"""Scheduler and KV-cache manager behaviour, without a model."""

from __future__ import annotations

import random

import pytest

from engine_service.kv_cache.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from engine_service.request import RequestStatus
from tandem.protocol.outputs import FinishReason
from tests.factories import fake_step, make_request, make_scheduler, run_until_done

# ---- block pool -----------------------------------------------------------------------


def test_free_queue_is_lru_and_supports_middle_removal() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    assert [b.block_id for b in q] == [0, 1, 3, 4]
    q.append(blocks[2])
    assert q.popleft().block_id == 0
    assert [b.block_id for b in q] == [1, 3, 4, 2]
    assert q.num_free == 4


def test_pool_refcounts_and_eviction() -> None:
    pool = BlockPool(4, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, b"h-a")
    pool.free_blocks([a, b])
    pool.check_invariants()
    assert pool.get_cached_block(b"h-a") is a
    pool.touch([a])  # a prefix hit pulls the free block back out
    assert a.ref_cnt == 1 and pool.num_free_blocks == 3
    pool.free_blocks([a])
    # Taking all blocks evicts the cached one, in LRU order.
    taken = pool.get_new_blocks(4)
    assert pool.get_cached_block(b"h-a") is None
    assert all(x.block_hash is None for x in taken)
    with pytest.raises(RuntimeError):
        pool.get_new_blocks(1)
    pool.free_blocks(taken)
    with pytest.raises(RuntimeError, match="double free"):
        pool.free_blocks([taken[0]])
    pool.check_all_free()


# ---- scheduling -----------------------------------------------------------------------


def test_decode_and_prefill_share_the_token_budget() -> None:
    sched = make_scheduler(max_num_batched_tokens=10, block_size=4)
    r1 = make_request(6, max_tokens=4)
    r2 = make_request(12, max_tokens=4)
    sched.add_request(r1)
    sched.add_request(r2)
    out, _ = fake_step(sched)
    # r1's prompt (6) fits, r2 gets the remaining 4 tokens as a chunk.
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [
        (r1.request_id, 6),
        (r2.request_id, 4),
    ]
    assert r1.num_output_tokens == 1 and r2.num_output_tokens == 0
    out, _ = fake_step(sched)
    # r1 decodes (1 token), r2 continues its prefill with what is left of the budget.
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [
        (r1.request_id, 1),
        (r2.request_id, 8),
    ]
    assert r2.num_computed_tokens == 12 and r2.num_output_tokens == 1
    run_until_done(sched)
    sched.kv.pool.check_all_free()


def test_no_chunking_waits_for_budget() -> None:
    sched = make_scheduler(max_num_batched_tokens=8, chunked=False)
    sched.add_request(make_request(6))
    big = make_request(7)
    sched.add_request(big)
    out, _ = fake_step(sched)
    assert len(out.scheduled) == 1
    run_until_done(sched)
    assert big.num_output_tokens == 8


def test_max_num_seqs_caps_running() -> None:
    sched = make_scheduler(max_num_seqs=3)
    for _ in range(5):
        sched.add_request(make_request(4))
    out, _ = fake_step(sched)
    assert len(out.scheduled) == 3 and len(sched.lifecycle.waiting) == 2
    run_until_done(sched)


def test_preemption_by_recompute_when_blocks_run_out() -> None:
    # 6 blocks of 4 tokens; two requests each growing to 12 tokens need 3+3 blocks,
    # three need 9: the last-admitted one is preempted and recomputed later.
    sched = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=64)
    reqs = [make_request(4, max_tokens=8) for _ in range(3)]
    for r in reqs:
        sched.add_request(r)
    preempted = []
    while sched.num_unfinished:
        out, _ = fake_step(sched)
        preempted += out.preempted_ids
        sched.kv.pool.check_invariants()
    assert preempted, "expected at least one preemption"
    assert all(r.num_output_tokens == 8 and r.finish_reason == FinishReason.LENGTH for r in reqs)
    assert max(r.num_preemptions for r in reqs) >= 1
    sched.kv.pool.check_all_free()


def test_priority_policy_orders_and_preempts_lowest_priority() -> None:
    sched = make_scheduler(num_blocks=6, block_size=4, max_num_seqs=1, policy="priority")
    low = make_request(4, priority=5, arrival=1.0)
    high = make_request(4, priority=0, arrival=2.0)
    sched.add_request(low)
    sched.add_request(high)
    out, _ = fake_step(sched)
    assert out.scheduled[0].request is high  # lower value first despite arriving later

    sched = make_scheduler(num_blocks=4, block_size=4, policy="priority")
    a = make_request(4, max_tokens=8, priority=0, arrival=1.0)
    b = make_request(4, max_tokens=8, priority=9, arrival=2.0)
    sched.add_request(a)
    sched.add_request(b)
    preempted = []
    while sched.num_unfinished:
        out, _ = fake_step(sched)
        preempted += out.preempted_ids
    assert preempted and set(preempted) == {b.request_id}
    sched.kv.pool.check_all_free()


def test_abort_in_every_state_frees_blocks() -> None:
    sched = make_scheduler(max_num_seqs=2, max_num_batched_tokens=8)
    running = make_request(6, max_tokens=50)
    partial = make_request(30, max_tokens=50)  # mid chunked prefill
    waiting = make_request(4, max_tokens=50)
    for r in (running, partial, waiting):
        sched.add_request(r)
    fake_step(sched)
    fake_step(sched)
    assert running.status == RequestStatus.RUNNING
    assert 0 < partial.num_computed_tokens < partial.num_tokens
    assert waiting.status == RequestStatus.WAITING
    done = sched.finish_requests(
        [running.request_id, partial.request_id, waiting.request_id, "unknown"], FinishReason.ABORT
    )
    assert {r.request_id for r in done} == {running.request_id, partial.request_id, waiting.request_id}
    assert all(r.finish_reason == FinishReason.ABORT for r in done)
    sched.kv.pool.check_all_free()
    assert sched.num_unfinished == 0


def test_stop_conditions() -> None:
    sched = make_scheduler()
    eos = make_request(4, max_tokens=10)
    stop_tok = make_request(4, max_tokens=10, stop_token_ids=[7])
    min_tok = make_request(4, max_tokens=10, min_tokens=3, stop_token_ids=[7])
    ignore = make_request(4, max_tokens=3, ignore_eos=True)
    for r in (eos, stop_tok, min_tok, ignore):
        sched.add_request(r)
    out = sched.schedule()
    sampled = {eos.request_id: 0, stop_tok.request_id: 7, min_tok.request_id: 7, ignore.request_id: 0}
    sched.update_after_step(out, sampled)
    finished = sched.take_ended()
    assert {r.request_id for r in finished} == {eos.request_id, stop_tok.request_id}
    assert eos.finish_reason == FinishReason.STOP and eos.stop_reason is None
    assert stop_tok.finish_reason == FinishReason.STOP and stop_tok.stop_reason == 7
    for _ in range(2):
        fake_step(sched, token=7)
    assert min_tok.finish_reason == FinishReason.STOP and min_tok.num_output_tokens == 3
    assert ignore.finish_reason == FinishReason.LENGTH and ignore.output_token_ids == [0, 7, 7]


def test_max_model_len_stops_generation() -> None:
    sched = make_scheduler(max_model_len=10)
    r = make_request(8, max_tokens=100)
    sched.add_request(r)
    run_until_done(sched)
    assert r.finish_reason == FinishReason.LENGTH and r.num_tokens == 10


def test_prefix_cache_hits_and_salt() -> None:
    sched = make_scheduler(block_size=4)
    shared = [random.randrange(1, 1000) for _ in range(12)]
    first = make_request([*shared, 5, 6], max_tokens=2)
    sched.add_request(first)
    run_until_done(sched)
    assert sched.stats().prefix_cache_hits == 0  # also resets the counters
    second = make_request([*shared, 8], max_tokens=2)
    salted = make_request([*shared, 8], max_tokens=2, request_id="salted")
    salted.cache_salt = "tenant-b"
    sched.add_request(second)
    sched.add_request(salted)
    out, _ = fake_step(sched)
    assert second.num_cached_tokens == 12
    assert salted.num_cached_tokens == 0
    assert out.scheduled[0].num_new_tokens == 1  # only the uncached tail runs
    stats = sched.stats()
    assert stats.prefix_cache_hits == 12 and stats.prefix_cache_queries == 26
    run_until_done(sched)
    sched.kv.pool.check_all_free()


def test_full_prompt_hit_still_computes_last_token() -> None:
    sched = make_scheduler(block_size=4)
    prompt = list(range(1, 9))  # exactly two blocks
    sched.add_request(make_request(prompt, max_tokens=1))
    run_until_done(sched)
    again = make_request(prompt, max_tokens=1)
    sched.add_request(again)
    out, _ = fake_step(sched)
    assert again.num_cached_tokens == 4 and out.scheduled[0].num_new_tokens == 4


def test_random_workload_keeps_invariants() -> None:
    rng = random.Random(0)
    sched = make_scheduler(num_blocks=40, block_size=4, max_num_seqs=6, max_num_batched_tokens=24)
    reqs = []
    for step in range(400):
        if rng.random() < 0.3 and len(reqs) < 60:
            r = make_request(rng.randint(1, 40), max_tokens=rng.randint(1, 20))
            reqs.append(r)
            sched.add_request(r)
        if rng.random() < 0.05 and sched.requests:
            sched.finish_requests([rng.choice(list(sched.requests))], FinishReason.ABORT)
        fake_step(sched, token=rng.randrange(1, 100))
        sched.kv.pool.check_invariants()
        for s in sched.lifecycle.running:
            assert s.num_computed_tokens <= s.num_tokens
        if step > 300 and not sched.num_unfinished:
            break
    run_until_done(sched)
    sched.kv.pool.check_all_free()
    assert all(r.is_finished for r in reqs)
