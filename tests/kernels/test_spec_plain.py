"""fqkernels.spec_plain: a plain step's bookkeeping between verifies against its torch reference
(on a GPU for the bits, under Triton's CPU interpreter with Triton >= 3.4 for the logic), and the
reference against SpecState's own operations (last, positions, append), which it replaces in
SpecRunner's plain step; the argument checks everywhere."""
from __future__ import annotations

import sys

import pytest
import torch

from engine_modules import ENGINE_DIR, KERNEL_DEVICE, KERNELS_RUN, KERNELS_SKIP_REASON

if str(ENGINE_DIR) not in sys.path:
    sys.path.insert(0, str(ENGINE_DIR))

from fq_spec import SpecState  # noqa: E402
from fqkernels.spec_plain import (plain_advance, plain_advance_reference, plain_inputs,  # noqa: E402
                                  plain_inputs_reference)

DEV = KERNEL_DEVICE
runs_kernel = pytest.mark.skipif(not KERNELS_RUN, reason=KERNELS_SKIP_REASON)


def _state(batch: int, device, seed: int) -> SpecState:
    """A state mid-generation: random tokens, each sequence at its own length, every third one at
    its limit (finished: a plain step emits nothing there)."""
    g = torch.Generator().manual_seed(seed)
    state = SpecState(batch, 96, 4, device)
    state.seq.copy_(torch.randint(0, 150_000, tuple(state.seq.shape), generator=g))
    length = torch.randint(1, 90, (batch,), generator=g)
    state.length.copy_(length)
    state.limit.copy_(torch.where(torch.arange(batch) % 3 == 2, length, length + 5))
    return state


def _buffers(batch: int, device) -> tuple:
    return (torch.full((batch,), -1, dtype=torch.int64, device=device),
            torch.full((2, batch), -1, dtype=torch.int32, device=device),
            torch.full((batch, 2), -1, dtype=torch.int64, device=device))


@pytest.mark.parametrize("batch", [1, 5, 16])
def test_the_reference_is_the_states_own_step(batch):
    """What SpecRunner's plain step computed with SpecState's methods, the reference computes."""
    want, got = _state(batch, "cpu", batch), _state(batch, "cpu", batch)
    tok, pos_len, packed = _buffers(batch, "cpu")
    plain_inputs_reference(got.seq, got.length, tok, pos_len)
    assert torch.equal(tok, want.last())
    assert torch.equal(pos_len[0], want.positions()) and torch.equal(pos_len[1], want.positions() + 1)
    pick = torch.arange(batch, dtype=torch.int64) + 7
    emit = (want.length < want.limit).to(torch.int64)
    want.append(pick.view(-1, 1), emit)
    plain_advance_reference(pick, got.seq, got.length, got.limit, packed)
    assert torch.equal(got.seq, want.seq) and torch.equal(got.length, want.length)
    assert packed[:, 0].tolist() == pick.tolist() and packed[:, 1].tolist() == emit.tolist()
    assert 0 in emit.tolist() or batch < 3          # a finished sequence is among them


@pytest.mark.gpu
@runs_kernel
@pytest.mark.parametrize("batch", [1, 3, 16, 64])
def test_the_kernels_are_the_reference(batch):
    ref, dev = _state(batch, DEV, 100 + batch), _state(batch, DEV, 100 + batch)
    ref_bufs, dev_bufs = _buffers(batch, DEV), _buffers(batch, DEV)
    plain_inputs_reference(ref.seq, ref.length, ref_bufs[0], ref_bufs[1])
    plain_inputs(dev.seq, dev.length, dev_bufs[0], dev_bufs[1])
    assert torch.equal(ref_bufs[0], dev_bufs[0]) and torch.equal(ref_bufs[1], dev_bufs[1])
    pick = torch.randint(0, 150_000, (batch,), generator=torch.Generator().manual_seed(batch)).to(DEV)
    for _ in range(7):              # past every limit: the finished sequences stop changing
        plain_advance_reference(pick, ref.seq, ref.length, ref.limit, ref_bufs[2])
        plain_advance(pick, dev.seq, dev.length, dev.limit, dev_bufs[2])
        assert torch.equal(ref.seq, dev.seq) and torch.equal(ref.length, dev.length)
        assert torch.equal(ref_bufs[2], dev_bufs[2])
        pick = pick + 1
    assert torch.equal(dev.length, dev.limit)


def test_bad_arguments_are_named():
    state = SpecState(2, 16, 4, "cpu")
    tok, pos_len, packed = _buffers(2, "cpu")
    with pytest.raises(ValueError, match="pos_len must be contiguous torch.int32 \\[2, 2\\]"):
        plain_inputs(state.seq, state.length, tok, pos_len.to(torch.int64))
    with pytest.raises(ValueError, match="length must be contiguous torch.int64"):
        plain_inputs(state.seq, state.length.to(torch.int32), tok, pos_len)
    with pytest.raises(ValueError, match="packed must be contiguous torch.int64 \\[2, 2\\]"):
        plain_advance(tok, state.seq, state.length, state.limit, packed.t())
    with pytest.raises(ValueError, match="seq must be int64"):
        plain_advance(tok, state.seq.t(), state.length, state.limit, packed)
