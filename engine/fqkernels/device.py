"""What launch plans read of the device they run on."""
import torch


def sm_count(device: torch.device) -> int:
    """The device's multiprocessors (132 on an H100 or H200; that figure where there is no GPU:
    Triton's interpreter, or scripts/compile_kernels.py's tensors that only say they are on one)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count
