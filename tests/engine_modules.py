"""Import an engine folder's `engine.py` under a unique module name, as the
platform would import it (folder first on sys.path, absolute sibling imports)."""
import importlib.util
import os
import pathlib
import sys

import torch
import triton

REPO = pathlib.Path(__file__).resolve().parents[1]
ENGINE_DIR = REPO / "engine"

# Where the kernel tests run the engine's Triton kernels: on a GPU, or on the CPU under
# TRITON_INTERPRET=1 with Triton >= 3.4 (3.1's interpreter computes wrongly). Kernels that loop to a
# loaded bound (the exact GDN step's) need numpy < 2.4 there: the interpreter's scalars are
# one-element arrays, which numpy 2.4 no longer converts to an int.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
KERNELS_RUN = KERNEL_DEVICE == "cuda" or (INTERPRET and tuple(map(int, triton.__version__.split(".")[:2])) >= (3, 4))
KERNELS_SKIP_REASON = "needs a GPU, or TRITON_INTERPRET=1 with Triton >= 3.4"


def load_engine_module(folder: pathlib.Path, name: str):
    folder = str(folder)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, pathlib.Path(folder) / "engine.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    return module
