"""Greedy argmax through the int8 screen of a float32 LM head: the token is the float32
argmax bit for bit (ties, near ties, 1..8 rows), the error bounds hold, the engine's
greedy tokens do not change, and the screen steps aside where it cannot decide."""

from __future__ import annotations

import pytest
import torch

from engine_service.config import EngineConfig
from engine_service.core import EngineCore
from engine_service.models import decoder
from kernels.cpu_ops import native_available
from kernels.panel_linear import (
    SCREEN_MAX_ROWS,
    SCREEN_MAX_TILES,
    ArgmaxScreen,
    argmax_screen,
    pack_panels,
    panel_linear,
    panel_linear_argmax,
    panel_linear_argmax_screened,
    round_x_16bit,
)
from tests.test_panel_linear import _greedy  # greedy tokens of an EngineCore, per request

pytestmark = pytest.mark.skipif(not native_available(), reason="native CPU kernels need a C++ compiler")


def _screened(x: torch.Tensor, screen: ArgmaxScreen, max_tiles: int = SCREEN_MAX_TILES) -> tuple[torch.Tensor, int]:
    """(tokens, rows that sent the call to the full float32 argmax)."""
    out = torch.empty(x.shape[0], screen.exact.out_features)
    tokens = torch.empty(x.shape[0], dtype=torch.int64)
    undecided = torch.ops.tandem_cpu.panel_linear_argmax_screened(
        out, tokens, x, screen.exact.panels, screen.screen.panels, screen.screen.scale, screen.bounds, max_tiles
    )
    return tokens, int(undecided)


def _case(gen: torch.Generator) -> tuple[torch.Tensor, ArgmaxScreen]:
    n = int(torch.randint(40, 2500, (), generator=gen))
    k = int(torch.randint(16, 700, (), generator=gen))
    w = torch.randn(n, k, generator=gen) * 0.05
    return w, argmax_screen(w, pack_panels(w, quantize=False))


def test_screened_argmax_is_the_float32_argmax_on_ties_and_near_ties() -> None:
    """Every row has a planted maximum the screen can isolate: an exact tie (one weight
    row copied to columns in other tiles: the first column wins) or a near tie within the
    int8 error (the int8 scores often order it wrongly; the float32 recomputation must). 1..8 rows: a row's
    float32 result depends on how many rows share its register block."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    for _ in range(24):
        w, screen = _case(gen)
        n, k = w.shape
        m = int(torch.randint(1, SCREEN_MAX_ROWS + 1, (), generator=gen))
        cols = torch.randperm(n, generator=gen)[: 3 * m].view(m, 3).tolist()
        x = torch.empty(m, k)
        for r, (c0, c1, c2) in enumerate(cols):
            w[c0] *= 3  # |w_c0|^2 above every other column's product with w_c0
            if r % 2 == 0:
                w[c1] = w[c2] = w[c0]  # exact three-way tie
            else:  # near ties: rivals as far from c0 as the int8 step (~1.4e-3), in any order
                w[c1] = w[c0] + torch.randn(k, generator=gen) * 1e-3
                w[c2] = w[c0] + torch.randn(k, generator=gen) * 1e-3
        exact = pack_panels(w, quantize=False)
        screen = argmax_screen(w, exact)
        for r, (c0, _, _) in enumerate(cols):
            x[r] = w[c0] * 40 + torch.randn(k, generator=gen) * 0.01
        tokens, undecided = _screened(x, screen)
        assert undecided == 0, (n, k, m)
        want = panel_linear_argmax(x, exact, None)
        assert torch.equal(tokens, want), (n, k, m, tokens, want)
        # Equal weight rows score the same bit for bit only where the kernel sums them in
        # the same order: on AVX-512 a column's lane position in its tile can change the
        # last bit. Among the tied columns that do score the maximum, the first wins.
        logits = panel_linear(x, exact, None)
        for r, (c0, c1, c2) in enumerate(cols):
            if r % 2 == 0:
                best = max(float(logits[r, c]) for c in (c0, c1, c2))
                assert int(tokens[r]) == min(c for c in (c0, c1, c2) if float(logits[r, c]) == best)


def test_screened_argmax_is_the_float32_argmax_on_random_rows() -> None:
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    for _ in range(24):
        w, screen = _case(gen)
        x = torch.randn(int(torch.randint(1, SCREEN_MAX_ROWS + 1, (), generator=gen)), w.shape[1], generator=gen)
        tokens, _ = _screened(x, screen)
        assert torch.equal(tokens, panel_linear_argmax(x, screen.exact, None))
        assert torch.equal(panel_linear_argmax_screened(x, screen), tokens)


def test_screen_error_bound_holds_for_every_column() -> None:
    """|float32 score - int8 score| <= |x| U + |x - x'| V for every column (x' the 16-bit
    rounding the int8 kernel multiplies), and the bound is far narrower than the scores'
    spread (else the screen would keep every column)."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    for _ in range(8):
        w, screen = _case(gen)
        n = w.shape[0]
        x = torch.randn(3, w.shape[1], generator=gen) * float(torch.rand((), generator=gen) * 10 + 0.1)
        exact = panel_linear(x, screen.exact, None).double()
        approx = panel_linear(x, screen.screen, None).double()
        d = (x - round_x_16bit(x)).double().norm(dim=1, keepdim=True)
        u, v = screen.bounds[0, :n].double(), screen.bounds[1, :n].double()
        bound = x.double().norm(dim=1, keepdim=True) * u + d * v
        assert bool(((exact - approx).abs() <= bound).all())
        assert float(bound.max()) < 0.5 * float(exact.std())


def test_screen_hands_over_to_the_full_argmax_when_it_cannot_decide() -> None:
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    w, screen = _case(gen)
    x = torch.randn(4, w.shape[1], generator=gen)
    want = panel_linear_argmax(x, screen.exact, None)
    tokens, undecided = _screened(x, screen, max_tiles=0)  # no candidate tile allowed
    assert undecided > 0 and torch.equal(tokens, want)
    # Every score 0: every column is a candidate, in more tiles (32 columns) than allowed.
    wide = torch.randn(32 * SCREEN_MAX_TILES + 40, 64, generator=gen)
    tokens, undecided = _screened(torch.zeros(2, 64), argmax_screen(wide, pack_panels(wide, quantize=False)))
    assert undecided > 0 and tokens.tolist() == [0, 0]
    x[1, 3] = float("inf")
    tokens, undecided = _screened(x, screen)
    assert undecided > 0 and torch.equal(tokens, panel_linear_argmax(x, screen.exact, None))


def test_no_screen_for_weights_that_are_not_finite() -> None:
    w = torch.randn(64, 32)
    w[7, 3] = float("nan")
    assert argmax_screen(w, pack_panels(w, quantize=False)) is None
    with pytest.raises(ValueError, match="float32 panels"):
        argmax_screen(w, pack_panels(w, quantize=True))


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_llama_untied_dir", "tiny_qwen3_dir"])
def test_engine_greedy_tokens_are_the_same_with_the_screen(
    fixture: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Greedy decoding of 1 and of 5 sequences gives the same tokens with the screen as
    without it, and the screened path is the one that ran."""
    model_dir: str = request.getfixturevalue(fixture)
    common = dict(model=model_dir, device="cpu", max_model_len=128, num_gpu_blocks_override=64)
    screened = EngineCore(EngineConfig(**common))
    plain = EngineCore(EngineConfig(lm_head_screen=False, **common))
    assert screened.model.lm_head_screen is not None and plain.model.lm_head_screen is None
    calls = {"n": 0}
    real = decoder.panel_linear_argmax_screened

    def counted(*args: object) -> torch.Tensor:
        calls["n"] += 1
        return real(*args)

    monkeypatch.setattr(decoder, "panel_linear_argmax_screened", counted)
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    vocab = screened.model_config.vocab_size
    for count in (1, 5):
        prompts = [torch.randint(3, vocab, (int(n),), generator=gen).tolist() for n in (3, 9, 17, 30, 41)[:count]]
        assert _greedy(screened, prompts, 16) == _greedy(plain, prompts, 16)
    assert calls["n"] > 0


def test_screen_only_for_float32_panels_and_its_flag(tiny_llama_dir: str) -> None:
    common = dict(model=tiny_llama_dir, device="cpu", max_model_len=64, num_gpu_blocks_override=16)
    assert EngineCore(EngineConfig(quantization="int8", **common)).model.lm_head_screen is None
    import argparse

    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    assert parser.parse_args([]).lm_head_screen is True
    assert parser.parse_args(["--no-lm-head-screen"]).lm_head_screen is False
