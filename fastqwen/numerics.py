"""The platform reference's numerics, pinned the same way on every torch version.

The platform runs native Transformers on torch 2.5.1, where SDPA never picks
cuDNN attention (pytorch/pytorch#138522 made it opt-in for 2.5.1): attention
runs flash attention's kernels. Newer torch (2.9+, with cuDNN above 9.15 on
sm90) picks cuDNN attention first, whose tiles and rounding differ. Every local
run of the reference (the judge's native engine and replay, the logit
statistics, the GPU checks) calls `pin_reference_numerics()` first so it
computes what the platform's reference computes: no TF32, no cuDNN attention.
"""


def pin_reference_numerics() -> None:
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if hasattr(torch.backends.cuda, "enable_cudnn_sdp"):
        torch.backends.cuda.enable_cudnn_sdp(False)
