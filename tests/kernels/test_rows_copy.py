"""fqkernels.rows_copy: the masked row copy of speculative decoding's rollback against its torch
reference, on views with a layer stride (the first B of more rows), under Triton's CPU interpreter
(Triton >= 3.4) for the logic and on a GPU for the bits; the argument checks everywhere."""
from __future__ import annotations

import sys

import pytest
import torch

from engine_modules import ENGINE_DIR, KERNEL_DEVICE, KERNELS_RUN, KERNELS_SKIP_REASON

if str(ENGINE_DIR) not in sys.path:
    sys.path.insert(0, str(ENGINE_DIR))

from fqkernels.rows_copy import copy_rows_where, copy_rows_where_reference  # noqa: E402

DEV = KERNEL_DEVICE
runs_kernel = pytest.mark.skipif(not KERNELS_RUN, reason=KERNELS_SKIP_REASON)


@pytest.mark.gpu
@runs_kernel
@pytest.mark.parametrize("shape,dtype", [((3, 5, 2, 8, 8), torch.float32), ((2, 3, 40, 4), torch.bfloat16),
                                         ((1, 2, 5000), torch.float32)])
def test_the_masked_copy_is_the_reference(shape, dtype):
    g = torch.Generator().manual_seed(sum(shape))
    full_dst = torch.randn((shape[0], shape[1] + 2) + shape[2:], generator=g).to(dtype).to(DEV)
    dst = full_dst[:, :shape[1]]                 # the first B rows of more, as the models' states
    src = torch.randn(shape, generator=g).to(dtype).to(DEV)
    mask = torch.tensor([b % 2 == 0 for b in range(shape[1])], device=DEV)
    want = full_dst.clone()
    copy_rows_where_reference(want[:, :shape[1]], src, mask)
    copy_rows_where(dst, src, mask)
    assert torch.equal(full_dst, want)
    copy_rows_where(dst, src, torch.zeros_like(mask))     # nothing taken: nothing changes
    assert torch.equal(full_dst, want)


def test_bad_arguments_are_named():
    a = torch.zeros(2, 3, 4)
    with pytest.raises(ValueError, match="one shape"):
        copy_rows_where(a, torch.zeros(2, 3, 5), torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="mask must be bool"):
        copy_rows_where(a, a.clone(), torch.ones(3))
    with pytest.raises(ValueError, match="contiguous"):
        copy_rows_where(a, torch.zeros(2, 3, 8)[..., ::2], torch.ones(3, dtype=torch.bool))


def test_the_reference_copies_the_masked_rows_only():
    dst, src = torch.zeros(2, 3, 4), torch.ones(2, 3, 4)
    copy_rows_where_reference(dst, src, torch.tensor([True, False, True]))
    assert dst[:, 0].eq(1).all() and dst[:, 1].eq(0).all() and dst[:, 2].eq(1).all()
