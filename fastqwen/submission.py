"""Check a submission folder or `.tar.gz` against every archive and interface rule.

`fastqwen validate PATH` and `validate_path(path) -> Report`. The rules are
CONTRACT.md's "The archive" and "The interface": `engine.py` at the root with a
top-level `class Engine(__init__(self, model_path), generate(self, input_ids,
max_new_tokens))`, size and file-count limits, allowed extensions, text only,
no links or special entries, and every import resolvable on the platform
(standard library, its pinned packages, or a module inside the folder).

Archives are read in memory and never extracted: the gzip stream is
decompressed with a hard cap, and members are read from that buffer. Python
sources are checked from their syntax tree, never imported, so validating an
untrusted archive runs none of its code.

A folder is checked as `fastqwen package` would ship it: the same walk
(`scan_folder`, which skips `__pycache__`, `*.pyc`, dotfiles and dot-folders)
and the compressed size of the archive that `package` would write
(`build_archive`, the one writer of that format; `fastqwen.packaging`
imports it from here).
"""
from __future__ import annotations

import argparse
import ast
import gzip
import io
import os
import stat
import sys
import tarfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple, TextIO

from fastqwen.errors import UserError

MAX_FILES = 200
MAX_COMPRESSED_BYTES = 2 * 1024 * 1024
MAX_EXPANDED_BYTES = 16 * 1024 * 1024
# Past this many bytes (on disk, or decompressed) nothing more is read: such an
# archive is refused anyway, and a gzip bomb must not be able to fill memory.
READ_LIMIT_BYTES = 4 * MAX_EXPANDED_BYTES

ALLOWED_EXTENSIONS = (".py", ".pyi", ".yaml", ".yml", ".json", ".toml", ".txt", ".md", ".cfg", ".ini")
# What the platform's runtime has besides the standard library (CONTRACT.md,
# "The model and the runtime"). Their own dependencies (jinja2, filelock, ...)
# happen to be installed too, but nothing promises them.
PLATFORM_PACKAGES = ("numpy", "safetensors", "tokenizers", "torch", "transformers", "triton")
ARCHIVE_SUFFIX = ".tar.gz"

ENGINE_FILE = "engine.py"
ENGINE_CLASS = "Engine"
ENGINE_METHODS: dict[str, tuple[str, ...]] = {
    "__init__": ("self", "model_path"),
    "generate": ("self", "input_ids", "max_new_tokens"),
}

# Every rule a violation can name, with what it means.
RULES: dict[str, str] = {
    "bad-archive": "the file is not a readable gzip-compressed tar",
    "absolute-path": "a member name starts with '/'",
    "parent-path": "a member name has a '..' component",
    "dot-prefix": "a member name starts with './'",
    "bad-path": "a member name is empty, has a backslash, or an empty or '.' component",
    "duplicate-entry": "two members have the same name",
    "symlink": "a symbolic link",
    "hardlink": "a hard link",
    "device": "a character or block device",
    "fifo": "a named pipe",
    "non-regular": "an entry that is not a regular file or a directory",
    "too-many-files": f"more than {MAX_FILES} files",
    "compressed-size": f"more than {MAX_COMPRESSED_BYTES:,} bytes compressed",
    "expanded-size": f"more than {MAX_EXPANDED_BYTES:,} bytes expanded",
    "extension": "a file whose extension is not one of " + " ".join(ALLOWED_EXTENSIONS),
    "binary-content": "a file that contains NUL bytes",
    "syntax-error": "a .py file that does not parse",
    "missing-engine": "no engine.py at the root",
    "missing-engine-class": "engine.py defines no top-level class Engine",
    "missing-engine-method": "Engine's class body lacks __init__ or generate",
    "engine-signature": "Engine.__init__ or Engine.generate has another signature than the contract's",
    "relative-import": "a relative import (breaks when engine is loaded as a top-level module)",
    "disallowed-import": "an import of a package the platform does not provide",
    "missing-module": "an import of a module of the folder's own packages that does not exist",
}

_LINK_RULES = {"symlink": "symlink", "hardlink": "hardlink", "device": "device", "fifo": "fifo", "other": "non-regular"}


class Finding(NamedTuple):
    """One problem: the member or file it concerns, the rule's name, and what exactly is wrong."""

    path: str
    rule: str
    detail: str


@dataclass
class Report:
    """What `validate_path` found. `violations` fail a submission; `warnings` do not."""

    source: str
    violations: list[Finding] = field(default_factory=list)
    warnings: list[Finding] = field(default_factory=list)
    files: int = 0
    expanded_bytes: int = 0
    # None when it could not be known (a folder too large to package).
    compressed_bytes: int | None = None
    skipped: int = 0

    @property
    def ok(self) -> bool:
        return not self.violations

    def violation(self, path: str, rule: str, detail: str) -> None:
        # A typo in a rule name would silently change the interface; catch it here.
        assert rule in RULES, f"unknown rule {rule!r}"
        self.violations.append(Finding(path, rule, detail))

    def warn(self, path: str, rule: str, detail: str) -> None:
        self.warnings.append(Finding(path, rule, detail))

    def rules(self) -> set[str]:
        return {v.rule for v in self.violations}

    def lines(self) -> list[str]:
        """One line per violation (`path: rule: detail`), then one per warning (`path: warning: detail`)."""
        return [f"{v.path}: {v.rule}: {v.detail}" for v in self.violations] + [
            f"{w.path}: warning: {w.detail}" for w in self.warnings
        ]

    def summary(self) -> str:
        compressed = (
            "compressed size unknown"
            if self.compressed_bytes is None
            else f"{self.compressed_bytes:,} of {MAX_COMPRESSED_BYTES:,} bytes compressed"
        )
        sizes = (
            f"{self.files} of {MAX_FILES} files, {self.expanded_bytes:,} of {MAX_EXPANDED_BYTES:,} bytes expanded, "
            f"{compressed}"
        )
        if self.skipped:
            sizes += f", {self.skipped} skipped (__pycache__, *.pyc, dotfiles)"
        warnings = _plural(len(self.warnings), "warning")
        if self.ok:
            return f"{self.source}: valid ({sizes}); {warnings}"
        return f"{self.source}: INVALID: {_plural(len(self.violations), 'violation')}, {warnings} ({sizes})"


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


# --------------------------------------------------------------------------- folders


@dataclass(frozen=True)
class FolderEntry:
    """One entry of a folder walk: its POSIX path relative to the root, and what kind of entry it is."""

    name: str
    path: Path
    kind: str  # "file", "symlink", "fifo", "device" or "other"
    size: int
    link_target: str = ""


@dataclass(frozen=True)
class FolderScan:
    """What `package` would ship from a folder (regular files) and what it cannot ship (the rest)."""

    root: Path
    entries: list[FolderEntry]  # sorted by name
    skipped: list[str]

    @property
    def files(self) -> list[FolderEntry]:
        return [e for e in self.entries if e.kind == "file"]


def is_skipped_name(name: str, is_dir: bool) -> bool:
    """True for what never belongs in a submission: dotfiles, dot-folders, `__pycache__`, `*.pyc`."""
    if name.startswith("."):
        return True
    return name == "__pycache__" if is_dir else name.endswith(".pyc")


def _kind_of_mode(mode: int) -> str:
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISLNK(mode):
        return "symlink"
    if stat.S_ISFIFO(mode):
        return "fifo"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "device"
    return "other"


def scan_folder(root: str | os.PathLike[str]) -> FolderScan:
    """Walk `root` without following links; the single walk both `validate` and `package` use."""
    root = Path(root)
    if not root.is_dir():
        raise UserError(f"{root}: not a folder")
    entries: list[FolderEntry] = []
    skipped: list[str] = []

    def visit(folder: Path, prefix: str) -> None:
        for child in sorted(os.scandir(folder), key=lambda d: d.name):
            name = prefix + child.name
            info = child.stat(follow_symlinks=False)
            kind = _kind_of_mode(info.st_mode)
            if is_skipped_name(child.name, kind == "dir"):
                skipped.append(name)
            elif kind == "dir":
                visit(Path(child.path), name + "/")
            else:
                target = os.readlink(child.path) if kind == "symlink" else ""
                entries.append(FolderEntry(name, Path(child.path), kind, info.st_size if kind == "file" else 0, target))

    visit(root, "")
    entries.sort(key=lambda e: e.name)
    return FolderScan(root=root, entries=entries, skipped=skipped)


FILE_MODE = 0o644
# Level 9: the archive is built once and the 2 MiB limit is what binds.
GZIP_LEVEL = 9


def build_archive(scan: FolderScan) -> bytes:
    """The `.tar.gz` bytes `fastqwen package` writes for `scan`: its regular files, identical for identical
    contents (sorted names, fixed times, owners and modes, a gzip header with no name and no time)."""
    tar_buffer = io.BytesIO()
    # PAX only adds extended headers when a name needs them (long or non-ASCII),
    # and then deterministically.
    with tarfile.open(fileobj=tar_buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for entry in scan.files:  # already sorted by name
            data = entry.path.read_bytes()
            info = tarfile.TarInfo(entry.name)
            info.size = len(data)
            info.mtime = 0
            info.mode = FILE_MODE
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.type = tarfile.REGTYPE
            tar.addfile(info, io.BytesIO(data))
    gz_buffer = io.BytesIO()
    # An empty filename leaves the FNAME field out; mtime=0 zeroes the header's time.
    with gzip.GzipFile(filename="", mode="wb", fileobj=gz_buffer, compresslevel=GZIP_LEVEL, mtime=0) as gz:
        gz.write(tar_buffer.getvalue())
    return gz_buffer.getvalue()


def validate_folder(root: str | os.PathLike[str]) -> Report:
    """Check a folder exactly as `fastqwen package` would archive it."""
    return validate_scan(scan_folder(root))


def validate_scan(scan: FolderScan) -> Report:
    """Check the result of `scan_folder` (contents are read from disk, nothing is imported)."""
    report = Report(source=_label(scan.root), skipped=len(scan.skipped))
    members = [_Member(e.name, e.kind, e.size, None, e.link_target) for e in scan.entries]
    total = sum(e.size for e in scan.files)
    if total <= READ_LIMIT_BYTES:
        contents = {e.name: e.path.read_bytes() for e in scan.files}
        members = [_Member(m.name, m.kind, m.size, contents.get(m.name), m.link_target) for m in members]
    if total <= MAX_EXPANDED_BYTES:
        report.compressed_bytes = len(build_archive(scan))
    _check_members(report, members)
    return report


# --------------------------------------------------------------------------- archives


@dataclass(frozen=True)
class _Member:
    name: str  # as stored
    kind: str  # "file", "dir", "symlink", "hardlink", "device", "fifo" or "other"
    size: int
    data: bytes | None  # None when not read
    link_target: str = ""


def _kind_of_member(info: tarfile.TarInfo) -> str:
    if info.isreg():
        return "file"
    if info.isdir():
        return "dir"
    if info.issym():
        return "symlink"
    if info.islnk():
        return "hardlink"
    if info.ischr() or info.isblk():
        return "device"
    if info.isfifo():
        return "fifo"
    return "other"


def validate_archive(path: str | os.PathLike[str]) -> Report:
    """Check a `.tar.gz` file on disk, in memory."""
    path = Path(path)
    size = path.stat().st_size
    if size > READ_LIMIT_BYTES:
        report = Report(source=_label(path), compressed_bytes=size)
        report.violation(
            report.source,
            "compressed-size",
            f"{size:,} bytes, limit {MAX_COMPRESSED_BYTES:,}; too large to inspect further",
        )
        return report
    return validate_archive_bytes(path.read_bytes(), _label(path))


def validate_archive_bytes(raw: bytes, source: str = "archive") -> Report:
    """Check the bytes of a `.tar.gz` without touching the disk; `source` names it in the report."""
    report = Report(source=source, compressed_bytes=len(raw))
    try:
        with gzip.GzipFile(fileobj=io.BytesIO(raw), mode="rb") as stream:
            # One byte over the cap is enough to know the cap was crossed.
            tar_bytes = stream.read(READ_LIMIT_BYTES + 1)
    except (OSError, EOFError, zlib.error) as exc:
        report.violation(source, "bad-archive", f"not a readable gzip stream ({exc})")
        return report
    if len(tar_bytes) > READ_LIMIT_BYTES:
        report.violation(
            source,
            "expanded-size",
            f"decompresses to more than {READ_LIMIT_BYTES:,} bytes, limit {MAX_EXPANDED_BYTES:,}; stopped reading",
        )
        return report
    members: list[_Member] = []
    try:
        with tarfile.open(fileobj=io.BytesIO(tar_bytes), mode="r:") as tar:
            for info in tar:
                kind = _kind_of_member(info)
                data = None
                if kind == "file":
                    extracted = tar.extractfile(info)
                    data = extracted.read() if extracted is not None else b""
                members.append(_Member(info.name, kind, info.size if kind == "file" else 0, data, info.linkname))
    except tarfile.TarError as exc:
        report.violation(source, "bad-archive", f"not a readable tar inside the gzip stream ({exc})")
        return report
    _check_members(report, members)
    return report


# --------------------------------------------------------------------------- shared checks


def _normal_name(report: Report, name: str) -> str | None:
    """The member's path relative to the root, or None when it cannot be one (after reporting why)."""
    if name == "":
        report.violation("<empty name>", "bad-path", "a member has an empty name")
        return None
    if name.startswith("/"):
        report.violation(name, "absolute-path", "absolute member name; names must be relative to the archive root")
        return None
    if ".." in name.split("/"):
        report.violation(name, "parent-path", "'..' component; it would write outside the extraction folder")
        return None
    if "\\" in name:
        report.violation(name, "bad-path", "backslash in a member name; use '/' as the separator")
        return None
    normal = name
    if name == "." or name.startswith("./"):
        report.violation(
            name,
            "dot-prefix",
            "member name starts with './' (as `tar -C DIR .` writes); name members from the root, "
            "e.g. `fastqwen package DIR`",
        )
        while normal.startswith("./"):
            normal = normal[2:]
        if normal in ("", "."):
            return None  # the root folder itself
    if any(part in ("", ".") for part in normal.split("/")):
        report.violation(name, "bad-path", "empty or '.' path component")
        return None
    return normal


def _extension(name: str) -> str:
    base = name.rsplit("/", 1)[-1]
    dot = base.rfind(".")
    # A leading dot makes a hidden file, not an extension (".env" has none).
    return base[dot:].lower() if dot > 0 else ""


def _check_members(report: Report, members: list[_Member]) -> None:
    """Every rule, on a list of members from a folder or an archive."""
    files: dict[str, bytes | None] = {}
    others: dict[str, str] = {}  # normal name -> kind, for entries that are neither files nor folders
    seen: set[str] = set()
    for member in members:
        if member.kind != "dir":
            report.files += 1
        if member.kind == "file":
            report.expanded_bytes += member.size
        normal = _normal_name(report, member.name)
        if normal is None:
            continue
        if normal in seen and member.kind != "dir":
            report.violation(member.name, "duplicate-entry", f"{normal} appears more than once; the last copy wins")
        seen.add(normal)
        if member.kind == "file":
            files[normal] = member.data
        elif member.kind != "dir":
            others[normal] = member.kind
            target = f" to {member.link_target}" if member.link_target else ""
            rule = _LINK_RULES[member.kind]
            what = {
                "symlink": f"symbolic link{target}",
                "hardlink": f"hard link{target}",
                "device": "device node",
                "fifo": "named pipe (fifo)",
                "other": "special entry",
            }[member.kind]
            report.violation(member.name, rule, f"{what}; only regular files and folders are allowed")

    if report.files > MAX_FILES:
        report.violation(report.source, "too-many-files", f"{report.files} files, limit {MAX_FILES}")
    if report.expanded_bytes > MAX_EXPANDED_BYTES:
        report.violation(
            report.source,
            "expanded-size",
            f"{report.expanded_bytes:,} bytes expanded, limit {MAX_EXPANDED_BYTES:,}",
        )
    if report.compressed_bytes is not None and report.compressed_bytes > MAX_COMPRESSED_BYTES:
        report.violation(
            report.source,
            "compressed-size",
            f"{report.compressed_bytes:,} bytes compressed, limit {MAX_COMPRESSED_BYTES:,}",
        )

    texts: dict[str, bytes] = {}
    for name, data in files.items():
        ext = _extension(name)
        if ext not in ALLOWED_EXTENSIONS:
            shown = f"'{ext}'" if ext else "no extension"
            report.violation(name, "extension", f"{shown} is not allowed; allowed: {' '.join(ALLOWED_EXTENSIONS)}")
        elif data is not None and b"\0" in data:
            offset = data.index(b"\0")
            report.violation(name, "binary-content", f"NUL byte at offset {offset}; only text files are allowed")
        elif data is not None:
            texts[name] = data

    _check_engine_present(report, files, others)
    python = PythonChecks(report, texts)
    python.run()


def _check_engine_present(report: Report, files: dict[str, bytes | None], others: dict[str, str]) -> None:
    if ENGINE_FILE in files:
        return
    if ENGINE_FILE in others:
        detail = f"engine.py is a {others[ENGINE_FILE]}, not a regular file"
    else:
        nested = sorted(n for n in files if n.endswith("/" + ENGINE_FILE))
        detail = "no engine.py at the root"
        if nested:
            detail += (
                f"; found {nested[0]}: archive the folder's contents, not the folder itself "
                "(`fastqwen package DIR` does)"
            )
    report.violation(ENGINE_FILE, "missing-engine", detail)


# --------------------------------------------------------------------------- Python sources


def _module_index(py_files: list[str]) -> dict[str, str | None]:
    """Dotted module name -> the file that defines it (None for a folder without `__init__.py`).

    Precedence follows Python's finder: a package's `__init__.py` over a same-named
    `.py`, which wins over a namespace folder.
    """
    modules: dict[str, str | None] = {}
    plain: dict[str, str] = {}
    inits: dict[str, str] = {}
    for name in py_files:
        parts = name[: -len(".py")].split("/")
        for i in range(1, len(parts)):
            modules.setdefault(".".join(parts[:i]), None)
        if parts[-1] == "__init__":
            if len(parts) > 1:  # a root __init__.py names no module
                inits[".".join(parts[:-1])] = name
        else:
            plain[".".join(parts)] = name
    modules.update(plain)
    modules.update(inits)
    return modules


def _absolute_module(file: str, level: int, module: str | None) -> str | None:
    """What a relative import in `file` means by absolute name, or None when it leaves the folder."""
    package = file[: -len(".py")].split("/")[:-1]
    if level - 1 > len(package):
        return None
    base = package[: len(package) - (level - 1)]
    full = base + (module.split(".") if module else [])
    return ".".join(full) or None


class PythonChecks:
    """Syntax, imports, the Engine class and reachability, over the folder's `.py` texts."""

    def __init__(self, report: Report, texts: dict[str, bytes]) -> None:
        self.report = report
        self.texts = texts
        self.trees: dict[str, ast.Module] = {}
        self.modules: dict[str, str | None] = {}
        self.edges: dict[str, set[str]] = {}

    def run(self) -> None:
        for name, data in sorted(self.texts.items()):
            if not name.endswith(".py"):
                continue
            try:
                self.trees[name] = ast.parse(data, filename=name)
            except SyntaxError as exc:
                self.report.violation(name, "syntax-error", f"line {exc.lineno}: {exc.msg}")
            except ValueError as exc:  # e.g. a source that cannot be decoded
                self.report.violation(name, "syntax-error", str(exc))
        py_files = sorted(n for n in self.texts if n.endswith(".py"))
        self.modules = _module_index(py_files)
        self._warn_shadowing()
        for name, tree in self.trees.items():
            self.edges[name] = self._check_imports(name, tree)
        if ENGINE_FILE in self.trees:
            self._check_engine()
            self._warn_unreachable(py_files)

    # -- imports

    def _local_files(self, module: str) -> set[str]:
        """The files that importing `module` executes: every enclosing package's `__init__.py` and its own."""
        parts = module.split(".")
        found = set()
        for i in range(1, len(parts) + 1):
            file = self.modules.get(".".join(parts[:i]))
            if file is not None:
                found.add(file)
        return found

    def _check_imports(self, file: str, tree: ast.Module) -> set[str]:
        """Report bad imports in `file`; return the folder's files it imports."""
        reached: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    reached |= self._check_module(file, node, alias.name)
            elif isinstance(node, ast.ImportFrom):
                if node.level > 0:
                    absolute = _absolute_module(file, node.level, node.module)
                    hint = f"; import it by absolute name ({absolute})" if absolute else ""
                    self.report.violation(
                        file,
                        "relative-import",
                        f"line {node.lineno}: `{ast.unparse(node)}` fails when engine is imported as a "
                        f"top-level module{hint}",
                    )
                    module = absolute
                else:
                    module = node.module
                if module is None:
                    continue
                if node.level == 0:
                    reached |= self._check_module(file, node, module)
                else:
                    reached |= self._local_files(module)
                for alias in node.names:
                    # `from pkg import sub` may name a submodule, which then runs too.
                    if f"{module}.{alias.name}" in self.modules:
                        reached |= self._local_files(f"{module}.{alias.name}")
        return reached

    def _check_module(self, file: str, node: ast.stmt, module: str) -> set[str]:
        top = module.split(".")[0]
        if top in self.modules:
            if module not in self.modules:
                path = module.replace(".", "/")
                self.report.violation(
                    file,
                    "missing-module",
                    f"line {node.lineno}: imports {module}, but the folder has no {path}.py or {path}/__init__.py",
                )
            return self._local_files(module)
        if top in sys.stdlib_module_names or top in PLATFORM_PACKAGES:
            return set()
        self.report.violation(
            file,
            "disallowed-import",
            f"line {node.lineno}: imports {module}; only the standard library, "
            f"{', '.join(PLATFORM_PACKAGES)} and modules inside the folder exist on the platform",
        )
        return set()

    def _warn_shadowing(self) -> None:
        for module, file in sorted(self.modules.items()):
            if "." in module:
                continue
            if module in sys.stdlib_module_names or module in PLATFORM_PACKAGES:
                self.report.warn(
                    file or module + "/",
                    "shadows-module",
                    f"module {module} has the name of a standard-library or platform module; "
                    "which one an import finds depends on sys.path order",
                )

    def _warn_unreachable(self, py_files: list[str]) -> None:
        reached = {ENGINE_FILE}
        todo = [ENGINE_FILE]
        while todo:
            for target in self.edges.get(todo.pop(), set()):
                if target not in reached:
                    reached.add(target)
                    todo.append(target)
        for name in py_files:
            if name not in reached:
                self.report.warn(
                    name,
                    "unreachable",
                    "nothing imports it from engine.py, directly or indirectly; the folder should hold only "
                    "what the engine imports",
                )

    # -- the Engine class

    def _find_class(self, file: str, name: str, depth: int = 0) -> tuple[str, ast.ClassDef] | None:
        """Follow `name` in `file` to a class statement, through `from module import name` re-exports."""
        tree = self.trees.get(file)
        if tree is None:
            return None  # a syntax error, already reported
        binding: ast.stmt | None = None
        bound_as = name
        for stmt in tree.body:
            if isinstance(stmt, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name == name:
                binding = stmt
            elif isinstance(stmt, (ast.Import, ast.ImportFrom)):
                for alias in stmt.names:
                    if (alias.asname or alias.name.split(".")[0]) == name:
                        binding, bound_as = stmt, alias.name
            elif isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                    binding = stmt
        where = f"{file}" if file == ENGINE_FILE else f"{file} (imported by engine.py as {ENGINE_CLASS})"
        if binding is None:
            self.report.violation(file, "missing-engine-class", f"no top-level class {name} in {where}")
            return None
        if isinstance(binding, ast.ClassDef):
            return file, binding
        if isinstance(binding, ast.ImportFrom) and binding.level == 0 and binding.module is not None:
            source = self.modules.get(binding.module)
            if source is not None and depth < 8:
                return self._find_class(source, bound_as, depth + 1)
            detail = f"line {binding.lineno}: {name} is imported from {binding.module}, not defined in the folder"
        else:
            detail = (
                f"line {binding.lineno}: {name} is bound by `{ast.unparse(binding).splitlines()[0]}`; "
                f"define it with a top-level `class {ENGINE_CLASS}:` (or import it by name from a module of the folder)"
            )
        self.report.violation(file, "missing-engine-class", detail)
        return None

    def _check_engine(self) -> None:
        found = self._find_class(ENGINE_FILE, ENGINE_CLASS)
        if found is None:
            return
        file, cls = found
        for method, expected in ENGINE_METHODS.items():
            func = None
            for stmt in cls.body:
                if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name == method:
                    func = stmt
            want = f"{ENGINE_CLASS}.{method}({', '.join(expected)})"
            if func is None:
                inherited = " (inherited methods cannot be checked)" if cls.bases else ""
                self.report.violation(
                    file,
                    "missing-engine-method",
                    f"line {cls.lineno}: class {cls.name} defines no {method}{inherited}; expected {want}",
                )
                continue
            problem = _signature_problem(func, expected)
            if problem:
                self.report.violation(
                    file,
                    "engine-signature",
                    f"line {func.lineno}: {ENGINE_CLASS}.{method}({ast.unparse(func.args)}) {problem}; "
                    f"expected {want}",
                )


def _signature_problem(func: ast.FunctionDef | ast.AsyncFunctionDef, expected: tuple[str, ...]) -> str | None:
    """Why `func` does not take exactly the positional parameters `expected` (annotations allowed), or
    None. Keyword-only options with defaults are allowed: the platform's call, with the positional
    arguments alone, still binds (Engine(model_path))."""
    if isinstance(func, ast.AsyncFunctionDef):
        return "is async"
    for decorator in func.decorator_list:
        if isinstance(decorator, ast.Name) and decorator.id in ("staticmethod", "classmethod", "property"):
            return f"is a {decorator.id}"
    args = func.args
    if args.posonlyargs:
        return "has positional-only parameters"
    if args.vararg or args.kwarg:
        return "takes *args or **kwargs"
    if any(default is None for default in args.kw_defaults):
        return "has keyword-only parameters without defaults"   # options with defaults: the call still works
    if tuple(a.arg for a in args.args) != expected:
        return "has other parameters"
    if args.defaults:
        return "has default values"
    return None


# --------------------------------------------------------------------------- entry points


def _label(path: Path) -> str:
    return path.name or path.resolve().name or str(path)


def validate_path(path: str | os.PathLike[str]) -> Report:
    """Check a folder or a `.tar.gz`; raises UserError when `path` is neither."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"{path}: no such file or folder")
    if path.is_dir():
        return validate_folder(path)
    if path.is_file() and path.name.endswith(ARCHIVE_SUFFIX):
        return validate_archive(path)
    raise UserError(f"{path}: not a folder or a {ARCHIVE_SUFFIX} archive")


def print_report(report: Report, out: TextIO | None = None) -> None:
    """Violations and warnings, one per line, then the summary line."""
    out = out or sys.stdout
    for line in report.lines():
        print(line, file=out)
    print(report.summary(), file=out)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", metavar="PATH", help=f"an engine folder or a {ARCHIVE_SUFFIX} archive")


def run(args: argparse.Namespace) -> int:
    report = validate_path(args.path)
    print_report(report)
    return 0 if report.ok else 1
