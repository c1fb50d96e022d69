"""KV memory of one long sequence with the sliding-window layers' blocks freed as the
window passes (engine_service/kv_cache/sliding.py), and without.

Measured: a tiny random Mistral (every layer sliding) and Gemma 2 (every other layer),
window 32, one request decoded to ``--length`` tokens on this engine; the blocks each
layer group holds at the end are read from the engine's own tables. Then the same rule
(``SlidingWindowBlocks.blocks_needed_per_request``) applied to released shapes at 32k
tokens: the bytes a sequence costs with the window and without.

    python -m benchmarks.sliding_window_kv [--length 480]
"""

from __future__ import annotations

import argparse
import tempfile

from engine_service.kv_cache.sliding import SlidingWindowBlocks

# name: (layers, sliding layers, kv heads, head_dim, window, context); bf16 KV (2 bytes).
SHAPES = {
    "Mistral-7B-v0.1": (32, 32, 8, 128, 4096, 32768),
    "Gemma-2-9B": (42, 21, 8, 256, 4096, 8192),
    "Gemma-3-12B": (48, 40, 8, 256, 1024, 131072),
}


def measured(length: int) -> None:
    from engine_service.config import EngineConfig
    from engine_service.core import EngineCore
    from engine_service.make_model import make_model
    from tandem.protocol.outputs import EngineCoreRequest
    from tandem.protocol.sampling_params import SamplingParams

    chunk, bs = 64, 16
    for arch in ("mistral", "gemma2"):
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = make_model(tmp, arch=arch, preset="tiny", seed=0)
            core = EngineCore(EngineConfig(
                model=model_dir, max_model_len=length + 16, max_num_seqs=1, max_num_batched_tokens=chunk,
                enable_prefix_caching=False, device="cpu", block_size=bs,
            ))
            window = core.kv_manager.window
            assert window is not None
            prompt = [(7 * i) % 1000 + 3 for i in range(length // 2)]
            params = SamplingParams(temperature=0.0, max_tokens=length - len(prompt), ignore_eos=True)
            core.add_request(EngineCoreRequest("r", prompt, params))
            most = 0
            while core.has_unfinished_requests():
                core.step()
                most = max(most, window.num_held("r"))
            mc = core.model_config
            layers = mc.num_layers
            sliding = sum(mc.is_sliding(i) for i in range(layers))
            full_blocks = -(-length // bs)
            without = layers * full_blocks
            with_window = (layers - sliding) * full_blocks + sliding * most
            print(
                f"{arch:8s} tiny, {length} tokens, window {mc.sliding_window}: sliding layers held at most "
                f"{most} blocks (bound {SlidingWindowBlocks.blocks_needed_per_request(mc.sliding_window, bs, chunk)}), "
                f"full-length {full_blocks}; layer-blocks {with_window} vs {without} "
                f"({with_window / without:.2f}x)"
            )


def projected(tokens: int, chunk: int, bs: int) -> None:
    longest = tokens
    for name, (layers, sliding, kv_heads, head_dim, window, context) in SHAPES.items():
        tokens = min(longest, context)
        per_block = 2 * kv_heads * head_dim * bs * 2  # K and V, bf16, one layer
        full = -(-tokens // bs)
        held = min(full, SlidingWindowBlocks.blocks_needed_per_request(window, bs, chunk))
        without = layers * full * per_block
        with_window = ((layers - sliding) * full + sliding * held) * per_block
        print(
            f"{name:16s} {tokens} tokens, window {window}, chunk {chunk}: "
            f"{without / 2**30:.2f} GiB -> {with_window / 2**30:.2f} GiB ({with_window / without:.2f}x)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=480, help="tokens of the measured sequence")
    parser.add_argument("--tokens", type=int, default=32768, help="sequence length for the released shapes (at most each one's context)")
    parser.add_argument("--chunk", type=int, default=2048, help="max tokens one step computes for the request")
    args = parser.parse_args()
    measured(args.length)
    projected(args.tokens, args.chunk, 16)


if __name__ == "__main__":
    main()
