"""TRL's ``AsyncGRPOTrainer`` on a machine without CUDA (see :mod:`.trl_async`).

TRL scores a batch as a prefix tree with a FlashAttention-3 kernel fetched from the Hugging
Face Hub (CUDA only) and asks CUDA for the device's name to report MFU.
:func:`run_on_cpu` puts :func:`cpu_tree_attention`, an exact PyTorch version of that
attention, in its place and skips the FLOPs lookup. Needs ``trl`` (extra ``trl``).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["cpu_tree_attention", "run_on_cpu", "use_cpu_tree_attention"]


def cpu_tree_attention(module: Any, query: torch.Tensor, key: torch.Tensor,
                       value: torch.Tensor, attention_mask: Any, *,
                       tree_kv_index: torch.Tensor, tree_cu_seqlens_q: torch.Tensor,
                       tree_cu_seqlens_k: torch.Tensor, tree_max_seqlen_q: int = 0,
                       tree_max_seqlen_k: int = 0, scaling: float | None = None,
                       sliding_window: int | None = None, softcap: float | None = None,
                       **kwargs: Any) -> tuple[torch.Tensor, None]:
    """TRL's tree attention in PyTorch: segment ``i``'s queries attend to the keys
    ``tree_kv_index`` lists for it (its path from the root), causally, with the last
    query aligned to the last key, as FlashAttention's variable-length kernel does.
    ``query``/``key``/``value`` come as ``(1, heads, tokens, dim)``; the output is
    ``(1, tokens, heads, dim)``."""
    if softcap:
        raise NotImplementedError("softcapped attention is not supported on CPU")
    q = query.transpose(1, 2)[0]  # (N, H, D)
    k = key.transpose(1, 2)[0].index_select(0, tree_kv_index)
    v = value.transpose(1, 2)[0].index_select(0, tree_kv_index)
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads != kv_heads:
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    out = torch.empty_like(q)
    cq, ck = tree_cu_seqlens_q.tolist(), tree_cu_seqlens_k.tolist()
    for i in range(len(cq) - 1):
        qs, ks = q[cq[i]:cq[i + 1]], k[ck[i]:ck[i + 1]]
        lq, lk = qs.shape[0], ks.shape[0]
        if lq == 0:
            continue
        rows = torch.arange(lq)[:, None] + (lk - lq)
        cols = torch.arange(lk)[None, :]
        allowed = cols <= rows
        if sliding_window:
            allowed &= cols > rows - sliding_window
        scores = torch.einsum("qhd,khd->hqk", qs.float(), ks.float()) * scale
        scores = scores.masked_fill(~allowed, float("-inf"))
        weights = torch.softmax(scores, dim=-1)
        out[cq[i]:cq[i + 1]] = torch.einsum("hqk,khd->qhd", weights,
                                            v[ck[i]:ck[i + 1]].float()).to(q.dtype)
    return out.unsqueeze(0), None


def use_cpu_tree_attention() -> None:
    """Serve TRL's tree attention with :func:`cpu_tree_attention` from now on."""
    from transformers import AttentionInterface
    from trl.experimental.async_grpo.packing import TREE_ATTENTION

    AttentionInterface.register(TREE_ATTENTION, cpu_tree_attention)


def run_on_cpu() -> None:
    """Let TRL's ``AsyncGRPOTrainer`` train without CUDA: its tree attention in PyTorch
    (:func:`cpu_tree_attention`, also when its constructor registers the attention) and
    no peak-FLOPs lookup on a CPU (TRL asks CUDA for the device's name; with no known peak
    it logs no MFU, as it does for an unknown GPU). Call it before building the trainer."""
    from trl.experimental.async_grpo import async_grpo_trainer as trainer_module

    for name in ("register_tree_attention", "get_peak_flops_per_device"):
        if not hasattr(trainer_module, name):
            raise RuntimeError(f"this TRL has no async_grpo_trainer.{name}: run_on_cpu "
                               "knows TRL 1.16's AsyncGRPOTrainer only")
    cuda_peak = getattr(trainer_module, "get_peak_flops_per_device")  # noqa: B009

    def peak_flops(accelerator: Any, dtype: str) -> float | None:
        if accelerator.device.type != "cuda":
            return None
        result: float | None = cuda_peak(accelerator, dtype)
        return result

    setattr(trainer_module, "register_tree_attention", use_cpu_tree_attention)  # noqa: B010
    setattr(trainer_module, "get_peak_flops_per_device", peak_flops)  # noqa: B010
    use_cpu_tree_attention()
