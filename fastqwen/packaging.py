"""Build a reproducible submission archive from an engine folder (`fastqwen package DIR -o OUT`).

The same folder always gives the same bytes: members sorted by name, every
timestamp, owner and permission fixed, and a gzip header with no name and no
time. So an archive's SHA-256 identifies the engine it holds, and two builds
can be compared by hash alone.

What goes in is `submission.scan_folder`'s walk (skipping `__pycache__`,
`*.pyc`, dotfiles and dot-folders), written by `submission.build_archive`;
whether it may go in is decided by `submission`'s checks, run on the folder
first and on the finished bytes again before anything is written. This
module adds the output checks and the write; the rules and the archive
format live in `submission`, which never imports this module.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from fastqwen.errors import UserError
from fastqwen.submission import (
    ARCHIVE_SUFFIX,
    FILE_MODE,
    Report,
    build_archive,
    print_report,
    scan_folder,
    validate_archive_bytes,
    validate_scan,
)


@dataclass(frozen=True)
class PackageResult:
    """The outcome of `package_folder`: `written` is False when `report` has violations."""

    output: Path
    written: bool
    report: Report
    size: int | None = None
    files: int = 0
    sha256: str | None = None


def _check_output(folder: Path, output: Path) -> None:
    if not output.name.endswith(ARCHIVE_SUFFIX):
        raise UserError(f"{output}: the output name must end with {ARCHIVE_SUFFIX}")
    if output.is_dir():
        raise UserError(f"{output}: is a folder; give the archive's file name")
    if not output.parent.is_dir():
        raise UserError(f"{output.parent}: the output's folder does not exist")
    # Inside DIR the archive would be packaged into its own next build.
    if output.resolve().is_relative_to(folder.resolve()):
        raise UserError(f"{output}: is inside {folder}; write the archive outside the engine folder")


def package_folder(folder: str | os.PathLike[str], output: str | os.PathLike[str]) -> PackageResult:
    """Validate `folder`, archive it, validate the archive, and write it to `output` only if all is valid."""
    folder, output = Path(folder), Path(output)
    if not folder.exists():
        raise UserError(f"{folder}: no such folder")
    if not folder.is_dir():
        raise UserError(f"{folder}: not a folder")
    _check_output(folder, output)

    scan = scan_folder(folder)
    folder_report = validate_scan(scan)
    if not folder_report.ok:
        return PackageResult(output=output, written=False, report=folder_report)

    raw = build_archive(scan)
    archive_report = validate_archive_bytes(raw, output.name)
    if not archive_report.ok:
        return PackageResult(output=output, written=False, report=archive_report)

    # Write then rename, so a failed write never leaves half an archive under the final name.
    fd, tmp_name = tempfile.mkstemp(prefix=output.name + ".", suffix=".tmp", dir=output.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(raw)
        os.chmod(tmp_name, FILE_MODE)
        os.replace(tmp_name, output)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    return PackageResult(
        output=output,
        written=True,
        report=archive_report,
        size=len(raw),
        files=len(scan.files),
        sha256=hashlib.sha256(raw).hexdigest(),
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", metavar="DIR", help="the engine folder (engine.py at its root)")
    parser.add_argument(
        "-o",
        "--output",
        default="submission" + ARCHIVE_SUFFIX,
        help=f"where to write the archive, outside DIR (default: submission{ARCHIVE_SUFFIX})",
    )


def run(args: argparse.Namespace) -> int:
    result = package_folder(args.dir, args.output)
    print_report(result.report)
    if not result.written:
        print(f"{result.output}: not written")
        return 1
    print(f"wrote {result.output}: {result.size:,} bytes, {result.files} files, sha256 {result.sha256}")
    return 0
