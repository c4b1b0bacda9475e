"""The reference's numerics are pinned to the platform's (torch 2.5.1) on any torch."""
import torch

from fastqwen.numerics import pin_reference_numerics


def test_pin_turns_off_cudnn_attention_and_tf32():
    saved = (torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.matmul.allow_tf32,
             torch.backends.cudnn.allow_tf32)
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        pin_reference_numerics()
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert not torch.backends.cuda.matmul.allow_tf32
        assert not torch.backends.cudnn.allow_tf32
        # flash, memory-efficient and math stay available, as on the platform
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(saved[0])
        torch.backends.cuda.matmul.allow_tf32 = saved[1]
        torch.backends.cudnn.allow_tf32 = saved[2]


def test_native_engine_folder_pins_the_same_backends():
    # The native engine folder is submitted standalone (no fastqwen import): it
    # repeats the pin, and must keep doing so.
    import pathlib

    text = (pathlib.Path(__file__).resolve().parents[1] / "fastqwen" / "native_engine" / "engine.py").read_text()
    assert "enable_cudnn_sdp(False)" in text
