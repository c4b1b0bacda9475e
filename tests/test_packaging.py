"""`fastqwen package`: reproducible bytes, what goes in, and refusing what must not be written."""
from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import os
import pathlib
import shutil
import tarfile

import pytest

from fastqwen import packaging
from fastqwen.errors import UserError
from fastqwen.packaging import package_folder
from fastqwen.submission import validate_path

REPO = pathlib.Path(__file__).resolve().parents[1]

ENGINE_SOURCE = b'''from fqkernels.ops import add


class Engine:
    def __init__(self, model_path):
        self.model_path = model_path

    def generate(self, input_ids, max_new_tokens):
        for _ in range(max_new_tokens):
            yield [add(0, 0) for _ in input_ids]
'''


def make_engine(root: pathlib.Path, extra: dict[str, bytes] | None = None) -> pathlib.Path:
    files = {
        "engine.py": ENGINE_SOURCE,
        "fqkernels/__init__.py": b"",
        "fqkernels/ops.py": b"def add(a, b):\n    return a + b\n",
        "README.md": b"# engine\n",
        **(extra or {}),
    }
    for name, data in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return root


def members(archive: pathlib.Path) -> list[tarfile.TarInfo]:
    with tarfile.open(archive, "r:gz") as tar:
        return tar.getmembers()


def test_same_folder_gives_same_bytes(tmp_path: pathlib.Path) -> None:
    root = make_engine(tmp_path / "engine")
    first = package_folder(root, tmp_path / "a.tar.gz")
    second = package_folder(root, tmp_path / "b.tar.gz")
    assert first.written and second.written
    assert (tmp_path / "a.tar.gz").read_bytes() == (tmp_path / "b.tar.gz").read_bytes()
    assert first.sha256 == second.sha256 == hashlib.sha256((tmp_path / "a.tar.gz").read_bytes()).hexdigest()


def test_times_modes_and_caches_do_not_change_the_bytes(tmp_path: pathlib.Path) -> None:
    one = make_engine(tmp_path / "one")
    two = tmp_path / "two"
    shutil.copytree(one, two)
    make_engine(two, {"__pycache__/engine.cpython-311.pyc": b"\0", "fqkernels/ops.pyc": b"\0", ".gitignore": b"x"})
    (two / ".hidden").mkdir()
    (two / ".hidden" / "notes.txt").write_bytes(b"secret")
    for path in two.rglob("*"):                    # last: nothing written after it resets the times
        os.utime(path, (1_700_000_000, 1_700_000_000))
    (two / "engine.py").chmod(0o755)
    assert (two / "engine.py").stat().st_mtime == 1_700_000_000 != (one / "engine.py").stat().st_mtime
    a = package_folder(one, tmp_path / "one.tar.gz")
    b = package_folder(two, tmp_path / "two.tar.gz")
    assert a.written and b.written
    assert (tmp_path / "one.tar.gz").read_bytes() == (tmp_path / "two.tar.gz").read_bytes()


def test_archive_layout(tmp_path: pathlib.Path) -> None:
    root = make_engine(tmp_path / "engine", {"__pycache__/x.pyc": b"\0", ".env": b"TOKEN=1"})
    result = package_folder(root, tmp_path / "out.tar.gz")
    infos = members(result.output)
    assert [i.name for i in infos] == ["README.md", "engine.py", "fqkernels/__init__.py", "fqkernels/ops.py"]
    for info in infos:
        assert info.isreg()
        assert (info.mtime, info.uid, info.gid, info.uname, info.gname, info.mode) == (0, 0, 0, "", "", 0o644)
    raw = result.output.read_bytes()
    # gzip header: magic, method, flags (0: no FNAME), then a zero mtime.
    assert raw[:3] == b"\x1f\x8b\x08"
    assert raw[3] == 0
    assert raw[4:8] == b"\0\0\0\0"
    with tarfile.open(fileobj=io.BytesIO(gzip.decompress(raw))) as tar:
        assert tar.extractfile("engine.py").read() == ENGINE_SOURCE
    assert result.files == 4
    assert result.size == len(raw)


def test_output_validates(tmp_path: pathlib.Path) -> None:
    result = package_folder(make_engine(tmp_path / "engine"), tmp_path / "out.tar.gz")
    report = validate_path(result.output)
    assert report.ok and report.warnings == [], report.lines()


def test_repo_engine_packages(tmp_path: pathlib.Path) -> None:
    engine_dir = REPO / "engine"
    if not (engine_dir / "engine.py").exists():
        pytest.skip("engine/engine.py does not exist yet")
    result = package_folder(engine_dir, tmp_path / "engine.tar.gz")
    assert result.written, result.report.lines()
    assert validate_path(result.output).ok


def test_invalid_folder_is_not_written(tmp_path: pathlib.Path) -> None:
    root = make_engine(tmp_path / "engine", {"fqkernels/fast.so": b"ELF"})
    result = package_folder(root, tmp_path / "out.tar.gz")
    assert not result.written
    assert result.report.rules() == {"extension"}
    assert not (tmp_path / "out.tar.gz").exists()


def test_symlink_in_folder_is_refused_not_dropped(tmp_path: pathlib.Path) -> None:
    root = make_engine(tmp_path / "engine")
    (root / "fqkernels" / "alias.py").symlink_to("ops.py")
    result = package_folder(root, tmp_path / "out.tar.gz")
    assert not result.written
    assert result.report.rules() == {"symlink"}


def test_refuses_output_inside_folder(tmp_path: pathlib.Path) -> None:
    root = make_engine(tmp_path / "engine")
    with pytest.raises(UserError, match="inside"):
        package_folder(root, root / "submission.tar.gz")
    with pytest.raises(UserError, match="inside"):
        package_folder(root, root / "fqkernels" / "submission.tar.gz")
    assert not (root / "submission.tar.gz").exists()


@pytest.mark.parametrize(
    ("folder_name", "output_name", "message"),
    [
        ("missing", "out.tar.gz", "no such folder"),
        ("engine", "out.zip", "must end with .tar.gz"),
        ("engine", "nowhere/out.tar.gz", "does not exist"),
    ],
)
def test_usage_errors(tmp_path: pathlib.Path, folder_name: str, output_name: str, message: str) -> None:
    make_engine(tmp_path / "engine")
    with pytest.raises(UserError, match=message):
        package_folder(tmp_path / folder_name, tmp_path / output_name)


def run_package(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    packaging.add_arguments(parser)
    return packaging.run(parser.parse_args(list(argv)))


def test_run_prints_size_count_and_hash(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = make_engine(tmp_path / "engine")
    out = tmp_path / "out.tar.gz"
    assert run_package(str(root), "-o", str(out)) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    digest = hashlib.sha256(out.read_bytes()).hexdigest()
    assert last == f"wrote {out}: {out.stat().st_size:,} bytes, 4 files, sha256 {digest}"


def test_run_exit_code_for_invalid_folder(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = make_engine(tmp_path / "engine", {"engine.py": b"import requests\n"})
    assert run_package(str(root), "-o", str(tmp_path / "out.tar.gz")) == 1
    out = capsys.readouterr().out
    assert "engine.py: disallowed-import: line 1: imports requests;" in out
    assert out.splitlines()[-1].endswith("out.tar.gz: not written")


def test_cli_exit_codes(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from fastqwen import cli

    monkeypatch.setattr(cli, "COMMANDS", {"package": cli.COMMANDS["package"]})
    root = make_engine(tmp_path / "engine")
    assert cli.main(["package", str(root), "-o", str(tmp_path / "ok.tar.gz")]) == 0
    assert cli.main(["package", str(root), "-o", str(root / "in.tar.gz")]) == 2
    assert "is inside" in capsys.readouterr().err
    (root / "bad.bin").write_bytes(b"x")
    assert cli.main(["package", str(root), "-o", str(tmp_path / "bad.tar.gz")]) == 1
