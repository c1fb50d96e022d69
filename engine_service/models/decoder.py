"""One decoder-only transformer for every supported family, through typed options.

``ModelConfig.features`` (``ArchitectureFeatures``) and its per-layer fields say how a
family differs from Llama: biases, QK-norm (per head or whole), Gemma's sandwich norms,
(1 + w) norm scales, scaled embeddings, soft-capping and GeGLU, sliding-window layers
with their own rope base, partial rotary, and mixture-of-experts MLPs (moe.py).

The model runs a flattened batch (all sequences' new tokens in one ``[num_tokens]``
row) against a paged KV cache, calling the ``KernelOps`` it was given for normalisation,
rotary, cache writes and attention. q/k/v and gate/up are fused into one matrix each
(``qkv_proj``, ``gate_up_proj``); the loader maps the checkpoint's separate tensors in.

Parameters are created uninitialised: ``engine_service.models.loader`` fills every one.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from engine_service.attention import AttentionMetadata
from engine_service.models.layers import (
    MLP,
    FusedLinear,
    PackedWeight,
    RMSNormWeight,
    empty_param,
    pack_linear_weight,
    packed_matmul,
)
from engine_service.models.moe import MoEBlock
from engine_service.models.quantized import Fp8Rows, Int4Rows, QuantizedRows
from engine_service.models.rotary import build_cos_sin_cache
from kernels.dispatch import KernelOps
from kernels.int4_linear import check_int4, int4_panels_shape, pack_int4_panels
from kernels.panel_linear import (
    ArgmaxScreen,
    PanelArena,
    PanelWeight,
    argmax_screen,
    pack_panels,
    pack_panels_grouped,
    panel_linear_argmax,
    panel_linear_argmax_screened,
    panels_shape,
)
from tandem.protocol.model_config import ModelConfig

KVCache = tuple[torch.Tensor, torch.Tensor]  # each [num_blocks, block_size, num_kv_heads, head_dim]


def _int4_group_ok(in_k: int, group: int) -> bool:
    """Whether the 4-bit kernel takes an inner size ``in_k`` in groups of ``group``."""
    try:
        check_int4(in_k, group)
    except ValueError:
        return False
    return True


def _panel_slot(shape: torch.Size, kind: str) -> tuple[int, int, int]:
    """The panels' shape of an ``[out, in]`` weight packed as ``kind`` (see ``_stored_kind``)."""
    if kind in ("int4", "int5"):
        return int4_panels_shape(shape[0], shape[1], kind == "int5")
    return panels_shape(shape[0], shape[1], kind != "float")


def _symmetric_int8(rows: Int4Rows) -> QuantizedRows | None:
    """4- or 5-bit rows whose min is -8 or -16 times their scale (GGUF Q4_0, Q5_0) as the
    int8 values ``code - 8`` / ``code - 16`` with the same scales: exactly the same weight;
    None for others."""
    offset = 8.0 if rows.high is None else 16.0
    if rows.perm is not None or not bool((rows.mins == -offset * rows.scales).all()):
        return None
    values = (rows.unpacked().to(torch.int16) - int(offset)).to(torch.int8)
    return QuantizedRows(values, rows.scales, rows.group)


class Attention(nn.Module):
    """Grouped-query self-attention over the paged KV cache."""

    def __init__(
        self, config: ModelConfig, ops: KernelOps, dtype: torch.dtype, device: torch.device, layer: int = 0
    ) -> None:
        super().__init__()
        self.ops = ops
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.q_size
        self.kv_size = config.kv_size
        self.eps = config.rms_norm_eps
        features = config.features
        self.scale = features.query_scale if features.query_scale is not None else config.head_dim**-0.5
        self.sliding_window = config.window_of(layer)
        self.softcap = features.attn_softcap
        self.clip_qkv = features.clip_qkv
        self.rotary_dim = config.rotary_dim  # None: all of head_dim
        # Gemma 3's sliding layers rotate by their own base (DecoderForCausalLM.local_cos_sin_cache).
        self.local_rope = config.rope_local_theta is not None and config.is_sliding(layer)
        # Plain layers take the backend's fused kernels; the others its general path.
        self.plain = self.sliding_window is None and self.softcap is None
        # Output rows: [q (q_size) | k (kv_size) | v (kv_size)].
        self.qkv_proj = FusedLinear(
            config.hidden_size, self.q_size + 2 * self.kv_size, features.qkv_bias, dtype, device, ops
        )
        self.o_proj = FusedLinear(self.q_size, config.hidden_size, features.o_proj_bias, dtype, device, ops)
        # Per head ([head_dim] scales), or OLMoE's over the whole of q and of k.
        q_norm_size, k_norm_size = (self.q_size, self.kv_size) if features.qk_norm_whole else (self.head_dim,) * 2
        has_qk_norm = features.qk_norm or features.qk_norm_whole
        self.q_norm = RMSNormWeight(q_norm_size, dtype, device) if has_qk_norm else None
        self.k_norm = RMSNormWeight(k_norm_size, dtype, device) if has_qk_norm else None

    def forward(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden_size]
        positions: torch.Tensor,  # [num_tokens] int64
        kv_cache: KVCache,
        attn_metadata: AttentionMetadata,
        cos_sin_cache: torch.Tensor,  # [max_position, head_dim] float32
        attn_out: torch.Tensor,  # [num_tokens, num_heads, head_dim], scratch shared by layers
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)  # [num_tokens, q_size + 2 * kv_size]
        q, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        if self.q_norm is not None and self.k_norm is not None:
            # Rows of [head_dim] (a (token, head) pair each), or whole q / k rows (OLMoE).
            size_q, size_k = self.q_norm.weight.shape[0], self.k_norm.weight.shape[0]
            q, _ = self.ops.rms_norm(q.reshape(-1, size_q), self.q_norm.weight, self.eps)
            k, _ = self.ops.rms_norm(k.reshape(-1, size_k), self.k_norm.weight, self.eps)
        if self.clip_qkv is not None:  # after the norms (OLMoE)
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        key_cache, value_cache = kv_cache
        slots, tables = attn_metadata.slot_mapping, attn_metadata.block_tables
        if self.sliding_window is not None and attn_metadata.window_block_tables is not None:
            # This layer's KV lives in the sliding-window blocks (kv_cache/sliding.py).
            slots, tables = attn_metadata.window_slot_mapping, attn_metadata.window_block_tables
        if self.rotary_dim is None:
            # Rotates q and k in place, then writes the rotated k and v into their cache slots.
            self.ops.rotary_and_cache(positions, q, k, v, cos_sin_cache, key_cache, value_cache, slots)
        else:  # partial rotary: the first rotary_dim of each head turn, the rest pass
            q, k = q.contiguous(), k.contiguous()
            rot = self.rotary_dim
            q_rot, k_rot = q[..., :rot].clone(), k[..., :rot].clone()
            self.ops.rotary_embedding(positions, q_rot, k_rot, cos_sin_cache)
            q[..., :rot], k[..., :rot] = q_rot, k_rot
            self.ops.reshape_and_cache(k, v, key_cache, value_cache, slots)
        args = (
            q,
            key_cache,
            value_cache,
            tables,
            attn_metadata.query_start_loc,
            attn_metadata.seq_lens,
            self.scale,
        )
        if self.plain:
            self.ops.paged_attention(*args, out=attn_out, workspace=attn_metadata.workspace)
        else:
            self.ops.windowed_attention(
                *args,
                out=attn_out,
                workspace=attn_metadata.workspace,
                sliding_window=self.sliding_window,
                softcap=self.softcap,
            )
        return self.o_proj(attn_out.view(num_tokens, self.q_size))


class DecoderLayer(nn.Module):
    """Pre-norm block: ``h += attn(norm(h)); h += mlp(norm(h))``, residual add fused into the norms.

    With sandwich norms (Gemma 2/3) each branch's output is normed before the add:
    ``h += post_attention_norm(attn(input_norm(h))); h += post_ff_norm(mlp(pre_ff_norm(h)))``.
    """

    def __init__(
        self, config: ModelConfig, ops: KernelOps, dtype: torch.dtype, device: torch.device, layer: int = 0
    ) -> None:
        super().__init__()
        self.ops = ops
        self.eps = config.rms_norm_eps
        h = config.hidden_size
        self.input_layernorm = RMSNormWeight(h, dtype, device)
        self.self_attn = Attention(config, ops, dtype, device, layer)
        self.post_attention_layernorm = RMSNormWeight(h, dtype, device)
        sandwich = config.features.sandwich_norms
        self.pre_feedforward_layernorm = RMSNormWeight(h, dtype, device) if sandwich else None
        self.post_feedforward_layernorm = RMSNormWeight(h, dtype, device) if sandwich else None
        self.mlp: nn.Module = (
            MoEBlock(config, ops, dtype, device) if config.is_moe_layer(layer) else MLP(config, ops, dtype, device)
        )

    def forward(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden_size]: the previous block's output
        residual: torch.Tensor | None,  # [num_tokens, hidden_size]; None for the first layer
        positions: torch.Tensor,
        kv_cache: KVCache,
        attn_metadata: AttentionMetadata,
        cos_sin_cache: torch.Tensor,
        attn_out: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Invariant: the residual stream equals hidden + residual (residual None = 0).
        if residual is None:
            residual = hidden
            normed, _ = self.ops.rms_norm(hidden, self.input_layernorm.weight, self.eps)
        else:
            normed, residual = self.ops.rms_norm(hidden, self.input_layernorm.weight, self.eps, residual)
        hidden = self.self_attn(normed, positions, kv_cache, attn_metadata, cos_sin_cache, attn_out)
        if self.pre_feedforward_layernorm is None or self.post_feedforward_layernorm is None:
            normed, residual = self.ops.rms_norm(hidden, self.post_attention_layernorm.weight, self.eps, residual)
            return self.mlp(normed), residual
        hidden, _ = self.ops.rms_norm(hidden, self.post_attention_layernorm.weight, self.eps)
        normed, residual = self.ops.rms_norm(hidden, self.pre_feedforward_layernorm.weight, self.eps, residual)
        hidden, _ = self.ops.rms_norm(self.mlp(normed), self.post_feedforward_layernorm.weight, self.eps)
        return hidden, residual


class DecoderForCausalLM(nn.Module):
    """Llama / Qwen2 / Qwen3 causal LM over a paged KV cache."""

    def __init__(self, config: ModelConfig, ops: KernelOps, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.config = config
        self.ops = ops
        self.embed_tokens = empty_param(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(
            DecoderLayer(config, ops, dtype, device, layer) for layer in range(config.num_layers)
        )
        self.norm = RMSNormWeight(config.hidden_size, dtype, device)
        # Tied checkpoints share the embedding matrix; no separate parameter then.
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else empty_param(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        )
        cos_sin = build_cos_sin_cache(
            config.rope_dim,
            config.max_position_embeddings,
            config.rope_theta,
            config.rope_scaling,
            device=device,
        )
        self.register_buffer("cos_sin_cache", cos_sin, persistent=False)  # [max_pos, rope_dim] f32
        # Gemma 3's sliding layers: plain rope at their local base (None elsewhere).
        local = None
        if config.rope_local_theta is not None:
            local = build_cos_sin_cache(
                config.rope_dim, config.max_position_embeddings, config.rope_local_theta, None, device=device
            )
        self.register_buffer("local_cos_sin_cache", local, persistent=False)
        self.lm_head_packed: PackedWeight | None = None  # see pack_linears()
        # Parameter name -> (row_start, rows) of checkpoint matrices stored as int8 with group
        # scales (GGUF Q8_0), set by the loader: pack_linears packs them as they are.
        self.int8_rows: dict[str, list[tuple[int, QuantizedRows]]] = {}
        # The same for 4-bit matrices (quantized.Int4Rows): GGUF Q4_*, GPTQ, AWQ.
        self.int4_rows: dict[str, list[tuple[int, Int4Rows]]] = {}
        # The same for FP8 matrices, when loaded with keep_fp8 (quantized.Fp8Rows).
        self.fp8_rows: dict[str, list[tuple[int, Fp8Rows]]] = {}
        # float32 panel LM head: its int8 screen for greedy steps (see greedy_tokens)
        self.lm_head_screen: ArgmaxScreen | None = None
        # Decode-only steps run every layer in one native call when all linear layers are
        # plain float32, int8 or 4-bit panels (see native_decode_weights); None: not built yet.
        self.native_decode = False
        # Every layer is Llama/Qwen-shaped (what the native decode call computes).
        self.plain_layers = _plain_layers(config)
        self._native_weights: tuple[list[tuple[dict, str, FusedLinear, PanelWeight]], list[torch.Tensor]] | None = (
            None
        )

    def pack_linears(self, layout: str = "onednn", lm_head_screen: bool = False) -> None:
        """Move every linear layer and the LM head onto packed weights (CPU; the layouts
        of ``pack_linear_weight``).

        The dense projection weights are freed. The LM head packs a copy: a tied
        checkpoint's embedding lookup still needs the dense matrix, so tied models hold
        ``vocab_size x hidden_size`` once more (a quarter of it for int8).
        ``lm_head_screen`` (float32 panels only): also keep an int8 copy of the LM head
        (another quarter) through which greedy steps find the argmax (``greedy_tokens``).
        """
        for module in self.modules():
            if isinstance(module, MoEBlock):
                module.pack(layout)  # its router and shared expert are FusedLinears, packed below
        linears = [module for module in self.modules() if isinstance(module, FusedLinear)]
        if layout in ("panel", "panel_int8"):
            self._pack_panels(linears, quantize=layout == "panel_int8")
            if lm_head_screen and layout == "panel" and self.lm_head_packed.group == 0:
                self.lm_head_screen = self._place_screen(argmax_screen(self.lm_head_weight, self.lm_head_packed))
        else:
            for module in linears:
                module.pack(layout)
            self.lm_head_packed = pack_linear_weight(self.lm_head_weight, layout)
        self.lm_head = None  # untied: the packed copy replaces it; tied: None already

    def _pack_panels(self, linears: list[FusedLinear], quantize: bool) -> None:
        """Every panel in huge-page ``PanelArena``s (one per dtype), packed and placed one
        weight at a time (each dense weight is freed as its panels land: ~one model copy at
        peak). A weight whose rows all came as 4-bit (``int4_rows``, e.g. GGUF Q4_*) packs
        those as 4-bit panels, codes, scales and mins as they are; one whose rows all came as
        int8 with group scales (``int8_rows``) packs those as they are; the others as float32
        panels, or int8 per channel if ``quantize``."""
        names = {id(param): name for name, param in self.named_parameters()}
        todo = [module for module in linears if module.weight is not None]
        lm_name = "embed_tokens" if self.config.tie_word_embeddings else "lm_head"
        jobs = [(names[id(module.weight)], module.weight, module) for module in todo]
        jobs.append((lm_name, self.lm_head_weight, None))
        kinds = [self._stored_kind(name, weight, quantize) for name, weight, _ in jobs]
        arena_dtype = {
            "int4": torch.uint8, "int5": torch.uint8, "grouped": torch.int8, "int8": torch.int8, "float": torch.float32,
        }
        arenas = {
            dtype: PanelArena(
                [_panel_slot(weight.shape, kind) for (_, weight, _), kind in zip(jobs, kinds)
                 if arena_dtype[kind] == dtype],
                dtype,
            )
            for dtype in (torch.uint8, torch.int8, torch.float32)
        }
        for (name, weight, module), kind in zip(jobs, kinds):
            if kind in ("int4", "int5"):
                panel = self._int4_panels(name)
            elif kind == "grouped":
                panel = self._grouped(name)
            else:
                panel = pack_panels(weight, kind == "int8")
            placed = arenas[arena_dtype[kind]].place(panel)
            if module is None:
                self.lm_head_packed = placed
            else:
                module.packed_weight = placed
                module.weight = None
        self.int8_rows = {}
        self.int4_rows = {}

    def _stored_kind(self, name: str, weight: torch.Tensor, quantize: bool) -> str:
        """How ``_pack_panels`` packs parameter ``name``: "int4" / "int5" (its 4- or 5-bit
        rows, all of them there, in groups the kernel takes, not column-permuted; a mix of
        4- and 5-bit rows packs as 5-bit), "grouped" (its int8 rows with group scales, with
        any symmetric 4- or 5-bit rows among them, Q4_0 / Q5_0, as int8 values exactly),
        "int8" (quantized per channel), or "float"."""
        parts = self.int4_rows.get(name, [])
        if sum(rows.codes.shape[0] for _, rows in parts) == weight.shape[0] and all(
            rows.perm is None and _int4_group_ok(weight.shape[1], rows.group) for _, rows in parts
        ) and len({rows.group for _, rows in parts}) == 1:
            return "int5" if any(rows.high is not None for _, rows in parts) else "int4"
        if parts and all(_symmetric_int8(rows) is not None for _, rows in parts):
            int8_parts = self.int8_rows.get(name, [])
            as_int8 = [(start, _symmetric_int8(rows)) for start, rows in parts]
            covered = sum(rows.values.shape[0] for _, rows in int8_parts + as_int8) == weight.shape[0]
            if covered and len({rows.group for _, rows in int8_parts + as_int8}) == 1:
                self.int8_rows[name] = int8_parts + as_int8
                del self.int4_rows[name]
        if self._int8_covers(name, weight.shape[0]):
            return "grouped"
        return "int8" if quantize else "float"

    def _int4_panels(self, name: str) -> PanelWeight:
        """``name``'s 4- or 5-bit rows, packed as one weight."""
        parts = [rows for _, rows in sorted(self.int4_rows[name], key=lambda part: part[0])]
        high = None
        if any(rows.high is not None for rows in parts):
            high = torch.cat([
                rows.high if rows.high is not None else torch.zeros(rows.codes.shape[0], rows.codes.shape[1] // 4,
                                                                    dtype=torch.uint8)
                for rows in parts
            ])
        return pack_int4_panels(
            torch.cat([rows.codes for rows in parts]),
            torch.cat([rows.scales for rows in parts]),
            torch.cat([rows.mins for rows in parts]),
            parts[0].group,
            high,
        )

    def _int8_covers(self, name: str, num_rows: int) -> bool:
        """Whether ``int8_rows`` holds every row of parameter ``name``, in one group size."""
        parts = self.int8_rows.get(name, [])
        return sum(rows.values.shape[0] for _, rows in parts) == num_rows and len({rows.group for _, rows in parts}) == 1

    def _grouped(self, name: str) -> PanelWeight:
        """``name``'s int8 rows with group scales, packed as one weight."""
        parts = sorted(self.int8_rows[name], key=lambda part: part[0])
        values = torch.cat([rows.values for _, rows in parts])
        scales = torch.cat([rows.scales for _, rows in parts])
        return pack_panels_grouped(values, scales, parts[0][1].group)

    def pack_quantized_cuda(self, device: torch.device | str | None = None) -> list:
        """CUDA: linear layers whose weights came as 4-bit or FP8 rows take the Triton
        kernels' packed weights and drop the dense ones (see models/gpu_quant.py)."""
        from engine_service.models.gpu_quant import pack_quantized_cuda

        return pack_quantized_cuda(self, device)

    @staticmethod
    def _place_screen(screen: ArgmaxScreen | None) -> ArgmaxScreen | None:
        """The screen with its int8 panels on huge pages (it is streamed every greedy step)."""
        if screen is None:
            return None
        arena = PanelArena([tuple(screen.screen.panels.shape)], torch.int8)
        return replace(screen, screen=arena.place(screen.screen))

    @property
    def lm_head_weight(self) -> torch.Tensor:  # [vocab_size, hidden_size]
        if self.config.tie_word_embeddings:
            return self.embed_tokens
        if self.lm_head is None:
            raise RuntimeError("the LM head was packed for oneDNN; its dense weight is gone")
        return self.lm_head

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64, all sequences' new tokens flattened
        positions: torch.Tensor,  # [num_tokens] int64
        kv_caches: list[KVCache],  # one (key, value) pair per layer
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        if input_ids.dim() != 1 or positions.shape != input_ids.shape:
            raise ValueError(
                f"input_ids and positions must both be [num_tokens], got "
                f"{tuple(input_ids.shape)} and {tuple(positions.shape)}"
            )
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"expected {len(self.layers)} KV caches (one per layer), got {len(kv_caches)}")
        num_tokens = input_ids.shape[0]
        hidden = self.embed(input_ids)  # [num_tokens, hidden_size]
        if self.native_decode and attn_metadata.max_query_len == 1 and num_tokens == attn_metadata.num_seqs:
            weights = self.native_decode_weights()
            if weights is not None:
                return self._decode_natively(hidden, positions, kv_caches, attn_metadata, weights)
        # One attention output buffer reused by every layer (o_proj consumes it at once).
        attn_out = hidden.new_empty(num_tokens, self.config.num_heads, self.config.head_dim)
        residual: torch.Tensor | None = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            cos_sin = self.local_cos_sin_cache if layer.self_attn.local_rope else self.cos_sin_cache
            hidden, residual = layer(hidden, residual, positions, kv_cache, attn_metadata, cos_sin, attn_out)
        hidden, _ = self.ops.rms_norm(hidden, self.norm.weight, self.config.rms_norm_eps, residual)
        return hidden

    def native_decode_weights(self) -> list[torch.Tensor] | None:
        """The flat weight list of ``tandem_cpu::decode_layers`` (16 per layer, in its
        ``Slot`` order), or None when a layer is not plain panel-packed (not packed,
        oneDNN, LoRA-wrapped, tensor-parallel). Panels of every dtype go in as they are
        (float32, int8, 4-bit: the native loop's ``panel_linear`` tells them apart by the
        panels' dtype, 4-bit ones by uint8). Rebuilt when a projection or its packed
        weight is replaced; the check reads the module dicts directly, as it runs every
        decode step."""
        if not self.plain_layers:
            return None
        cached = self._native_weights
        if cached is not None:
            slots, weights = cached
            if all(owner[name] is module and module.packed_weight is packed for owner, name, module, packed in slots):
                return weights
        slots = []
        for layer in self.layers:
            for parent, name in (
                (layer.self_attn, "qkv_proj"),
                (layer.self_attn, "o_proj"),
                (layer.mlp, "gate_up_proj"),
                (layer.mlp, "down_proj"),
            ):
                module = parent._modules[name]
                if type(module) is not FusedLinear or not isinstance(module.packed_weight, PanelWeight):
                    self._native_weights = None
                    return None
                slots.append((parent._modules, name, module, module.packed_weight))
        empty = torch.empty(0)
        flat: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            flat += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
            for _, _, module, packed in slots[4 * i : 4 * i + 4]:
                flat += [packed.panels, packed.scale, empty if module.bias is None else module.bias]
            flat += [
                empty if attn.q_norm is None else attn.q_norm.weight,
                empty if attn.k_norm is None else attn.k_norm.weight,
            ]
        weights = [t.detach() for t in flat]
        self._native_weights = (slots, weights)
        return weights

    def _decode_natively(
        self,
        hidden: torch.Tensor,  # [T, hidden_size]: one new token per sequence
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        attn_metadata: AttentionMetadata,
        weights: list[torch.Tensor],
    ) -> torch.Tensor:
        cfg = self.config
        index = torch.arange(hidden.shape[0])
        return torch.ops.tandem_cpu.decode_layers(
            hidden,
            positions,
            attn_metadata.slot_mapping,
            attn_metadata.block_tables,
            attn_metadata.seq_lens,
            index,
            index,
            self.cos_sin_cache,
            [k for k, _ in kv_caches],
            [v for _, v in kv_caches],
            weights,
            self.norm.weight.detach(),
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.intermediate_size,
            cfg.rms_norm_eps,
            cfg.head_dim**-0.5,
        )

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[num_tokens]`` ids -> ``[num_tokens, hidden_size]`` embeddings."""
        return self.scale_embeddings(F.embedding(input_ids, self.embed_tokens))

    def scale_embeddings(self, hidden: torch.Tensor) -> torch.Tensor:
        """Gemma multiplies embeddings by sqrt(hidden_size), in the model's dtype."""
        scale = self.config.features.embed_scale
        if scale is None:
            return hidden
        return hidden * torch.tensor(scale, dtype=hidden.dtype)

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """``compute_logits(hidden).argmax(-1)`` without reading the logits back (panel-packed
        LM head: each tile scanned while the kernel has it in cache; with the int8 screen,
        up to ``SCREEN_MAX_ROWS`` rows read a quarter of the head and recompute only the
        tiles that can hold the maximum, same tokens); None for other layouts, whose
        caller computes the logits."""
        if self.config.features.final_softcap is not None:
            return None  # argmax of capped logits: computed from the logits themselves
        if isinstance(self.lm_head_packed, PanelWeight):
            # (a screen of another weight, after lm_head_packed was swapped, does not apply)
            if self.lm_head_screen is not None and self.lm_head_screen.exact is self.lm_head_packed:
                return panel_linear_argmax_screened(hidden.float(), self.lm_head_screen)
            return panel_linear_argmax(hidden.float(), self.lm_head_packed, None)
        return None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[n, hidden_size]`` -> ``[n, vocab_size]`` float32 logits."""
        if self.lm_head_packed is not None:
            logits = packed_matmul(hidden, self.lm_head_packed, None).float()
        else:
            logits = F.linear(hidden, self.lm_head_weight).float()
        cap = self.config.features.final_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits


def _plain_layers(config: ModelConfig) -> bool:
    """Whether every layer is what ``tandem_cpu::decode_layers`` computes: Llama/Qwen
    attention (full, per-head QK-norm at most) and a dense SwiGLU MLP."""
    f = config.features
    return (
        not config.layer_types
        and config.moe is None
        and config.rotary_dim is None
        and f.activation == "silu"
        and not (f.sandwich_norms or f.qk_norm_whole or f.norm_offset)
        and f.embed_scale is None
        and f.attn_softcap is None
        and f.final_softcap is None
        and f.query_scale is None
        and f.clip_qkv is None
    )
