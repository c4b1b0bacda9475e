"""Import an engine folder's `engine.py` under a unique module name, as the
platform would import it (folder first on sys.path, absolute sibling imports)."""
import importlib.util
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
ENGINE_DIR = REPO / "engine"


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
