"""`fastqwen validate`: one fixture per archive or interface rule, built in memory or in tmp_path."""
from __future__ import annotations

import argparse
import gzip
import io
import os
import pathlib
import tarfile

import pytest

from fastqwen import submission
from fastqwen.errors import UserError
from fastqwen.submission import Finding, validate_path

REPO = pathlib.Path(__file__).resolve().parents[1]

ENGINE_SOURCE = b'''import torch


class Engine:
    def __init__(self, model_path: str):
        self.model_path = model_path

    def generate(self, input_ids: list[list[int]], max_new_tokens: int):
        for _ in range(max_new_tokens):
            yield [0 for _ in input_ids]
'''


def regular(name: str, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info, data


def special(name: str, kind: bytes, linkname: str = "") -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = linkname
    return info, None


def write_tar(
    path: pathlib.Path, entries: list[tuple[tarfile.TarInfo, bytes | None]], level: int = 6
) -> pathlib.Path:
    """Write a .tar.gz of exactly these members, built in memory."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in entries:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    path.write_bytes(gzip.compress(buffer.getvalue(), compresslevel=level))
    return path


def archive(
    tmp_path: pathlib.Path,
    files: dict[str, bytes] | None = None,
    extra: list[tuple[tarfile.TarInfo, bytes | None]] | None = None,
    level: int = 6,
) -> pathlib.Path:
    """A .tar.gz holding a valid engine.py (unless `files` replaces it), plus `extra` members."""
    files = {"engine.py": ENGINE_SOURCE} if files is None else files
    entries = [regular(name, data) for name, data in files.items()] + (extra or [])
    return write_tar(tmp_path / "submission.tar.gz", entries, level)


def folder(tmp_path: pathlib.Path, files: dict[str, bytes]) -> pathlib.Path:
    root = tmp_path / "engine_dir"
    for name, data in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return root


def only(report: submission.Report, rule: str) -> Finding:
    """The single violation of `rule`, after checking that `rule` is the only rule broken."""
    assert report.rules() == {rule}, report.lines()
    matching = [v for v in report.violations if v.rule == rule]
    assert len(matching) == 1, report.lines()
    return matching[0]


# --------------------------------------------------------------------------- valid submissions


def test_minimal_archive_is_valid(tmp_path: pathlib.Path) -> None:
    report = validate_path(archive(tmp_path))
    assert report.ok, report.lines()
    assert report.warnings == []
    assert report.files == 1
    assert report.expanded_bytes == len(ENGINE_SOURCE)
    assert report.compressed_bytes == (tmp_path / "submission.tar.gz").stat().st_size
    assert "valid" in report.summary()


def test_repo_engine_folder_is_valid() -> None:
    engine_dir = REPO / "engine"
    if not (engine_dir / "engine.py").exists():
        pytest.skip("engine/engine.py does not exist yet")
    report = validate_path(engine_dir)
    assert report.ok, report.lines()


def test_native_engine_folder_is_valid(native_engine_dir: pathlib.Path) -> None:
    report = validate_path(native_engine_dir)
    assert report.ok, report.lines()
    assert report.compressed_bytes is not None and report.compressed_bytes > 0


def test_packages_and_reexported_engine_are_valid(tmp_path: pathlib.Path) -> None:
    files = {
        "engine.py": b"from fq_engine import FastEngine as Engine\n",
        "fq_engine.py": ENGINE_SOURCE.replace(b"class Engine", b"class FastEngine")
        + b"\nfrom fqkernels.rmsnorm import norm\nimport fqkernels.ns.deep\n",
        "fqkernels/__init__.py": b"",
        "fqkernels/rmsnorm.py": b"import triton\nimport triton.language as tl\nnorm = 1\n",
        "fqkernels/ns/deep.py": b"import numpy, safetensors, tokenizers, transformers, json\n",
        "config.yaml": b"a: 1\n",
        "types.pyi": b"x: int\n",
    }
    report = validate_path(archive(tmp_path, files))
    assert report.ok, report.lines()
    assert report.warnings == [], report.lines()


# --------------------------------------------------------------------------- member names and kinds


def test_parent_component(tmp_path: pathlib.Path) -> None:
    report = validate_path(archive(tmp_path, extra=[regular("../x.txt", b"escape\n")]))
    finding = only(report, "parent-path")
    assert finding.path == "../x.txt"
    assert "'..'" in finding.detail
    # Checking reads in memory: nothing was extracted next to the archive.
    assert not (tmp_path.parent / "x.txt").exists()


def test_absolute_path(tmp_path: pathlib.Path) -> None:
    report = validate_path(archive(tmp_path, extra=[regular("/tmp/abs.txt", b"x\n")]))
    finding = only(report, "absolute-path")
    assert finding.path == "/tmp/abs.txt"
    assert "absolute member name" in finding.detail


def test_symlink_member(tmp_path: pathlib.Path) -> None:
    report = validate_path(archive(tmp_path, extra=[special("link.py", tarfile.SYMTYPE, "/etc/passwd")]))
    finding = only(report, "symlink")
    assert finding.path == "link.py"
    assert "symbolic link to /etc/passwd" in finding.detail


def test_hardlink_member(tmp_path: pathlib.Path) -> None:
    report = validate_path(archive(tmp_path, extra=[special("copy.py", tarfile.LNKTYPE, "engine.py")]))
    finding = only(report, "hardlink")
    assert finding.path == "copy.py"
    assert "hard link to engine.py" in finding.detail


@pytest.mark.parametrize(
    ("kind", "rule", "words"),
    [
        (tarfile.FIFOTYPE, "fifo", "named pipe"),
        (tarfile.CHRTYPE, "device", "device node"),
        (tarfile.BLKTYPE, "device", "device node"),
    ],
)
def test_special_members(tmp_path: pathlib.Path, kind: bytes, rule: str, words: str) -> None:
    report = validate_path(archive(tmp_path, extra=[special("node.txt", kind)]))
    finding = only(report, rule)
    assert finding.path == "node.txt"
    assert words in finding.detail


def test_dot_prefix(tmp_path: pathlib.Path) -> None:
    report = validate_path(archive(tmp_path, {"./engine.py": ENGINE_SOURCE}))
    finding = only(report, "dot-prefix")
    assert finding.path == "./engine.py"
    assert "starts with './'" in finding.detail


def test_nested_engine_folder(tmp_path: pathlib.Path) -> None:
    report = validate_path(archive(tmp_path, {"engine/engine.py": ENGINE_SOURCE}))
    finding = only(report, "missing-engine")
    assert finding.path == "engine.py"
    assert "found engine/engine.py" in finding.detail
    assert "not the folder itself" in finding.detail


def test_duplicate_member(tmp_path: pathlib.Path) -> None:
    report = validate_path(archive(tmp_path, extra=[regular("engine.py", ENGINE_SOURCE)]))
    finding = only(report, "duplicate-entry")
    assert finding.path == "engine.py"
    assert "more than once" in finding.detail


def test_not_a_gzip(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "broken.tar.gz"
    path.write_bytes(b"this is not gzip data at all")
    finding = only(validate_path(path), "bad-archive")
    assert finding.path == "broken.tar.gz"
    assert "gzip" in finding.detail


def test_gzip_bomb_stops_reading(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The cap is lowered so the test stays small; the code path is the one a real bomb takes.
    monkeypatch.setattr(submission, "READ_LIMIT_BYTES", 1024 * 1024)
    path = archive(tmp_path, extra=[regular("big.txt", b"a" * (2 * 1024 * 1024))])
    finding = only(validate_path(path), "expanded-size")
    assert "stopped reading" in finding.detail


# --------------------------------------------------------------------------- limits


def test_oversize_folder(tmp_path: pathlib.Path) -> None:
    size = submission.MAX_EXPANDED_BYTES + 1
    root = folder(tmp_path, {"engine.py": ENGINE_SOURCE, "big.txt": b"a" * size})
    report = validate_path(root)
    finding = only(report, "expanded-size")
    assert finding.path == "engine_dir"
    assert f"{size + len(ENGINE_SOURCE):,} bytes expanded" in finding.detail
    assert report.compressed_bytes is None  # too large to be worth compressing


def test_too_many_files(tmp_path: pathlib.Path) -> None:
    extra = [regular(f"notes/{i:03d}.txt", b"x\n") for i in range(submission.MAX_FILES)]
    report = validate_path(archive(tmp_path, extra=extra))
    finding = only(report, "too-many-files")
    assert finding.detail == f"{submission.MAX_FILES + 1} files, limit {submission.MAX_FILES}"


def test_exactly_max_files_is_fine(tmp_path: pathlib.Path) -> None:
    extra = [regular(f"notes/{i:03d}.txt", b"x\n") for i in range(submission.MAX_FILES - 1)]
    assert validate_path(archive(tmp_path, extra=extra)).ok


def test_over_compressed_limit(tmp_path: pathlib.Path) -> None:
    # Random hex is text (no NUL) yet compresses only to ~58% (4 bits of entropy per 8-bit byte).
    noise = os.urandom(submission.MAX_COMPRESSED_BYTES).hex().encode()
    path = archive(tmp_path, extra=[regular("noise.txt", noise)], level=1)
    report = validate_path(path)
    finding = only(report, "compressed-size")
    assert finding.detail.startswith(f"{path.stat().st_size:,} bytes compressed")


# --------------------------------------------------------------------------- file contents


def test_shared_object(tmp_path: pathlib.Path) -> None:
    report = validate_path(archive(tmp_path, extra=[regular("fqkernels/fast.so", b"ELF")]))
    finding = only(report, "extension")
    assert finding.path == "fqkernels/fast.so"
    assert "'.so' is not allowed" in finding.detail


def test_dotfile_has_no_allowed_extension(tmp_path: pathlib.Path) -> None:
    finding = only(validate_path(archive(tmp_path, extra=[regular(".env", b"TOKEN=1\n")])), "extension")
    assert "no extension" in finding.detail


def test_nul_bytes(tmp_path: pathlib.Path) -> None:
    report = validate_path(archive(tmp_path, extra=[regular("table.json", b'{"a": 1}\0\0')]))
    finding = only(report, "binary-content")
    assert finding.path == "table.json"
    assert "NUL byte at offset 8" in finding.detail


def test_missing_engine(tmp_path: pathlib.Path) -> None:
    report = validate_path(archive(tmp_path, {"model.py": ENGINE_SOURCE}))
    finding = only(report, "missing-engine")
    assert finding == Finding("engine.py", "missing-engine", "no engine.py at the root")


def test_missing_engine_class(tmp_path: pathlib.Path) -> None:
    source = ENGINE_SOURCE.replace(b"class Engine", b"class Engin")
    report = validate_path(archive(tmp_path, {"engine.py": source}))
    finding = only(report, "missing-engine-class")
    assert f"{finding.path}: {finding.rule}: {finding.detail}" == (
        "engine.py: missing-engine-class: no top-level class Engine in engine.py"
    )


def test_engine_bound_by_assignment(tmp_path: pathlib.Path) -> None:
    source = ENGINE_SOURCE.replace(b"class Engine", b"class Real") + b"\nEngine = Real\n"
    finding = only(validate_path(archive(tmp_path, {"engine.py": source})), "missing-engine-class")
    assert "Engine = Real" in finding.detail


def test_missing_generate(tmp_path: pathlib.Path) -> None:
    source = ENGINE_SOURCE.replace(b"def generate", b"def run")
    finding = only(validate_path(archive(tmp_path, {"engine.py": source})), "missing-engine-method")
    assert "defines no generate" in finding.detail


@pytest.mark.parametrize(
    ("old", "new", "problem"),
    [
        (b"max_new_tokens: int)", b"max_new_tokens: int, temperature=0.0)", "has other parameters"),
        (b"max_new_tokens: int)", b"max_new_tokens: int = 32)", "has default values"),
        (b"input_ids: list[list[int]], max_new_tokens: int)", b"*args)", "takes *args or **kwargs"),
        (b"max_new_tokens: int)", b"*, max_new_tokens: int)", "has keyword-only parameters"),
        (b"def generate", b"async def generate", "is async"),
        (b"input_ids: list[list[int]]", b"prompts", "has other parameters"),
    ],
)
def test_wrong_generate_signature(tmp_path: pathlib.Path, old: bytes, new: bytes, problem: str) -> None:
    source = ENGINE_SOURCE.replace(old, new)
    assert source != ENGINE_SOURCE
    finding = only(validate_path(archive(tmp_path, {"engine.py": source})), "engine-signature")
    assert finding.detail.startswith("line 8: Engine.generate(")
    assert problem in finding.detail
    assert finding.detail.endswith("expected Engine.generate(self, input_ids, max_new_tokens)")


def test_keyword_only_options_with_defaults_are_allowed(tmp_path: pathlib.Path) -> None:
    """Engine(model_path) still binds an __init__ with keyword-only options that have defaults (the
    engine's own); one without a default does not, and is refused."""
    source = ENGINE_SOURCE.replace(b"model_path: str)", b"model_path: str, *, graphs: bool = True)")
    assert source != ENGINE_SOURCE and validate_path(archive(tmp_path, {"engine.py": source})).ok
    source = ENGINE_SOURCE.replace(b"model_path: str)", b"model_path: str, *, graphs: bool)")
    finding = only(validate_path(archive(tmp_path, {"engine.py": source})), "engine-signature")
    assert "has keyword-only parameters without defaults" in finding.detail


def test_wrong_init_signature(tmp_path: pathlib.Path) -> None:
    source = ENGINE_SOURCE.replace(b"model_path: str)", b"model_path: str, device='cuda')")
    finding = only(validate_path(archive(tmp_path, {"engine.py": source})), "engine-signature")
    assert "Engine.__init__(self, model_path: str, device='cuda') has other parameters" in finding.detail


def test_relative_import(tmp_path: pathlib.Path) -> None:
    files = {
        "engine.py": ENGINE_SOURCE + b"import fqkernels.a\n",
        "fqkernels/__init__.py": b"",
        "fqkernels/a.py": b"from .b import f\n",
        "fqkernels/b.py": b"f = 1\n",
    }
    report = validate_path(archive(tmp_path, files))
    finding = only(report, "relative-import")
    assert finding.path == "fqkernels/a.py"
    assert "`from .b import f`" in finding.detail
    assert "(fqkernels.b)" in finding.detail
    assert report.warnings == []  # the relative import still counts as reaching b.py


def test_disallowed_import(tmp_path: pathlib.Path) -> None:
    source = ENGINE_SOURCE + b"\n\ndef fetch():\n    import requests.adapters\n"
    finding = only(validate_path(archive(tmp_path, {"engine.py": source})), "disallowed-import")
    assert finding.path == "engine.py"
    assert finding.detail.startswith("line 14: imports requests.adapters;")


def test_missing_local_module(tmp_path: pathlib.Path) -> None:
    files = {"engine.py": ENGINE_SOURCE + b"from fqkernels.gemv import gemv\n", "fqkernels/__init__.py": b""}
    finding = only(validate_path(archive(tmp_path, files)), "missing-module")
    assert "no fqkernels/gemv.py or fqkernels/gemv/__init__.py" in finding.detail


def test_syntax_error(tmp_path: pathlib.Path) -> None:
    files = {"engine.py": ENGINE_SOURCE + b"import fq_util\n", "fq_util.py": b"def broken(:\n    pass\n"}
    finding = only(validate_path(archive(tmp_path, files)), "syntax-error")
    assert finding.path == "fq_util.py"
    assert finding.detail.startswith("line 1:")


def test_unreachable_module_is_a_warning(tmp_path: pathlib.Path) -> None:
    files = {"engine.py": ENGINE_SOURCE, "fq_old.py": b"import torch\n", "README.md": b"# notes\n"}
    report = validate_path(archive(tmp_path, files))
    assert report.ok
    assert [(w.path, w.rule) for w in report.warnings] == [("fq_old.py", "unreachable")]
    assert "fq_old.py: warning: nothing imports it from engine.py" in "\n".join(report.lines())


# --------------------------------------------------------------------------- folders


def test_folder_skips_caches_and_dotfiles(tmp_path: pathlib.Path) -> None:
    root = folder(
        tmp_path,
        {
            "engine.py": ENGINE_SOURCE,
            "__pycache__/engine.cpython-311.pyc": b"\0\0",
            "stray.pyc": b"\0",
            ".git/config": b"x",
            ".env": b"TOKEN=1",
        },
    )
    report = validate_path(root)
    assert report.ok, report.lines()
    assert report.files == 1
    assert report.skipped == 4


def test_folder_symlink_and_fifo(tmp_path: pathlib.Path) -> None:
    root = folder(tmp_path, {"engine.py": ENGINE_SOURCE})
    (root / "alias.py").symlink_to("engine.py")
    os.mkfifo(root / "pipe.txt")
    report = validate_path(root)
    assert report.rules() == {"symlink", "fifo"}
    assert Finding("alias.py", "symlink", "symbolic link to engine.py; only regular files and folders are allowed") in (
        report.violations
    )


# --------------------------------------------------------------------------- command line


def run_validate(path: pathlib.Path | str) -> int:
    parser = argparse.ArgumentParser()
    submission.add_arguments(parser)
    return submission.run(parser.parse_args([str(path)]))


def test_run_exit_codes(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_validate(archive(tmp_path)) == 0
    assert capsys.readouterr().out.strip().startswith("submission.tar.gz: valid (1 of 200 files")

    broken = write_tar(tmp_path / "bad.tar.gz", [regular("engine.py", b"x = 1\n"), regular("lib.so", b"")])
    assert run_validate(broken) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[:2] == [
        "lib.so: extension: '.so' is not allowed; allowed: .py .pyi .yaml .yml .json .toml .txt .md .cfg .ini",
        "engine.py: missing-engine-class: no top-level class Engine in engine.py",
    ]
    assert lines[-1].startswith("bad.tar.gz: INVALID: 2 violations, 0 warnings")

    with pytest.raises(UserError, match="no such file or folder"):
        run_validate(tmp_path / "missing")
    (tmp_path / "engine.zip").write_bytes(b"PK")
    with pytest.raises(UserError, match=r"engine\.zip: not a folder or a \.tar\.gz archive"):
        run_validate(tmp_path / "engine.zip")


def test_cli_exit_codes(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from fastqwen import cli

    # Only this subcommand: the exit codes must not depend on the other tools' modules.
    monkeypatch.setattr(cli, "COMMANDS", {"validate": cli.COMMANDS["validate"]})
    assert cli.main(["validate", str(archive(tmp_path))]) == 0
    assert cli.main(["validate", str(write_tar(tmp_path / "bad.tar.gz", [regular("a.txt", b"")]))]) == 1
    assert cli.main(["validate", str(tmp_path / "missing")]) == 2
    assert "missing: no such file or folder" in capsys.readouterr().err
