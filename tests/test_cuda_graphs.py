"""Decode graphs (engine_service/cuda_graphs.py): the fixed buffers, the padding rows and
the sleep-mode hand-off, on CPU with ``eager_capture`` (a replay runs the forward
again). The CUDA capture itself runs where a GPU is (tests/test_engine_parity.py's
CUDA set-up goes through it)."""

from __future__ import annotations

import random

import pytest
import torch

from engine_service.config import EngineConfig
from engine_service.core import EngineCore
from engine_service.cuda_graphs import DecodeGraphs, capture_sizes, eager_capture
from tandem.protocol.outputs import EngineCoreRequest
from tandem.protocol.sampling_params import SamplingParams

MAX_BATCH = 8


def test_capture_sizes() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(128) == [1, 2, 4, 8, *range(16, 129, 16)]
    assert capture_sizes(40) == [1, 2, 4, 8, 16, 32, 40]


def _core(model_dir: str, **overrides: object) -> EngineCore:
    settings: dict = dict(model=model_dir, device="cpu", max_model_len=128, max_num_seqs=MAX_BATCH,
                          num_gpu_blocks_override=96)
    return EngineCore(EngineConfig(**{**settings, **overrides}))


def _install_graphs(core: EngineCore) -> list[int]:
    """Graphs over the core's model and cache; returns the list replays append their size to."""
    cfg = core.config
    graphs = DecodeGraphs(MAX_BATCH, -(-core.max_model_len // cfg.block_size), cfg.torch_device, capture=eager_capture)
    core.runner.graphs = graphs
    core.runner.capture_cuda_graphs()
    return _count_replays(graphs)


def _count_replays(graphs: DecodeGraphs) -> list[int]:
    """Wrap each captured graph's replay; returns the list they append their size to."""
    replays: list[int] = []
    for size, (replay, out) in list(graphs._graphs.items()):
        def counted(replay=replay, size=size) -> None:
            replays.append(size)
            replay()
        graphs._graphs[size] = (counted, out)
    return replays


def _generate(core: EngineCore, prompts: list[list[int]], max_tokens: list[int]) -> dict[str, list[int]]:
    got: dict[str, list[int]] = {}
    for i, (p, n) in enumerate(zip(prompts, max_tokens, strict=True)):
        core.add_request(EngineCoreRequest(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)))
        got[f"r{i}"] = []
    while core.has_unfinished_requests():
        for o in core.step().all_outputs():
            got[o.request_id] += o.new_token_ids
    return got


@pytest.fixture(scope="module")
def cores(tiny_llama_dir: str) -> tuple[EngineCore, EngineCore]:
    return _core(tiny_llama_dir), _core(tiny_llama_dir)


def test_padded_graph_decode_matches_eager(cores: tuple[EngineCore, EngineCore]) -> None:
    eager, graphed = cores
    assert eager.runner.graphs is None  # CPU: no graphs unless a test installs them
    replays = _install_graphs(graphed)
    rng = random.Random(1234)  # greedy tokens compared exactly, as the parity tests do
    vocab = eager.model_config.vocab_size
    # Five requests of different lengths and budgets: decode batches of 5, 4, 3, 2, 1
    # rows run padded to 8, 4, 4, 2, 1, and block tables of different widths.
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(3, 40))] for _ in range(5)]
    budgets = [3, 9, 14, 20, 26]
    want = _generate(eager, prompts, budgets)
    got = _generate(graphed, prompts, budgets)
    assert got == want
    assert {8, 4, 2, 1} <= set(replays)


def test_no_fitting_graph_runs_eagerly(cores: tuple[EngineCore, EngineCore]) -> None:
    _, graphed = cores
    graphs = graphed.runner.graphs
    assert graphs is not None and graphs.captured
    assert graphs.padded_size(MAX_BATCH) == MAX_BATCH and graphs.padded_size(MAX_BATCH + 1) is None
    graphed.runner.release_cuda_graphs()
    assert graphs.padded_size(1) is None
    got = _generate(graphed, [[5, 6, 7]], [4])
    assert len(got["r0"]) == 4


def test_sleep_releases_and_wake_recaptures(tiny_llama_dir: str) -> None:
    core = _core(tiny_llama_dir)
    _install_graphs(core)
    prompt = [[9, 10, 11, 12]]
    before = _generate(core, prompt, [6])
    core.sleep(1)
    assert not core.runner.graphs.captured
    core.wake_up()
    assert core.runner.graphs.captured  # over the new KV cache
    assert _generate(core, prompt, [6]) == before


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graphs_match_eager_on_the_gpu(tiny_llama_dir: str) -> None:
    """The real capture: float32 on the GPU, graphs (the default) against enforce_eager."""
    graphed = _core(tiny_llama_dir, device="cuda", dtype="float32")
    eager = _core(tiny_llama_dir, device="cuda", dtype="float32", enforce_eager=True)
    assert eager.runner.graphs is None
    graphs = graphed.runner.graphs
    assert graphs is not None and graphs.captured and graphs.sizes == [1, 2, 4, 8]
    used = _count_replays(graphs)
    rng = random.Random(4321)
    vocab = eager.model_config.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(3, 60))] for _ in range(6)]
    budgets = [2, 5, 9, 17, 24, 33]
    assert _generate(graphed, prompts, budgets) == _generate(eager, prompts, budgets)
    assert {8, 4, 2, 1} <= set(used)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("level", [1, 2])
def test_cuda_graphs_after_sleep_and_wake(tiny_llama_dir: str, level: int) -> None:
    """Sleep moves (level 1) or reloads (level 2) the weights and frees the KV cache: the
    graphs captured on wake read the new addresses."""
    core = _core(tiny_llama_dir, device="cuda", dtype="float32")
    prompts = [[9, 10, 11, 12], [13, 14, 15, 16, 17, 18]]
    before = _generate(core, prompts, [7, 11])
    core.sleep(level)
    assert not core.runner.graphs.captured
    core.wake_up()
    assert core.runner.graphs.captured
    assert _generate(core, prompts, [7, 11]) == before
