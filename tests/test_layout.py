"""The repository's shape, checked from its files:
- the engine reads no environment variable but the four the README's options table documents
  (and Triton's own TRITON_INTERPRET), and each documented one is read;
- no tracked file speaks of how the work was done (numbered sessions, runs or issues, dated run
  folders, the retired measurement log);
- the server reaches the engine through its public API only (Engine's and Slots' public names,
  no engine module imported by name, no underscore attribute of the engine's objects)."""
from __future__ import annotations

import ast
import pathlib
import re
import subprocess

REPO = pathlib.Path(__file__).resolve().parents[1]
ENGINE = REPO / "engine"
DOCUMENTED = {"FASTQWEN_BACKEND", "FASTQWEN_NO_GRAPHS", "FASTQWEN_NO_PDL", "FASTQWEN_EXACT_DECODE",
              "FASTQWEN_SPECULATION", "FASTQWEN_SPECULATIVE_TOKEN_MAP"}


def _env_reads(source: str) -> set:
    """The environment variables a module reads: string constants next to os.environ / os.getenv,
    and engine.py's _option(value, "NAME", ...) calls."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            func = ast.unparse(node.func)
            if func in ("os.environ.get", "os.getenv", "_option") or func.endswith("environ.get"):
                for arg in node.args:
                    if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.isupper():
                        names.add(arg.value)
        elif isinstance(node, ast.Subscript) and ast.unparse(node.value) == "os.environ":
            if isinstance(node.slice, ast.Constant):
                names.add(node.slice.value)
    return names


def test_the_engine_reads_only_the_documented_environment():
    read = set()
    for path in ENGINE.rglob("*.py"):
        read |= _env_reads(path.read_text())
    assert read - {"TRITON_INTERPRET"} == DOCUMENTED, sorted(read)
    readme = (REPO / "README.md").read_text()
    table = [line for line in readme.splitlines() if line.startswith("| `") and "FASTQWEN_" in line]
    assert {m for line in table for m in re.findall(r"FASTQWEN_[A-Z_]+", line)} == DOCUMENTED
    # no FASTQWEN_ name anywhere in the engine's source that it does not read (a stale switch in a comment)
    text = "".join(p.read_text() for p in ENGINE.rglob("*.py"))
    assert set(re.findall(r"FASTQWEN_[A-Z0-9_]+", text)) <= DOCUMENTED


def test_the_env_finder_finds_what_it_names():
    """_env_reads can fail: it finds a read of each form."""
    src = 'import os\nos.environ.get("FASTQWEN_X")\nos.environ["FASTQWEN_Y"]\n_option(None, "FASTQWEN_Z", int, 0)\n'
    assert _env_reads(src) == {"FASTQWEN_X", "FASTQWEN_Y", "FASTQWEN_Z"}


# How the work was done, never what the code is: a numbered session, run (of a measurement) or
# issue, a dated run folder, the retired measurement log.
HISTORY = re.compile(r"\b[Ss]essions? \d|\bsession\d|\b[Ii]ssues? \d+|\bh200-20\d\d-\d\d|(?<!:results/)PERF[_]LOG|"
                     r"\b[Rr]un \d+(?![\d.])(?! (?:samples?|steps?|times|tokens|layers|rows|positions|splits))")


def _tracked() -> list[pathlib.Path]:
    out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True)
    if out.returncode != 0:       # a copy of the tree without git: every file under the root
        return [p for p in REPO.rglob("*") if p.is_file() and ".git" not in p.parts and ".venv" not in str(p)]
    return [REPO / line for line in out.stdout.splitlines() if (REPO / line).is_file()]


def test_no_tracked_file_speaks_of_the_development_history():
    found = []
    for path in _tracked():
        if path.suffix not in (".py", ".md", ".sh", ".toml", ".txt", ".cfg", ".yml", ".yaml"):
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if HISTORY.search(line):
                found.append(f"{path.relative_to(REPO)}:{number}: {line.strip()[:120]}")
    assert not found, "\n".join(found[:40])


def test_the_history_pattern_matches_what_it_names():
    # joined here, so that this file holds none of what it forbids and is checked like every other
    for text in ("the default since " + "session" + " 31", "sessions" + " 5-6", "(issue" + " 12)",
                 "results/h200-" + "2026-12-01/x", "see PERF" + "_LOG", "run" + " 3 of the judge"):
        assert HISTORY.search(text), text
    for text in ("runs 5 samples", "an HTTP session", "the session fixture", "run 5 steps", "runs 4 splits",
                 "the platform runs Triton 3.1", "run 3.1's kernels"):
        assert not HISTORY.search(text), text


def test_the_server_uses_only_the_engines_public_api():
    """fastqwen/serve imports no engine module but `engine` (loaded by the app) and touches no
    underscore attribute of the engine, its model or its slots, nor their internals (model.*, pool)."""
    problems = []
    for path in (REPO / "fastqwen" / "serve").glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                problems += [f"{path.name}: imports {n}" for n in names if n.startswith(("fq_", "fqkernels"))]
            if isinstance(node, ast.Attribute):
                owner = ast.unparse(node.value)
                if re.search(r"(^|\.)(engine|slots)$", owner) and (node.attr.startswith("_")
                                                                   or node.attr in ("model", "pool", "keys")):
                    problems.append(f"{path.name}:{node.lineno}: {owner}.{node.attr}")
    assert not problems, problems
