"""Comparisons of BF16 kernel outputs with their references, shared by the kernel tests."""
from __future__ import annotations

import torch


def close_to_ulp(out: torch.Tensor, ref: torch.Tensor, max_mismatch: float = 2e-3, scale=None, ulps: int = 1) -> None:
    """Bit-identical, or differing by at most `ulps` BF16 ulps (of `scale`, default
    the element itself) on a tiny fraction of elements."""
    assert not torch.isnan(out).any(), "unwritten (NaN-poisoned) outputs remain"
    diff = out.float() != ref.float()
    if diff.any():
        a, b = out[diff].float(), ref[diff].float()
        ulp = (torch.maximum(a.abs(), b.abs()) if scale is None else scale.expand_as(out)[diff]) * 2.0 ** -7
        assert ((a - b).abs() <= ulps * ulp).all(), f"max diff {(a - b).abs().max()} exceeds {ulps} bf16 ulp(s)"
    assert diff.float().mean() <= max_mismatch, f"{diff.float().mean():.2e} of elements differ"
