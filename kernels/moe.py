"""Mixture-of-experts MLP: routing, a PyTorch reference, and the fused kernels' dispatch.

A sparse MoE block replaces the dense SwiGLU MLP by E experts of the same form, of which
each token runs ``top_k``:

- ``route(router_logits, top_k, renormalize)``: softmax over the experts in float32, the
  ``top_k`` largest (ties broken as ``torch.topk`` breaks them), renormalized to sum 1
  where the model asks (Mixtral always; Qwen3-MoE / OLMoE / Qwen2-MoE by ``norm_topk_prob``,
  which OLMoE and Qwen2-MoE leave off). The order of operations is Hugging Face
  transformers' (``modeling_mixtral.py``, ``modeling_qwen3_moe.py``, ``modeling_olmoe.py``:
  float32 softmax, ``torch.topk``, an in-place division by the sum), so the weights and
  ids are theirs bit for bit on the same device. Qwen3-MoE, OLMoE and Qwen2-MoE then round
  the weights to the logits' dtype (Mixtral does not): ``weights_dtype`` does that.
- ``fused_moe(x, experts, topk_weights, topk_ids)``: ``sum_j w[t, j] * down_e(silu(gate_e(x))
  * up_e(x))`` with ``e = topk_ids[t, j]``. CUDA tensors run the Triton kernel
  (``kernels.triton_moe``: tokens sorted into per-expert blocks, one grouped GEMM for
  gate/up with SiLU-and-mul fused, one for down with the routing weight in its epilogue,
  then a reduction over the k choices); CPU float32 ``x`` with packed experts
  (``ExpertWeights.pack``) runs the native grouped op (``kernels/csrc/moe_cpu.cpp``, on
  the dense path's float32 or int8 panels); anything else the reference.
- ``fused_moe_reference``: a loop over experts in plain PyTorch, float32 accumulation.

Weights: ``w13`` is ``[E, 2I, H]``, each expert's rows ``[gate (I) | up (I)]`` (the
``gate_up_proj`` of transformers' fused expert tensors, or the checkpoint's ``w1`` / ``w3``,
``gate_proj`` / ``up_proj`` stacked); ``w2`` is ``[E, H, I]`` (``down_proj`` / ``w2``). Any I
works (a tensor-parallel shard of the intermediate dim is just a smaller I; the caller
all-reduces the partial outputs as for the dense MLP).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.panel_linear import LANES, PanelWeight, pack_panels, unpack_panels

__all__ = [
    "ExpertWeights",
    "PackedExperts",
    "fused_moe",
    "fused_moe_reference",
    "route",
]

# ExpertWeights.pack layouts (the dense path's names, see engine_service.models.decoder):
# "panel" float32 panels, "panel_int8" int8 panels with per-channel scales; "onednn" has
# no grouped kernel and takes float32 panels; "torch" keeps the dense weights.
PACK_LAYOUTS = ("torch", "onednn", "panel", "panel_int8")


def route(
    router_logits: torch.Tensor,  # [T, E]
    top_k: int,
    renormalize: bool,
    weights_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([T, k] float32, [T, k] int32)
    """``(topk_weights, topk_ids)`` of a float32 softmax over the experts, as transformers
    computes them (``softmax(logits, dtype=float32)``, ``torch.topk``, ``/= sum``).
    ``weights_dtype``: round the weights to it (transformers' ``.to(router_logits.dtype)``
    in Qwen3-MoE, OLMoE and Qwen2-MoE); they are returned as float32 either way."""
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be [T, E], got shape {tuple(router_logits.shape)}")
    num_experts = router_logits.shape[1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must lie in [1, {num_experts}], got {top_k}")
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    if weights_dtype is not None:
        weights = weights.to(weights_dtype).float()
    return weights, ids.to(torch.int32)


def fused_moe_reference(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]: rows [gate | up]
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, k]
    topk_ids: torch.Tensor,  # [T, k] integer
) -> torch.Tensor:  # [T, H] in x's dtype
    """The MoE MLP one expert at a time in float32 (a host sync per expert: tests and the
    fallback only)."""
    _check_shapes(x, w13, w2, topk_weights, topk_ids)
    inter = w13.shape[1] // 2
    xf = x.float()
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    ids = topk_ids.long()
    for e in range(w13.shape[0]):
        tokens, choice = torch.where(ids == e)
        if tokens.numel() == 0:
            continue
        gate_up = xf[tokens] @ w13[e].float().T
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = act @ w2[e].float().T
        out.index_add_(0, tokens, y * topk_weights[tokens, choice, None].float())
    return out.to(x.dtype)


def _check_shapes(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> None:
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"x must be [T, H], w13 [E, 2I, H], w2 [E, H, I]; got {tuple(x.shape)}, "
                         f"{tuple(w13.shape)}, {tuple(w2.shape)}")
    num_experts, two_i, hidden = w13.shape
    if two_i % 2 or hidden != x.shape[1] or tuple(w2.shape) != (num_experts, hidden, two_i // 2):
        raise ValueError(f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not make an MoE of "
                         f"hidden size {x.shape[1]}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0] or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_weights {tuple(topk_weights.shape)} and topk_ids {tuple(topk_ids.shape)} "
                         f"must both be [T = {x.shape[0]}, k]")


class PackedExperts:
    """The experts' panels for the native CPU op (``kernels/csrc/moe_cpu.cpp`` has the
    layouts): gate and up interleaved panel by panel (``[E, 2 ceil(I / 16), ...]``: a tile
    of two panels is 16 gate and the same 16 up columns), down as ``[E, ceil(H / 16), ...]``;
    float32 ``[.., K, 16]`` or int8 ``[.., ceil(K / 2), 32]`` with ``[E, 16 P]`` per-channel
    scales (empty for float32). On transparent huge pages where the kernel offers them."""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, quantize: bool) -> None:
        from kernels.cpu_ops import empty_on_huge_pages

        num_experts, two_i, hidden = w13.shape
        self.inter, self.hidden, self.num_experts = two_i // 2, hidden, num_experts
        self.quantize = quantize
        half_panels = -(-self.inter // LANES)
        p13, p2 = 2 * half_panels, -(-hidden // LANES)
        self.w13 = empty_on_huge_pages(_panels_shape(num_experts, p13, hidden, quantize), _dtype(quantize))
        self.w2 = empty_on_huge_pages(_panels_shape(num_experts, p2, self.inter, quantize), _dtype(quantize))
        self.w13_scale = torch.empty(num_experts, p13 * LANES) if quantize else torch.empty(0)
        self.w2_scale = torch.empty(num_experts, p2 * LANES) if quantize else torch.empty(0)
        pad = half_panels * LANES - self.inter
        for e in range(num_experts):  # one expert at a time: one expert's float32 copy at most
            gate, up = w13[e].detach().float().chunk(2, dim=0)
            # [Ip, H] each -> [Ip / 16, 2, 16, H] -> rows: gate 16 | up 16 | gate 16 | ...
            both = torch.stack([F.pad(gate, (0, 0, 0, pad)), F.pad(up, (0, 0, 0, pad))]).view(2, half_panels, LANES, hidden)
            packed = pack_panels(both.transpose(0, 1).reshape(p13 * LANES, hidden), quantize)
            self.w13[e].copy_(packed.panels)
            down = pack_panels(w2[e].detach(), quantize)
            self.w2[e].copy_(down.panels)
            if quantize:
                self.w13_scale[e].copy_(packed.scale)
                self.w2_scale[e].copy_(down.scale)

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(w13 [E, 2I, H], w2 [E, H, I])`` float32 as the panels hold them (for int8:
        dequantized)."""
        inter, hidden = self.inter, self.hidden
        w13, w2 = [], []
        for e in range(self.num_experts):
            rows = unpack_panels(self._weight(self.w13[e], self.w13_scale, e, 2 * -(-inter // LANES) * LANES, hidden))
            pairs = rows.view(-1, 2, LANES, hidden)  # [Ip / 16, gate | up, 16, H]
            gate = pairs[:, 0].reshape(-1, hidden)[:inter]
            up = pairs[:, 1].reshape(-1, hidden)[:inter]
            w13.append(torch.cat([gate, up]))
            w2.append(unpack_panels(self._weight(self.w2[e], self.w2_scale, e, hidden, inter)))
        return torch.stack(w13), torch.stack(w2)

    def _weight(self, panels: torch.Tensor, scale: torch.Tensor, e: int, n: int, k: int) -> PanelWeight:
        return PanelWeight(panels=panels, scale=scale[e] if self.quantize else scale, out_features=n, in_k=k)


def _panels_shape(num_experts: int, num_panels: int, k: int, quantize: bool) -> tuple[int, ...]:
    return (num_experts, num_panels, -(-k // 2), 2 * LANES) if quantize else (num_experts, num_panels, k, LANES)


def _dtype(quantize: bool) -> torch.dtype:
    return torch.int8 if quantize else torch.float32


class ExpertWeights:
    """The E experts' weights of one MoE layer: dense ``w13`` ``[E, 2I, H]`` (rows
    ``[gate | up]``) and ``w2`` ``[E, H, I]``, and on CPU, after ``pack``, their panels."""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        if w13.dim() != 3 or w2.dim() != 3 or w13.shape[1] % 2:
            raise ValueError(f"w13 must be [E, 2I, H] and w2 [E, H, I], got {tuple(w13.shape)}, {tuple(w2.shape)}")
        num_experts, two_i, hidden = w13.shape
        if tuple(w2.shape) != (num_experts, hidden, two_i // 2):
            raise ValueError(f"w2 must be [{num_experts}, {hidden}, {two_i // 2}] for w13 {tuple(w13.shape)}, "
                             f"got {tuple(w2.shape)}")
        self.num_experts, self.hidden, self.inter = num_experts, hidden, two_i // 2
        self.w13: torch.Tensor | None = w13
        self.w2: torch.Tensor | None = w2
        self.packed: PackedExperts | None = None

    def pack(self, layout: str, keep_dense: bool = False) -> ExpertWeights:
        """Pack for the native CPU op, once at load: "panel" (and "onednn", which has no
        grouped kernel) float32 panels, "panel_int8" int8 panels with per-channel scales
        (quantized as ``kernels.panel_linear.quantize_int8`` does the dense weights);
        "torch" leaves the dense weights. The dense weights are dropped unless
        ``keep_dense`` (``dense()`` unpacks the panels where they are needed). Returns self."""
        if layout not in PACK_LAYOUTS:
            raise ValueError(f"unknown expert layout {layout!r}; expected one of {PACK_LAYOUTS}")
        if layout == "torch":
            return self
        if self.w13 is None or self.w2 is None:
            raise ValueError("these experts are packed already")
        if self.w13.device.type != "cpu":
            raise ValueError(f"panels are a CPU layout; the experts are on {self.w13.device}")
        self.packed = PackedExperts(self.w13, self.w2, quantize=layout == "panel_int8")
        if not keep_dense:
            self.w13 = self.w2 = None
        return self

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(w13, w2)``: the dense weights, or those the panels stand for."""
        if self.w13 is not None and self.w2 is not None:
            return self.w13, self.w2
        assert self.packed is not None
        return self.packed.dense()


def fused_moe(
    x: torch.Tensor,  # [T, H]
    experts: ExpertWeights,
    topk_weights: torch.Tensor,  # [T, k] float32
    topk_ids: torch.Tensor,  # [T, k] int32 (or int64)
) -> torch.Tensor:  # [T, H] in x's dtype
    """The MoE MLP: Triton on CUDA, the native grouped op on CPU (float32 x, packed
    experts), else ``fused_moe_reference``."""
    if x.device.type == "cuda" and experts.w13 is not None and experts.w2 is not None:
        from kernels import triton_moe  # imports triton

        return triton_moe.fused_moe(x, experts.w13, experts.w2, topk_weights, topk_ids)
    packed = experts.packed
    if x.device.type == "cpu" and packed is not None and x.dtype == torch.float32 and _native():
        if x.dim() != 2 or x.shape[1] != packed.hidden or topk_ids.shape != topk_weights.shape \
                or topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
            raise ValueError(f"x {tuple(x.shape)}, topk_weights {tuple(topk_weights.shape)} and topk_ids "
                             f"{tuple(topk_ids.shape)} do not fit experts of hidden size {packed.hidden}")
        if x.stride(-1) != 1:
            x = x.contiguous()
        out = torch.empty(x.shape[0], packed.hidden, dtype=torch.float32)
        torch.ops.tandem_cpu.moe_panels(
            out, x, packed.w13, packed.w13_scale, packed.w2, packed.w2_scale,
            topk_weights.float().contiguous(), topk_ids.contiguous(), packed.inter,
        )
        return out
    w13, w2 = experts.dense()
    return fused_moe_reference(x, w13, w2, topk_weights, topk_ids)


def _native() -> bool:
    from kernels.cpu_ops import native_available

    return native_available()

