"""Build the noarch variants of the kernel, tag releases and publish them to the Hugging Face kernel hub.

Shared by scripts/build, scripts/release and scripts/publish (each a thin command line over this module);
docs/releasing.md explains the release flow. Only the standard library is needed to build and to tag; publishing
needs huggingface_hub. Python >= 3.11 (tomllib): MIN_PYTHON below, stated in build.toml and README.md.

Build (what kernel-builder's noarch build writes, without nix), one variant per backend of build.toml::

    torch-ext/moe_dispatch/**  --copy, files with a `pyext` extension-->  build/torch-<backend>/
                               + _ops.py        the builder's op namespace: _moe_dispatch_<torch's backend>_<rev>
                               + moe_dispatch/__init__.py  the package under its own name, for kernels < 0.11.1
                               + _version.py    __version__ (the builder leaves the source's; see build_version)
                               + metadata.json  name, id, version, kernels-minver, license, source, python-depends,
                                                kernel-depends, backend {type, archs}, digest, provenance

    rev = first 7 hex digits of HEAD, `_dirty` appended when tracked files have changes; id = _moe_dispatch_<backend>_<rev>

Version of a tree and of its builds (recorded_version, build_version): _version.py holds the tree's own version,
what a checkout's `import moe_dispatch` reports, and every build of the tree reports the same, git tags only confirming
a release::

    _version.py X.Y.Z.dev0, CHANGELOG.md's [X.Y.Z] unreleased  -> a tree preparing X.Y.Z (every commit but a release's)
        any HEAD                                    -> X.Y.Z.dev0+g<rev7>[.dirty]
    _version.py X.Y.Z, CHANGELOG.md's [X.Y.Z] dated -> the release commit of X.Y.Z
        clean, HEAD tagged vX.Y.Z                   -> X.Y.Z
        anything else (a clone without tags too)    -> X.Y.Z+g<rev7>[.dirty]

Release (scripts/release X.Y.Z, on a tree preparing X.Y.Z)::

    checks -> _version.py = X.Y.Z and CHANGELOG.md's [X.Y.Z] dated -> commit "Release vX.Y.Z" -> branch v<major> at it
    -> annotated tag vX.Y.Z -> on the branch released from, a commit opening X.Y.(Z+1): `## [X.Y.(Z+1)] - unreleased`
    and _version.py X.Y.(Z+1).dev0. Pushing the tag runs .github/workflows/publish.yml (scripts/publish --build --tag
    vX.Y.Z on the tagged commit)

Publish (tag vX.Y.Z -> Hub)::

    checks (nothing is sent when one fails): tag format, tag major == build.toml version, git tag on HEAD,
    the tree records the tag's release (_version.py, CHANGELOG.md's date), clean tree, build/ fresh for HEAD and its
    __version__ the tag's, HF_TOKEN set, huggingface_hub able to commit
    create_repo(kernel) -> README card on main -> branch v<major> -> commit build/<variant>/** and benchmarks/*.py
    (+ deletions) -> Hub tag named like the git tag on that commit
"""

from __future__ import annotations

import sys

MIN_PYTHON = (3, 11)  # tomllib; the oldest Python the tooling and the tests run on (CI uses it)
if sys.version_info < MIN_PYTHON:
    sys.exit(f"moe-dispatch's scripts need Python >= {'.'.join(map(str, MIN_PYTHON))} (tomllib); this is "
             f"{sys.version.split()[0]} ({sys.executable}). Use the project's venv: bash scripts/setup-env")

import argparse  # noqa: E402
import ast  # noqa: E402
import base64  # noqa: E402
import datetime  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import tomllib  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

# build.toml [torch-noarch] key holding each backend's archs; kernel-builder writes archs for these two only.
ARCHS_KEY = {"cuda": "cuda_capabilities", "rocm": "rocm_archs"}
# Backends kernel-builder's noarch build knows (kernels' backend types); each gets build/torch-<backend>.
NOARCH_BACKENDS = ("cann", "cpu", "cuda", "metal", "neuron", "rocm", "tpu", "xpu")
# The `kernels` version kernel-builder writes as `kernels-minver` for a build without kernel dependencies: the
# first that loads this metadata format (kernels-data's baseline).
KERNELS_MINVER = "0.14.0"
# What provenance.kernel-builder.version says: these builds come from this script, not from kernel-builder.
BUILDER_NAME = "moe-dispatch scripts/build (kernel-builder noarch layout)"
BUILDER_FILES = ("scripts/_hub_release.py", "scripts/build")  # the builder's own source, for its dirty flag
GENERATED_FILES = ("_ops.py", "_version.py", "metadata.json")
VERSION_FILE = "_version.py"
SKIPPED_DIRS = {"__pycache__"}
SKIPPED_SUFFIXES = (".pyc", ".pyo")
TAG_PATTERN = re.compile(r"v(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)")
# A release, X.Y.Z: CHANGELOG.md's entries, tags without their `v`.
RELEASE_PATTERN = re.compile(r"(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)")
# The version a source _version.py holds: X.Y.Z in the release commit of X.Y.Z (scripts/release writes it), X.Y.Z.dev0
# on every other commit, X.Y.Z being the release CHANGELOG.md prepares (its `unreleased` entry).
SOURCE_VERSION_PATTERN = re.compile(rf"(?P<release>{RELEASE_PATTERN.pattern})(?P<dev>\.dev0)?")
# The heading of a CHANGELOG.md section that adds to the API: its entry must be a minor (or major) release.
ADDED_SECTION = re.compile(r"^### Added[ \t]*$", re.M)
# A CHANGELOG.md heading: `## [X.Y.Z]`, then ` - <date>` once released (scripts/release writes the date) or
# ` - unreleased`.
CHANGELOG_HEADING = re.compile(r"^## \[(?P<version>[^\]]+)\](?: - (?P<date>\S+))?[ \t]*$", re.M)
RELEASE_DATE = re.compile(r"\d{4}-\d\d-\d\d")
CARD_PATH = "README.md"
CHANGELOG = "CHANGELOG.md"
BENCHMARKS_DIR = "benchmarks"  # the Hub's benchmark convention: committed beside build/ on the release branch
# huggingface_hub 1.x and 2.0 refuse repo_type="kernel" in create_commit; 2.4.0 (requirements.txt) is the one tested.
MIN_HUB_CLIENT = (2, 4)


class ReleaseError(Exception):
    """A build or release precondition does not hold; the message says which and what to do."""


@dataclass(frozen=True)
class Project:
    """What build.toml says about the kernel, plus where its sources are."""

    root: Path
    name: str  # kernel name, e.g. "moe-dispatch"
    version: int  # API major; Hub branch v<version>
    license: str
    backends: tuple[str, ...]
    repo_id: str | None
    source: str | None  # [general] source: the kernel-builder formatted source repository
    archs: dict[str, tuple[str, ...]]  # backend -> archs written into its metadata (cuda, rocm)
    pyext: tuple[str, ...]
    python_depends: tuple[str, ...]

    @property
    def module(self) -> str:
        return self.name.replace("-", "_")

    @property
    def source_dir(self) -> Path:
        return self.root / "torch-ext" / self.module

    @property
    def variants(self) -> list[str]:
        return [f"torch-{backend}" for backend in sorted(self.backends)]


def variant_backend(variant: str) -> str:
    return variant.removeprefix("torch-")


def load_project(root: Path) -> Project:
    """Read build.toml under `root`."""
    with open(root / "build.toml", "rb") as f:
        config = tomllib.load(f)
    general = config["general"]
    noarch = config.get("torch-noarch")
    if noarch is None:
        raise ReleaseError("build.toml has no [torch-noarch] section: scripts/build only reproduces noarch builds")
    unknown = [b for b in general["backends"] if b not in NOARCH_BACKENDS]
    if unknown:
        raise ReleaseError(f"build.toml backends {unknown} are not kernel backends ({', '.join(NOARCH_BACKENDS)})")
    return Project(
        root=root,
        name=general["name"],
        version=int(general["version"]),
        license=general["license"],
        backends=tuple(general["backends"]),
        repo_id=general.get("hub", {}).get("repo-id"),
        source=general.get("source"),
        archs={backend: tuple(noarch.get(key, ())) for backend, key in ARCHS_KEY.items()},
        pyext=tuple(noarch.get("pyext", ("py", "pyi"))),
        python_depends=tuple(general.get("python-depends", ())),
    )


def git(root: Path, *args: str) -> str:
    try:
        result = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True)
    except FileNotFoundError:
        raise ReleaseError("git is not installed") from None
    if result.returncode != 0:
        raise ReleaseError(f"`git {' '.join(args)}` failed: {result.stderr.strip()}")
    return result.stdout.strip()


def head_commit(root: Path) -> str:
    return git(root, "rev-parse", "HEAD")


def dirty_paths(root: Path) -> list[str]:
    """Tracked files with changes and untracked files that are not ignored (`git status --porcelain`): what
    scripts/release and scripts/publish refuse."""
    return [line for line in git(root, "status", "--porcelain").splitlines() if line.strip()]


def tracked_changes(root: Path, *paths: str) -> bool:
    """Whether tracked files (under `paths`, or anywhere) differ from HEAD. kernel-builder marks a build dirty this
    way (untracked files do not count)."""
    return bool(git(root, "status", "--porcelain", "--untracked-files=no", "--", *paths).strip())


@dataclass(frozen=True)
class Revision:
    """The source a build is made from."""

    commit: str  # full hex id of HEAD; outside git MOE_DISPATCH_COMMIT or a hash of the package's files
    dirty: bool  # tracked files differ from `commit` (always True outside git: nothing shows they match)
    in_git: bool
    builder_dirty: bool  # scripts/_hub_release.py or scripts/build differ from `commit`
    tags_on_head: tuple[str, ...] = ()  # confirm a release build (build_version); a clone may have none

    @property
    def rev(self) -> str:
        """The unique id of the build (kernel-builder's `--unique-id`, nix's shortRev / dirtyShortRev)."""
        return f"{self.commit[:7]}{'_dirty' if self.dirty else ''}"


def source_revision(project: Project) -> Revision:
    """The revision the build is made from.

    Outside a git checkout (e.g. a copy of the tree on a GPU machine) the commit is MOE_DISPATCH_COMMIT when set,
    else a hash of the package's files, and the build counts as dirty: nothing shows it matches a commit."""
    root = project.root
    try:
        commit = head_commit(root)
    except ReleaseError as e:
        commit = os.environ.get("MOE_DISPATCH_COMMIT", "")
        if not re.fullmatch(r"[0-9a-f]{7,40}", commit):
            digest = hashlib.sha256()
            for rel in source_files(project):
                digest.update(rel.encode() + b"\0" + (project.source_dir / rel).read_bytes())
            commit = digest.hexdigest()
        print(f"warning: no git revision ({e}); the build id uses {commit[:7]} and is marked _dirty", file=sys.stderr)
        return Revision(commit=commit, dirty=True, in_git=False, builder_dirty=True)
    return Revision(
        commit=commit,
        dirty=tracked_changes(root),
        in_git=True,
        builder_dirty=tracked_changes(root, *BUILDER_FILES),
        tags_on_head=tuple(git(root, "tag", "--points-at", "HEAD").split()),
    )


def build_id(project: Project, variant: str, revision: Revision) -> str:
    return f"_{project.module}_{variant_backend(variant)}_{revision.rev}"


def source_files(project: Project) -> list[str]:
    """Relative paths of the package files a variant ships, sorted; refuses files `pyext` would drop."""
    if not (project.source_dir / "__init__.py").is_file():
        raise ReleaseError(f"{project.source_dir.relative_to(project.root)}/__init__.py is missing")
    if (project.source_dir / project.module).exists():
        raise ReleaseError(f"torch-ext/{project.module}/{project.module} exists: each variant's {project.module}/ is "
                           "the generated compatibility package (kernel-builder refuses this layout too)")
    shipped, dropped = [], []
    for path in sorted(project.source_dir.rglob("*")):
        rel = path.relative_to(project.source_dir)
        if path.is_dir() or SKIPPED_DIRS.intersection(rel.parts) or path.name.endswith(SKIPPED_SUFFIXES):
            continue
        if rel.as_posix() in GENERATED_FILES:
            continue  # regenerated for every build
        (shipped if path.suffix.lstrip(".") in project.pyext else dropped).append(rel.as_posix())
    if dropped:
        raise ReleaseError(
            f"files in torch-ext/{project.module} with an extension not in build.toml's pyext {list(project.pyext)} "
            f"would be left out of the build (the nix builder drops them too): {dropped}"
        )
    return shipped


def render_ops_py(module: str, rev: str) -> str:
    return f'''"""Torch op namespace of this build; generated by scripts/build in kernel-builder's noarch form, do not edit.

The namespace is `_{module}_<backend>_{rev}`: <backend> is the one torch was built for, read when this module is
imported, so it equals the `id` of the variant the loader picks on this machine (metadata.json). Every build has its
own, so several builds of the kernel loaded into one process (e.g. two pinned revisions) never share an operator.
"""

import torch


def _torch_backend() -> str:
    """The backend torch was built for, in the names of kernel variants."""
    if hasattr(torch.backends, "tpu"):
        return "tpu"
    if hasattr(torch, "neuron"):
        return "neuron"
    if torch.version.cuda is not None:
        return "cuda"
    if torch.version.hip is not None:
        return "rocm"
    if torch.backends.mps.is_available():
        return "metal"
    if getattr(torch.version, "xpu", None) is not None:
        return "xpu"
    return "cpu"


NAMESPACE = f"_{module}_{{_torch_backend()}}_{rev}"

ops = getattr(torch.ops, NAMESPACE)


def add_op_namespace_prefix(op_name: str) -> str:
    """Qualify `op_name` with this build's namespace (for `torch.library.custom_op` / `triton_op` names)."""
    return f"{{NAMESPACE}}::{{op_name}}"
'''


def render_compat_init(module: str) -> str:
    return f'''"""`{module}` under its own name: kernels clients older than 0.11.1 import build/<variant>/{module}/ instead of
build/<variant>/. Generated by scripts/build (kernel-builder's compatibility folder), do not edit.

Loads the variant's package (the folder above) under a name unique to its path and re-exports its names.
"""

import hashlib
import importlib.util
import sys
from pathlib import Path


def _variant_package():
    init = Path(__file__).resolve().parent.parent / "__init__.py"
    name = "_{module}_" + hashlib.sha256(str(init).encode()).hexdigest()[:16]
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, init)
        package = importlib.util.module_from_spec(spec)
        sys.modules[name] = package
        spec.loader.exec_module(package)
    return sys.modules[name]


_package = _variant_package()
globals().update({{key: value for key, value in vars(_package).items() if not key.startswith("__")}})
__all__ = list(getattr(_package, "__all__", ()))
__version__ = getattr(_package, "__version__", None)
__doc__ = _package.__doc__
'''


def source_version(project: Project) -> str:
    """`__version__` of torch-ext/<module>/_version.py, read without importing: "X.Y.Z" (a release commit) or
    "X.Y.Z.dev0" (a tree preparing X.Y.Z). Refuses any other form, or another API major than build.toml's."""
    path = project.source_dir / VERSION_FILE
    tree = ast.parse(path.read_text())
    values = [node.value.value for node in tree.body if isinstance(node, ast.Assign)
              and any(getattr(t, "id", None) == "__version__" for t in node.targets)
              and isinstance(node.value, ast.Constant)]
    if len(values) != 1 or not isinstance(values[0], str):
        raise ReleaseError(f"{path.relative_to(project.root)} must assign __version__ = \"X.Y.Z.dev0\" (or, in a "
                           "release commit, \"X.Y.Z\") once")
    version = values[0]
    match = SOURCE_VERSION_PATTERN.fullmatch(version)
    if match is None:
        raise ReleaseError(f"{path.relative_to(project.root)} says __version__ = {version!r}: not X.Y.Z.dev0 (a tree "
                           "preparing release X.Y.Z) nor X.Y.Z (its release commit); scripts/build adds the commit")
    if int(match.group(2)) != project.version:
        raise ReleaseError(f"{path.relative_to(project.root)} says {version} but build.toml has version = "
                           f"{project.version} (the API major): they must agree")
    return version


def _release_key(version: str) -> tuple[int, int, int]:
    return tuple(int(part) for part in RELEASE_PATTERN.fullmatch(version).groups())  # type: ignore[return-value]


def changelog_entries(text: str) -> dict[str, str | None]:
    """CHANGELOG.md's release entries: X.Y.Z -> its date (YYYY-MM-DD), or None while it says `unreleased`."""
    entries = {}
    for heading in CHANGELOG_HEADING.finditer(text):
        if RELEASE_PATTERN.fullmatch(heading["version"]):
            date = heading["date"]
            entries[heading["version"]] = date if date and RELEASE_DATE.fullmatch(date) else None
    return entries


def changelog_section(text: str, version: str) -> str:
    """The text of CHANGELOG.md's `## [version]` entry below its heading, up to the next entry's heading."""
    heading = _changelog_section(text, version)
    if heading is None:
        return ""
    following = CHANGELOG_HEADING.search(text, heading.end())
    return text[heading.end():following.start() if following else len(text)]


def _next_patch(version: str) -> str:
    major, minor, patch = _release_key(version)
    return f"{major}.{minor}.{patch + 1}"


def recorded_version(project: Project) -> tuple[str, bool]:
    """The tree's version, from its records alone (no git tag needed): (X.Y.Z, released).

    _version.py says "X.Y.Z.dev0" on a tree preparing release X.Y.Z, whose CHANGELOG.md entry says `unreleased`
    (released False), and "X.Y.Z" in the release commit of X.Y.Z, whose entry scripts/release dates (released True).
    Without CHANGELOG.md (a copy of the package alone) _version.py is taken as it is. Refuses records that disagree:
    no entry for X.Y.Z; a release X.Y.Z whose entry is undated, below the newest dated one, or under an `unreleased`
    entry; a development X.Y.Z whose entry is dated, not above the newest release, or beside another `unreleased`
    one; an entry that adds to the API (`### Added`) named as a patch release."""
    source = source_version(project)
    match = SOURCE_VERSION_PATTERN.fullmatch(source)
    version, released = match["release"], match["dev"] is None
    path = project.root / CHANGELOG
    if not path.is_file():
        return version, released
    text = path.read_text()
    entries = changelog_entries(text)
    name = f"torch-ext/{project.module}/{VERSION_FILE}"
    if version not in entries:
        raise ReleaseError(f"{name} says {source} but {CHANGELOG} has no `## [{version}]` entry: the two record the "
                           "tree's version together")
    dated = [v for v, date in entries.items() if date is not None]
    newest = max(dated, key=_release_key) if dated else None
    prepared = [v for v, date in entries.items() if date is None]
    if released:
        if entries[version] is None:
            raise ReleaseError(f"{name} says {source}, a release, but {CHANGELOG}'s entry says unreleased: until "
                               f"scripts/release {version} dates it, the tree says __version__ = \"{version}.dev0\"")
        if newest != version:
            raise ReleaseError(f"{name} says {source} but {CHANGELOG} dates the later release {newest} "
                               f"({entries[newest]}): the tree is past it; set __version__ = \"{newest}\" (its "
                               "release commit) or prepare the next one")
        if prepared:
            raise ReleaseError(f"{CHANGELOG} prepares {prepared[0]} (`## [{prepared[0]}] - unreleased`) but {name} "
                               f"says {source}, the release before it: set __version__ = \"{prepared[0]}.dev0\"")
        return version, True
    if entries[version] is not None:
        raise ReleaseError(f"{name} says {source} but {CHANGELOG} dates {version} ({entries[version]}): it is "
                           "released; prepare the next one (`## [X.Y.Z] - unreleased` and __version__ = "
                           "\"X.Y.Z.dev0\")")
    if newest is not None and _release_key(version) <= _release_key(newest):
        raise ReleaseError(f"{name} says {source} but {CHANGELOG} dates the release {newest} ({entries[newest]}): "
                           f"the release being prepared must come after it, {_next_patch(newest)} or later")
    if len(prepared) > 1:
        raise ReleaseError(f"{CHANGELOG} has several `unreleased` entries ({', '.join(prepared)}): one release is "
                           "prepared at a time")
    if newest is not None and ADDED_SECTION.search(changelog_section(text, version)):
        major, minor, _ = _release_key(newest)
        if _release_key(version)[:2] == (major, minor):
            raise ReleaseError(f"{CHANGELOG}'s [{version}] entry adds to the API (### Added): the release after "
                               f"{newest} is then {major}.{minor + 1}.0; rename the entry and set __version__ = "
                               f"\"{major}.{minor + 1}.0.dev0\"")
    return version, False


def build_version(project: Project, revision: Revision, log=None) -> str:
    """The package's `__version__` in a build (PEP 440): the tree's own (recorded_version), with the commit as a
    local label unless the build is the tagged release.

    - A tree preparing X.Y.Z (_version.py "X.Y.Z.dev0"): "X.Y.Z.dev0+g<rev>[.dirty]", tagged or not.
    - The release commit of X.Y.Z (_version.py "X.Y.Z"): "X.Y.Z" when the tree is clean and HEAD carries the tag
      vX.Y.Z; otherwise "X.Y.Z+g<rev>[.dirty]" (a clone without tags, or local changes).

    So a build's public version (PEP 440, before the `+`) is always the checkout's `__version__`. Tags only confirm:
    a release tag on HEAD that the records do not back (another version, or a tree preparing it) changes nothing and is
    reported through `log` as a warning; scripts/publish refuses that tag."""
    version, released = recorded_version(project)
    source = version if released else f"{version}.dev0"
    local = f"+g{revision.commit[:7]}{'.dirty' if revision.dirty else ''}"
    tag = f"v{version}"
    unbacked = sorted(t for t in revision.tags_on_head if TAG_PATTERN.fullmatch(t) and (t != tag or not released))
    for other in unbacked if log is not None else ():
        record = (f"{CHANGELOG} does not date {version}" if other == tag
                  else f"the tree says {source} ({VERSION_FILE})")
        log(f"warning: HEAD carries the tag {other} but {record}: the tag is ignored (this is a development build) "
            "and scripts/publish refuses it here")
    if released and not revision.dirty and tag in revision.tags_on_head:
        return version
    return f"{source}{local}"


def render_version_py(version: str) -> str:
    return f'''"""Version of this build, written by scripts/build: a release's X.Y.Z, else the tree's version with the commit
(X.Y.Z.dev0+g<commit>); do not edit."""

__version__ = "{version}"
'''


VERSION_LINE = re.compile(r'^__version__ = "[^"\n]*"$', re.MULTILINE)


def set_source_version(version_file: Path, version: str) -> None:
    """Sets `__version__` in the tree's _version.py, the one line: the rule of versions its docstring states stays that
    file's own. ReleaseError unless the file holds exactly one such line."""
    text, count = VERSION_LINE.subn(f'__version__ = "{version}"', version_file.read_text())
    if count != 1:
        raise ReleaseError(f"{version_file}: expected one line `__version__ = \"...\"`, found {count}")
    version_file.write_text(text)


def file_digest(files: dict[str, bytes]) -> dict:
    """kernel-builder's `digest` of a variant: sha256 of every file but metadata.json, base64, by relative path."""
    return {
        "algorithm": "sha256",
        "files": {rel: base64.b64encode(hashlib.sha256(content).digest()).decode() for rel, content in
                  sorted(files.items())},
    }


def render_metadata(project: Project, variant: str, revision: Revision, files: dict[str, bytes]) -> str:
    """metadata.json as kernel-builder writes it for a noarch variant, `digest` (its hash step) and `provenance`
    (its git state, and this builder's) included."""
    backend_type = variant_backend(variant)
    backend: dict = {"type": backend_type}
    if project.archs.get(backend_type):
        backend["archs"] = list(project.archs[backend_type])
    builder: dict = {"version": BUILDER_NAME}
    provenance: dict = {"kernel-builder": builder}
    if revision.in_git:
        builder.update(commit=revision.commit, dirty=revision.builder_dirty)
        provenance["kernel"] = {"commit": revision.commit, "dirty": revision.dirty}
    metadata = {
        "name": project.name,
        "id": build_id(project, variant, revision),
        "version": project.version,
        "kernels-minver": KERNELS_MINVER,
        "license": project.license,
        **({"source": project.source} if project.source else {}),
        "python-depends": list(project.python_depends),
        "kernel-depends": [],
        "backend": backend,
        "digest": file_digest(files),
        "provenance": provenance,
    }
    return json.dumps(metadata, indent=2) + "\n"


def expected_variant_files(project: Project, variant: str, revision: Revision, version: str) -> dict[str, bytes]:
    """Every file of build/<variant>/ as the build writes it: relative path -> content."""
    files = {rel: (project.source_dir / rel).read_bytes() for rel in source_files(project)}
    files["_ops.py"] = render_ops_py(project.module, revision.rev).encode()
    files[VERSION_FILE] = render_version_py(version).encode()
    files[f"{project.module}/__init__.py"] = render_compat_init(project.module).encode()
    files["metadata.json"] = render_metadata(project, variant, revision, files).encode()
    return files


def build(root: Path, out: Path | None = None, log=print) -> list[Path]:
    """Write build/torch-<backend>/ for every backend into `out` (default: <root>/build). Returns the variant dirs."""
    project = load_project(root)
    out = out if out is not None else root / "build"
    revision = source_revision(project)
    version = build_version(project, revision, log=log)
    written = []
    for variant in project.variants:
        variant_dir = out / variant
        if variant_dir.exists():
            shutil.rmtree(variant_dir)
        for rel, content in expected_variant_files(project, variant, revision, version).items():
            (variant_dir / rel).parent.mkdir(parents=True, exist_ok=True)
            (variant_dir / rel).write_bytes(content)
        log(f"built {variant_dir} ({build_id(project, variant, revision)}, version {version})")
        written.append(variant_dir)
    if revision.dirty:
        log("warning: the build ids end in _dirty and provenance says dirty (uncommitted changes, or no git "
            "revision): kernels warns when it loads them, and scripts/publish refuses them")
    return written


def benchmark_files(project: Project) -> dict[str, bytes]:
    """benchmarks/*.py of the source tree, by their path in the Hub repo: `kernels benchmark <repo>@v<major>` runs the
    benchmark*.py files of that folder on the branch (the others are the modules they load)."""
    folder = project.root / BENCHMARKS_DIR
    return {f"{BENCHMARKS_DIR}/{path.name}": path.read_bytes() for path in sorted(folder.glob("*.py"))}


def variant_tree(variant_dir: Path) -> dict[str, bytes]:
    return {
        path.relative_to(variant_dir).as_posix(): path.read_bytes()
        for path in sorted(variant_dir.rglob("*"))
        if path.is_file()
        and not SKIPPED_DIRS.intersection(path.relative_to(variant_dir).parts)
        and not path.name.endswith(SKIPPED_SUFFIXES)
    }


def check_build_fresh(project: Project, build_dir: Path, revision: Revision, version: str) -> dict[str, dict[str, bytes]]:
    """Check that build_dir holds exactly what scripts/build writes for `revision` (a clean tree), as `version`.

    Returns variant -> {relative path -> content} of the files to upload; raises ReleaseError when stale."""
    if not build_dir.is_dir():
        raise ReleaseError(f"{build_dir} does not exist: run scripts/build first")
    present = sorted(p.name for p in build_dir.iterdir() if p.is_dir())
    extra = sorted(set(present) - set(project.variants))
    if extra:
        raise ReleaseError(
            f"{build_dir} holds variants this build.toml does not produce: {extra}; rebuild into a clean dir"
        )
    trees = {}
    for variant in project.variants:
        variant_dir = build_dir / variant
        if not (variant_dir / "metadata.json").is_file():
            raise ReleaseError(f"{variant_dir}/metadata.json is missing: run scripts/build")
        built_id = json.loads((variant_dir / "metadata.json").read_text())["id"]
        want_id = build_id(project, variant, revision)
        if built_id != want_id:
            raise ReleaseError(
                f"build is stale: {variant} has id {built_id}, HEAD {revision.commit[:7]} on a clean tree needs "
                f"{want_id}; rerun scripts/build"
            )
        want = expected_variant_files(project, variant, revision, version)
        have = variant_tree(variant_dir)
        differ = sorted(
            set(want).symmetric_difference(have) | {rel for rel in set(want) & set(have) if want[rel] != have[rel]}
        )
        if differ:
            raise ReleaseError(
                f"build is stale: {variant} differs from torch-ext/{project.module} in {differ}; rerun scripts/build"
            )
        trees[variant] = have
    return trees


def parse_release_tag(tag: str) -> tuple[int, int, int]:
    match = TAG_PATTERN.fullmatch(tag)
    if match is None:
        raise ReleaseError(f"tag {tag!r} is not of the form v<major>.<minor>.<patch> (e.g. v1.2.0)")
    return tuple(int(part) for part in match.groups())  # type: ignore[return-value]


def current_git_tag(root: Path) -> str:
    try:
        return git(root, "describe", "--exact-match", "--tags", "HEAD")
    except ReleaseError as e:
        raise ReleaseError(f"HEAD carries no git tag; tag it (scripts/release X.Y.Z) or pass --tag ({e})") from None


# -- scripts/release ---------------------------------------------------------------------------------------------------

def _changelog_section(text: str, version: str) -> re.Match | None:
    """The `## [X.Y.Z] - <date or "unreleased">` heading of CHANGELOG.md for `version`."""
    return re.search(rf"^## \[{re.escape(version)}\](?: - (?P<date>\S+))?[ \t]*$", text, re.M)


def release(root: Path, version: str, *, today: str | None = None, log=print) -> str:
    """Tag release `version` (X.Y.Z) of a tree preparing it: date CHANGELOG.md's entry and set _version.py to X.Y.Z,
    commit "Release vX.Y.Z", move branch v<major> to that commit and create the annotated tag vX.Y.Z there; then, on
    the branch released from, commit the opening of X.Y.(Z+1) (`## [X.Y.(Z+1)] - unreleased` above the release's entry,
    _version.py X.Y.(Z+1).dev0), so that no later commit says it is the release. Returns the tagged commit. Sends
    nothing anywhere.

    Refuses (changing nothing) when: `version` is not X.Y.Z or its major is not build.toml's `version`; the tree is
    dirty; tag vX.Y.Z exists; a release tag of the same major is not older; CHANGELOG.md has no `## [X.Y.Z]` entry;
    the tree's records (recorded_version) disagree, record X.Y.Z or a later release as made already (a clone without
    tags included), or prepare another version; branch v<major> exists and is not an ancestor of HEAD (the release
    would rewrite its history)."""
    project = load_project(root)
    tag = f"v{version}"
    parsed = parse_release_tag(tag)
    if parsed[0] != project.version:
        raise ReleaseError(f"{version} has major {parsed[0]} but build.toml has version = {project.version}; "
                           f"a v{parsed[0]} release starts with `version = {parsed[0]}` in build.toml")
    dirty = dirty_paths(root)
    if dirty:
        raise ReleaseError(f"the git tree is dirty ({len(dirty)} path(s), e.g. {dirty[0].strip()}); commit or stash")
    tags = git(root, "tag", "--list").split()
    if tag in tags:
        raise ReleaseError(f"tag {tag} exists already (on {git(root, 'rev-parse', '--short', tag + '^{commit}')})")
    newer = sorted(t for t in tags if TAG_PATTERN.fullmatch(t) and parse_release_tag(t)[0] == parsed[0]
                   and parse_release_tag(t) > parsed)
    if newer:
        raise ReleaseError(f"release tags newer than {tag} exist ({', '.join(newer)}); releases only go forward")
    changelog = root / CHANGELOG
    text = changelog.read_text() if changelog.is_file() else ""
    entry = _changelog_section(text, version)
    if entry is None:
        raise ReleaseError(f"{CHANGELOG} has no entry for {version}: add a `## [{version}] - unreleased` section "
                           "saying what changed, commit it, and run this again")
    recorded, released = recorded_version(project)
    records = f"torch-ext/{project.module}/{VERSION_FILE}, {CHANGELOG}"
    if released or _release_key(version) < _release_key(recorded):
        state = "records release" if released else "prepares"
        raise ReleaseError(f"the tree {state} {recorded} ({records}): {version} is not after it; releases only go "
                           "forward")
    if version != recorded:
        raise ReleaseError(f"the tree prepares {recorded} ({records}), not {version}: release {recorded}, or rename "
                           f"its entry to [{version}] and set __version__ = \"{version}.dev0\" first")
    branch = f"v{project.version}"
    branches = git(root, "branch", "--list", "--format=%(refname:short)").split()
    if branch in branches:
        merge_base = subprocess.run(["git", "-C", str(root), "merge-base", "--is-ancestor", branch, "HEAD"])
        if merge_base.returncode != 0:
            raise ReleaseError(f"branch {branch} is not an ancestor of HEAD: releasing here would rewrite its history; "
                               f"release from a commit that contains {branch}")

    today = today or datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    text = text[:entry.start()] + f"## [{version}] - {today}" + text[entry.end():]
    changelog.write_text(text)
    version_file = project.source_dir / VERSION_FILE
    version_rel = str(version_file.relative_to(root))
    set_source_version(version_file, version)
    git(root, "add", "--", CHANGELOG, version_rel)
    git(root, "commit", "-q", "-m", f"Release {tag}", "--", CHANGELOG, version_rel)
    log(f"committed {CHANGELOG} ({version} dated {today}) and {version_rel} ({version})")
    commit = head_commit(root)
    current = git(root, "rev-parse", "--abbrev-ref", "HEAD")
    if current != branch:
        git(root, "branch", "-f", branch, commit)
    log(f"branch {branch} -> {commit[:7]}")
    git(root, "tag", "-a", tag, "-m", f"Release {tag}", commit)
    log(f"tagged {tag} -> {commit[:7]}")
    if current in (branch, "HEAD"):  # branch v<major> (or no branch): its tip stays the release
        log(f"HEAD is {'branch ' + branch if current == branch else 'detached'}: it stays the release commit; "
            f"open {_next_patch(version)}.dev0 on your development branch")
    else:
        opened = _next_patch(version)
        heading = _changelog_section(text, version)
        changelog.write_text(text[:heading.start()] + f"## [{opened}] - unreleased\n\n" + text[heading.start():])
        set_source_version(version_file, f"{opened}.dev0")
        git(root, "commit", "-q", "-m", f"Open {opened}.dev0 after {tag}", "--", CHANGELOG, version_rel)
        log(f"{current} -> {head_commit(root)[:7]}: opened {opened}.dev0 (`## [{opened}] - unreleased`; a release "
            f"adding to the API renames it {parsed[0]}.{parsed[1] + 1}.0)")
    log(f"next: `git push origin {branch} {tag}` (the tag runs .github/workflows/publish.yml on the tagged commit) "
        f"and push {current}; or publish by hand from a checkout of the tag: `git checkout {tag}` then "
        f"HF_TOKEN=... .venv/bin/python scripts/publish --build --tag {tag}")
    return commit


# -- the Hub card ------------------------------------------------------------------------------------------------------

def _first_paragraph(node: ast.AST) -> str:
    doc = (ast.get_docstring(node) or "").strip()
    return " ".join(line.strip() for line in doc.split("\n\n")[0].splitlines())


def public_api(project: Project) -> tuple[str, list[tuple[str, str]]]:
    """Package docstring and [(name, first docstring paragraph)] for each name of `__all__`, read without importing."""
    init = ast.parse((project.source_dir / "__init__.py").read_text())
    names: list[str] = []
    origin: dict[str, str] = {}  # imported name -> module file it comes from
    for node in init.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            names = [elt.value for elt in node.value.elts if isinstance(elt, ast.Constant)]
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
            for alias in node.names:
                origin[alias.asname or alias.name] = node.module
    summaries = []
    for name in names:
        summary = ""
        module_file = project.source_dir / (origin.get(name, "").replace(".", "/") + ".py")
        if name in origin and module_file.is_file():
            for node in ast.parse(module_file.read_text()).body:
                if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == name:
                    summary = _first_paragraph(node)
        summaries.append((name, summary))
    return ast.get_docstring(init) or "", summaries


def public_layers(project: Project) -> list[str]:
    """The classes of integrations/layers.py when `__all__` exports `layers` (the builder's card lists them as its
    layers)."""
    _, api = public_api(project)
    layers = project.source_dir / "integrations" / "layers.py"
    if "layers" not in {name for name, _ in api} or not layers.is_file():
        return []
    return [node.name for node in ast.parse(layers.read_text()).body if isinstance(node, ast.ClassDef)]


def _doc_summaries(root: Path) -> list[tuple[str, str, str]]:
    """[(file name, title, first paragraph)] of docs/*.md, for the card's documentation section."""
    docs = []
    for path in sorted((root / "docs").glob("*.md")):
        lines = path.read_text().splitlines()
        title = next((line.lstrip("# ").strip() for line in lines if line.startswith("#")), path.stem)
        body, paragraph = [line for line in lines if not line.startswith("#")], []
        for line in body:
            if not line.strip():
                if paragraph:
                    break
                continue
            paragraph.append(line.strip())
        docs.append((path.name, title, " ".join(paragraph)))
    return docs


def _readme_section(root: Path, title: str) -> list[str]:
    """The lines of README.md's `## <title>` section (without the heading), or [] when there is none."""
    readme = root / "README.md"
    if not readme.is_file():
        return []
    lines = readme.read_text().splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip() == f"## {title}"), None)
    if start is None:
        return []
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    return [line for line in lines[start + 1:end]]


def render_card(project: Project, repo_id: str, tag: str | None = None) -> str:
    """The Hub README: the builder's card fields (library_name, license, usage, functions, layers, benchmarks,
    source), plus the versioned API's summaries, variants, supported hardware and docs, from the sources."""
    package_doc, api = public_api(project)
    summary = package_doc.strip().splitlines()[0] if package_doc.strip() else project.name
    pin = tag or f"v{project.version}.0.0"
    lines = [
        "---",
        "library_name: kernels",
        f"license: {project.license.lower()}",
        "tags:",
        "- kernels",
        "---",
        "",
        f"# {project.name}",
        "",
        summary,
        "",
        f"This is the repository card of {repo_id} on the Hub, for the [`kernels` library]"
        "(https://github.com/huggingface/kernels). It is generated by `scripts/publish` from the package's "
        "`__all__`, build.toml, README.md and docs/.",
        "",
        "## How to use",
        "",
        "```python",
        "# pip install -U kernels",
        "from kernels import get_kernel",
        "",
        f'{project.module} = get_kernel("{repo_id}", version={project.version}, trust_remote_code=True)',
        "```",
        "",
        f"`version={project.version}` loads the newest release of API v{project.version} (branch "
        f"`v{project.version}`). Pin a release with `revision=\"{pin}\"` (each release has a tag), "
        "or lock the commit with `kernels lock` and `load_kernel(..., lockfile=...)`. `trust_remote_code=True` is "
        "needed until the publishing organisation is a trusted kernel publisher.",
        "",
        f"## Available functions (API v{project.version})",
        "",
        "| name | summary |",
        "| --- | --- |",
    ]
    lines += [f"| `{name}` | {doc.replace('|', '/')} |" for name, doc in api if name != "layers"]
    layers = public_layers(project)
    if layers:
        lines += ["", "## Available layers", ""]
        lines += [f"- `{name}` (`{project.module}.layers.{name}`)" for name in layers]
    lines += [
        "",
        "## Build variants",
        "",
        "Pure Triton (noarch): the same Python package in every variant.",
        "",
    ]
    for variant in project.variants:
        backend = variant_backend(variant)
        archs = project.archs.get(backend)
        detail = f", declared archs {', '.join(archs)}" if archs else ""
        if backend == "cpu":
            detail += " (Triton's interpreter, TRITON_INTERPRET=1: for tests and tiny shapes)"
        lines.append(f"- `build/{variant}`: backend `{backend}`{detail}")
    benchmarks = sorted(path for path in benchmark_files(project) if Path(path).name.startswith("benchmark"))
    lines += ["", "## Benchmarks", ""]
    if benchmarks:
        lines.append(
            f"`kernels benchmark {repo_id}@v{project.version}` runs {', '.join(f'`{p}`' for p in benchmarks)} of "
            "this branch (needs `kernels[benchmark]`): each workload is timed beside transformers' experts path in "
            "the same dtype (the Ref column) and verified against float64 references.")
    else:
        lines.append("No benchmark available yet.")
    hardware = _readme_section(project.root, "Supported hardware")
    if hardware:
        lines += ["", "## Supported hardware", *hardware]
        while lines[-1] == "":
            lines.pop()
    docs = _doc_summaries(project.root)
    if docs:
        lines += ["", "## Documentation (in the source repository's docs/)", ""]
        lines += [f"- **{title}** (`docs/{name}`)" + (f": {text}" if text else "") for name, title, text in docs]
    if project.source:
        lines += ["", "## Source", "", f"The kernel-builder formatted source for this kernel is available at "
                  f"{project.source}."]
    lines += ["", f"License: {project.license}.", ""]
    return "\n".join(lines)


def check_hub_client() -> None:
    """Refuse huggingface_hub versions that cannot commit to kernel repos."""
    import huggingface_hub

    version = tuple(int(part) for part in re.findall(r"\d+", huggingface_hub.__version__)[:2])
    if version < MIN_HUB_CLIENT:
        raise ReleaseError(
            f"huggingface_hub {huggingface_hub.__version__} cannot commit to kernel repos; "
            f"use >= {'.'.join(map(str, MIN_HUB_CLIENT))} (requirements.txt pins the tested version)"
        )


def git_blob_id(content: bytes) -> str:
    """Git's object id of a blob: what the Hub reports as `oid` of regular (non-LFS) files, and what
    tests/hub_server.py (the Hub's test double) reports too."""
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


def publish(
    root: Path,
    *,
    repo_id: str | None = None,
    tag: str | None = None,
    build_dir: Path | None = None,
    token: str | None = None,
    dry_run: bool = False,
    build_first: bool = False,
    log=print,
) -> str | None:
    """Publish build/ as release `tag`. Returns the Hub commit the tag points to (None on a dry run).

    With `build_first`, scripts/build runs first (into `build_dir`) once the tag and the tree have been checked:
    the one command CI runs on a pushed tag. All local checks run before the first request; remote checks (an
    existing tag with other content, a newer release of the same major) run before the first write of content."""
    project = load_project(root)
    repo_id = repo_id or project.repo_id
    if not repo_id:
        raise ReleaseError("no repo id: pass --repo-id or set [general.hub] repo-id in build.toml")
    tag = tag or current_git_tag(root)
    major, minor, patch = parse_release_tag(tag)
    if major != project.version:
        raise ReleaseError(
            f"tag {tag} has major {major} but build.toml has version = {project.version}; "
            f"a v{major} release must come from a tree whose build.toml says version = {major}"
        )
    dirty = dirty_paths(root)
    if dirty:
        raise ReleaseError(
            f"the git tree is dirty ({len(dirty)} path(s), e.g. {dirty[0].strip()}); commit or stash first"
        )
    commit = head_commit(root)
    try:
        tagged = git(root, "rev-parse", f"{tag}^{{commit}}")
    except ReleaseError:
        raise ReleaseError(f"git tag {tag} does not exist; create it on the commit being released "
                           f"(scripts/release {tag[1:]})") from None
    if tagged != commit:
        raise ReleaseError(f"git tag {tag} points to {tagged[:7]}, not HEAD {commit[:7]}; check out the tag")
    recorded, released = recorded_version(project)
    source = source_version(project)
    if recorded != tag[1:]:
        raise ReleaseError(f"tag {tag} is on HEAD but torch-ext/{project.module}/{VERSION_FILE} says {source}; "
                           f"scripts/release {tag[1:]} sets it in the release commit it tags")
    if not released:
        raise ReleaseError(f"tag {tag} is on HEAD but {CHANGELOG} does not date {recorded} (its entry says unreleased; "
                           f"{VERSION_FILE} says {source}); "
                           f"scripts/release {tag[1:]} dates it in the release commit it tags")
    revision = source_revision(project)
    version = build_version(project, revision)
    if version != tag[1:]:  # a clean tree with the tag on HEAD: only another check above failing gets here
        raise ReleaseError(f"the build version would be {version}, not {tag[1:]}")
    build_dir = build_dir if build_dir is not None else root / "build"
    if build_first:
        build(root, build_dir, log=log)
    trees = check_build_fresh(project, build_dir, revision, version)
    # Hub path -> content of every file the release commits next to the card: the variants and the benchmarks.
    uploads = {f"build/{variant}/{rel}": content for variant, tree in trees.items() for rel, content in tree.items()}
    uploads.update(benchmark_files(project))
    uploaded_prefixes = (*(f"build/{variant}/" for variant in trees), f"{BENCHMARKS_DIR}/")
    if not dry_run and not token:
        raise ReleaseError("HF_TOKEN is not set: a write token for the kernel repo is needed (CI: secrets.HF_TOKEN)")
    if not dry_run:
        check_hub_client()

    branch = f"v{project.version}"
    card = render_card(project, repo_id, tag).encode()
    prefix = "[dry-run] " if dry_run else ""
    log(f"{prefix}release {tag} of {repo_id} from commit {commit[:7]}: {len(uploads)} files in {len(trees)} variants "
        f"and {BENCHMARKS_DIR}/")
    log(f"{prefix}1. create kernel repo {repo_id} if missing (repo_type='kernel')")
    log(f"{prefix}2. check tags: stop if {tag} already holds this build; refuse if it holds another, "
        f"or if a newer v{major} release exists")
    log(f"{prefix}3. commit {CARD_PATH} (card, {len(card)} bytes) to main")
    log(f"{prefix}4. create branch {branch} from main if missing")
    log(f"{prefix}5. commit to {branch}: {CARD_PATH} and")
    for path in uploads:
        log(f"{prefix}     {path}")
    log(f"{prefix}   deleting files under {', '.join(uploaded_prefixes)} on {branch} that are not listed")
    log(f"{prefix}6. create tag {tag} on the new {branch} commit")
    if dry_run:
        log("[dry-run] nothing was sent")
        return None

    from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi
    from huggingface_hub.hf_api import RepoFile

    api = HfApi(token=token)
    repo_url = api.create_repo(repo_id, repo_type="kernel", exist_ok=True)
    log(f"1. repo: {repo_url}")

    refs = api.list_repo_refs(repo_id, repo_type="kernel")
    tags = {ref.name: ref.target_commit for ref in refs.tags}
    local_ids = {path: git_blob_id(content) for path, content in uploads.items()}
    if tag in tags:
        remote = {
            f.path: f.blob_id
            for f in api.list_repo_tree(repo_id, repo_type="kernel", revision=tags[tag], recursive=True)
            if isinstance(f, RepoFile) and f.path.startswith(uploaded_prefixes)
        }
        if remote == local_ids:
            log(f"2. tag {tag} already points to {tags[tag][:7]} with this exact build: nothing to do")
            return tags[tag]
        raise ReleaseError(
            f"Hub tag {tag} already exists on {tags[tag][:7]} with different files; release a new version"
        )
    newer = sorted(name for name in tags if TAG_PATTERN.fullmatch(name) and parse_release_tag(name)[0] == major
                   and parse_release_tag(name) > (major, minor, patch))
    if newer:
        raise ReleaseError(
            f"newer v{major} releases exist on the Hub ({', '.join(newer)}): {tag} would move {branch} back"
        )
    log(f"2. tag {tag} is new")

    card_commit = api.create_commit(
        repo_id,
        repo_type="kernel",
        revision="main",
        operations=[CommitOperationAdd(path_in_repo=CARD_PATH, path_or_fileobj=card)],
        commit_message=f"Card for {tag}",
    )
    log(f"3. card on main: {card_commit.oid[:7]}")

    branches = {ref.name: ref.target_commit for ref in refs.branches}
    if branch not in branches:
        api.create_branch(repo_id, repo_type="kernel", branch=branch, revision="main", exist_ok=True)
        branches = {ref.name: ref.target_commit for ref in api.list_repo_refs(repo_id, repo_type="kernel").branches}
        log(f"4. created branch {branch}")
    else:
        log(f"4. branch {branch} exists at {branches[branch][:7]}")

    remote_files = api.list_repo_files(repo_id, repo_type="kernel", revision=branch)
    operations = [CommitOperationAdd(path_in_repo=CARD_PATH, path_or_fileobj=card)]
    operations += [CommitOperationAdd(path_in_repo=path, path_or_fileobj=content) for path, content in uploads.items()]
    stale = sorted(p for p in remote_files if p.startswith(uploaded_prefixes) and p not in local_ids)
    operations += [CommitOperationDelete(path_in_repo=path) for path in stale]
    release_commit = api.create_commit(
        repo_id,
        repo_type="kernel",
        revision=branch,
        operations=operations,
        commit_message=f"Release {tag} (built from {commit[:7]})",
        parent_commit=branches[branch],
    )
    log(f"5. {branch}: {release_commit.oid[:7]} ({len(stale)} stale file(s) deleted)")

    api.create_tag(repo_id, repo_type="kernel", tag=tag, revision=release_commit.oid, tag_message=f"Release {tag}")
    log(f"6. tagged {tag} -> {release_commit.oid[:7]}")
    return release_commit.oid


def _project_root() -> Path:
    return Path(__file__).resolve().parent.parent


def main_build(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="scripts/build",
        description="Build the noarch variants (build/torch-<backend> for each backend of build.toml) without nix.",
    )
    parser.add_argument("--out", type=Path, default=None, help="output directory (default: <repo>/build)")
    parser.add_argument("--root", type=Path, default=_project_root(), help="kernel repository (default: this one)")
    args = parser.parse_args(argv)
    try:
        build(args.root.resolve(), args.out.resolve() if args.out else None)
    except ReleaseError as e:
        print(f"scripts/build: {e}", file=sys.stderr)
        return 2
    return 0


def main_release(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="scripts/release",
        description="Tag release VERSION (X.Y.Z) of a tree preparing it: date its CHANGELOG.md entry, set the "
        "package's _version.py to X.Y.Z, commit 'Release vX.Y.Z', move branch v<major> to that commit and tag it "
        "vX.Y.Z (annotated); then open X.Y.(Z+1).dev0 on the branch released from. Pushes nothing.",
    )
    parser.add_argument("version", help="the release, X.Y.Z (its major must be build.toml's version)")
    parser.add_argument("--root", type=Path, default=_project_root(), help="kernel repository (default: this one)")
    args = parser.parse_args(argv)
    try:
        release(args.root.resolve(), args.version)
    except ReleaseError as e:
        print(f"scripts/release: refusing to release: {e}", file=sys.stderr)
        return 2
    return 0


def main_publish(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="scripts/publish",
        description="Publish build/ to the Hub as release TAG: branch v<major>, card on main, tag TAG. "
        "Reads the token from HF_TOKEN and the Hub address from HF_ENDPOINT (default: the public Hub).",
    )
    parser.add_argument("--repo-id", default=None, help="kernel repo (default: build.toml [general.hub] repo-id)")
    parser.add_argument("--tag", default=None, help="release tag vMAJOR.MINOR.PATCH (default: the git tag on HEAD)")
    parser.add_argument("--build-dir", type=Path, default=None, help="variants to upload (default: <repo>/build)")
    parser.add_argument("--build", action="store_true",
                        help="run scripts/build into the build dir first, after the tag checks (what CI runs)")
    parser.add_argument("--root", type=Path, default=_project_root(), help="kernel repository (default: this one)")
    parser.add_argument("--dry-run", action="store_true", help="run the checks and print every step; send nothing")
    args = parser.parse_args(argv)
    try:
        publish(
            args.root.resolve(),
            repo_id=args.repo_id,
            tag=args.tag,
            build_dir=args.build_dir.resolve() if args.build_dir else None,
            token=os.environ.get("HF_TOKEN") or None,
            dry_run=args.dry_run,
            build_first=args.build,
        )
    except ReleaseError as e:
        print(f"scripts/publish: refusing to publish: {e}", file=sys.stderr)
        return 2
    return 0
