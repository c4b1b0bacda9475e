"""A short process that describes the device and measures its ceilings, once per run.

Run as `python -m fastqwen.judge.probe --device auto|cpu|cuda`; prints one JSON object. It runs
apart from the trusted parent so that the parent never holds a CUDA context (or its memory)
while the engines are measured.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys


def _version(module_name: str) -> str | None:
    try:
        module = __import__(module_name)
    except ImportError:
        return None
    return getattr(module, "__version__", None)


def describe(device: str, measure: bool) -> dict:
    import torch

    from fastqwen.judge.roofline import measure_ceilings

    cuda_available = torch.cuda.is_available()
    if device == "auto":
        device = "cuda" if cuda_available else "cpu"
    info: dict = {
        "device": device,
        "cuda_available": cuda_available,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "triton": _version("triton"),
            "transformers": _version("transformers"),
            "tokenizers": _version("tokenizers"),
            "cuda": torch.version.cuda,
        },
        "cpu": platform.processor() or platform.machine(),
    }
    if device == "cuda":
        if not cuda_available:
            info["error"] = "--device cuda but torch sees no CUDA device"
            return info
        props = torch.cuda.get_device_properties(0)
        info["gpu_name"] = props.name
        info["device_memory_bytes"] = int(props.total_memory)
        info["sm_count"] = int(props.multi_processor_count)
    else:
        info["gpu_name"] = None
        info["device_memory_bytes"] = None
    if measure:
        info["ceilings"] = measure_ceilings(device).to_json()
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--no-measure", action="store_true")
    args = parser.parse_args(argv)
    json.dump(describe(args.device, not args.no_measure), sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
