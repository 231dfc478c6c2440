"""Build the noarch variants of the kernel and publish them to the Hugging Face kernel hub.

Shared by scripts/build and scripts/publish (each a thin command line over this module); docs/releasing.md
explains the release flow. Only the standard library is needed to build; publishing needs huggingface_hub.

Build (what kernel-builder's noarch build produces, without nix)::

    torch-ext/moe_dispatch/**  --copy, files with a `pyext` extension-->  build/torch-<backend>/
                               + _ops.py        per-build torch op namespace (`add_op_namespace_prefix`)
                               + _version.py    __version__: the release tag on HEAD (v1.2.0 -> "1.2.0"), else
                                                "<major>.x.dev+<commit>" (a build no release comes from)
                               + metadata.json  name, id, version, license, python-depends, backend {type, archs}

    id = _moe_dispatch_<backend>_<first 7 hex digits of HEAD>[_dirty]

Publish (tag v<major>.<minor>.<patch> -> Hub)::

    checks (nothing is sent when one fails): tag format, tag major == build.toml version, git tag on HEAD,
    clean tree, build/ fresh for HEAD, HF_TOKEN set, huggingface_hub able to commit to kernel repos
    create_repo(kernel) -> README card on main -> branch v<major> -> commit build/<variant>/** and benchmarks/*.py
    (+ deletions)
    -> Hub tag named like the git tag on that commit
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

# Variant directory -> (backend in the build id, backend type in metadata.json, build.toml key of its archs).
# `torch-universal` is the pre-noarch name that older `kernels` clients look for. "universal" is not a backend
# type the loader accepts in metadata.json, so that variant declares CUDA, the primary target: the current loader
# only picks it where no torch-<backend> variant matches (e.g. CPU-only machines), and its arch check only runs
# on CUDA devices.
VARIANTS = {
    "torch-cuda": ("cuda", "cuda", "cuda_capabilities"),
    "torch-rocm": ("rocm", "rocm", "rocm_archs"),
    "torch-universal": ("universal", "cuda", "cuda_capabilities"),
}
GENERATED_FILES = ("_ops.py", "_version.py", "metadata.json")
SKIPPED_DIRS = {"__pycache__"}
SKIPPED_SUFFIXES = (".pyc", ".pyo")
TAG_PATTERN = re.compile(r"v(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)")
CARD_PATH = "README.md"
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
    archs: dict[str, tuple[str, ...]]  # build.toml [torch-noarch] key -> archs
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
        built = [f"torch-{backend}" for backend in self.backends if f"torch-{backend}" in VARIANTS]
        return built + ["torch-universal"]


def load_project(root: Path) -> Project:
    """Read build.toml under `root`."""
    with open(root / "build.toml", "rb") as f:
        config = tomllib.load(f)
    general = config["general"]
    noarch = config.get("torch-noarch")
    if noarch is None:
        raise ReleaseError("build.toml has no [torch-noarch] section: scripts/build only reproduces noarch builds")
    unknown = [b for b in general["backends"] if f"torch-{b}" not in VARIANTS]
    if unknown:
        raise ReleaseError(f"scripts/build has no variant for backend(s) {unknown}; add them to VARIANTS")
    return Project(
        root=root,
        name=general["name"],
        version=int(general["version"]),
        license=general["license"],
        backends=tuple(general["backends"]),
        repo_id=general.get("hub", {}).get("repo-id"),
        archs={key: tuple(noarch.get(key, ())) for key in ("cuda_capabilities", "rocm_archs")},
        pyext=tuple(noarch.get("pyext", ("py",))),
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
    """Tracked files with changes and untracked files that are not ignored (`git status --porcelain`)."""
    return [line for line in git(root, "status", "--porcelain").splitlines() if line.strip()]


def source_revision(project: Project) -> tuple[str, bool]:
    """(commit, dirty) the build is made from.

    Outside a git checkout (e.g. a copy of the tree on a GPU machine) the commit is MOE_DISPATCH_COMMIT when set,
    else a hash of the package's files, and the build counts as dirty: nothing shows it matches a commit."""
    try:
        return head_commit(project.root), bool(dirty_paths(project.root))
    except ReleaseError as e:
        commit = os.environ.get("MOE_DISPATCH_COMMIT", "")
        if not re.fullmatch(r"[0-9a-f]{7,40}", commit):
            digest = hashlib.sha256()
            for rel in source_files(project):
                digest.update(rel.encode() + b"\0" + (project.source_dir / rel).read_bytes())
            commit = digest.hexdigest()
        print(f"warning: no git revision ({e}); the build id uses {commit[:7]} and is marked _dirty", file=sys.stderr)
        return commit, True


def build_id(project: Project, variant: str, commit: str, dirty: bool) -> str:
    backend = VARIANTS[variant][0]
    return f"_{project.module}_{backend}_{commit[:7]}{'_dirty' if dirty else ''}"


def source_files(project: Project) -> list[str]:
    """Relative paths of the package files a variant ships, sorted; refuses files `pyext` would drop."""
    if not (project.source_dir / "__init__.py").is_file():
        raise ReleaseError(f"{project.source_dir.relative_to(project.root)}/__init__.py is missing")
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


def render_ops_py(namespace: str) -> str:
    return f'''"""Torch op namespace of this build; generated by scripts/build, do not edit.

Every build registers its custom ops under its own namespace, so several builds of the kernel can be
loaded into one process (e.g. two pinned revisions) without their ops clashing.
"""

import torch

NAMESPACE = "{namespace}"

ops = getattr(torch.ops, NAMESPACE)


def add_op_namespace_prefix(op_name: str) -> str:
    """Qualify `op_name` with this build's namespace (for `torch.library.custom_op` / `triton_op` names)."""
    return f"{{NAMESPACE}}::{{op_name}}"
'''


def build_version(project: Project, commit: str, dirty: bool) -> str:
    """The package's `__version__` in a build: the newest release tag of build.toml's major on HEAD of a clean tree
    (tag v1.2.0 -> "1.2.0"), else "<major>.x.dev+<commit>[.dirty]". Publishing a tag needs a build made on it."""
    if not dirty:
        try:
            tags = git(project.root, "tag", "--points-at", "HEAD").split()
        except ReleaseError:
            tags = []
        releases = sorted(parse_release_tag(t) for t in tags if TAG_PATTERN.fullmatch(t))
        releases = [r for r in releases if r[0] == project.version]
        if releases:
            return ".".join(str(part) for part in releases[-1])
    return f"{project.version}.x.dev+{commit[:7]}{'.dirty' if dirty else ''}"


def render_version_py(version: str) -> str:
    return f'''"""Version of this build; generated by scripts/build from the git tag, do not edit."""

__version__ = "{version}"
'''


def render_metadata(project: Project, variant: str, kernel_id: str) -> str:
    _, backend_type, archs_key = VARIANTS[variant]
    backend: dict = {"type": backend_type}
    if project.archs[archs_key]:
        backend["archs"] = list(project.archs[archs_key])
    metadata = {
        "name": project.name,
        "id": kernel_id,
        "version": project.version,
        "license": project.license,
        "python-depends": list(project.python_depends),
        "backend": backend,
    }
    return json.dumps(metadata, indent=2) + "\n"


def expected_variant_files(project: Project, variant: str, kernel_id: str, version: str) -> dict[str, bytes]:
    """Every file of build/<variant>/ as the build writes it: relative path -> content."""
    files = {rel: (project.source_dir / rel).read_bytes() for rel in source_files(project)}
    files["_ops.py"] = render_ops_py(kernel_id).encode()
    files["_version.py"] = render_version_py(version).encode()
    files["metadata.json"] = render_metadata(project, variant, kernel_id).encode()
    return files


def build(root: Path, out: Path | None = None, log=print) -> list[Path]:
    """Write build/torch-<backend>/ for every variant into `out` (default: <root>/build). Returns the variant dirs."""
    project = load_project(root)
    out = out if out is not None else root / "build"
    commit, dirty = source_revision(project)
    version = build_version(project, commit, dirty)
    written = []
    for variant in project.variants:
        kernel_id = build_id(project, variant, commit, dirty)
        variant_dir = out / variant
        if variant_dir.exists():
            shutil.rmtree(variant_dir)
        for rel, content in expected_variant_files(project, variant, kernel_id, version).items():
            (variant_dir / rel).parent.mkdir(parents=True, exist_ok=True)
            (variant_dir / rel).write_bytes(content)
        log(f"built {variant_dir} ({kernel_id}, version {version})")
        written.append(variant_dir)
    if dirty:
        log("warning: the build ids end in _dirty (uncommitted changes, or no git revision); "
            "scripts/publish refuses them")
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


def check_build_fresh(project: Project, build_dir: Path, commit: str, version: str) -> dict[str, dict[str, bytes]]:
    """Check that build_dir holds exactly what scripts/build writes for `commit` on a clean tree, as `version`.

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
        want_id = build_id(project, variant, commit, dirty=False)
        if built_id != want_id:
            raise ReleaseError(
                f"build is stale: {variant} has id {built_id}, HEAD {commit[:7]} on a clean tree needs {want_id}; "
                "rerun scripts/build"
            )
        want = expected_variant_files(project, variant, want_id, version)
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
        raise ReleaseError(f"HEAD carries no git tag; tag it (git tag v1.2.0) or pass --tag ({e})") from None


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


def render_card(project: Project, repo_id: str) -> str:
    """The Hub README: usage, the versioned API (`__all__`), variants, supported hardware and docs, from the sources."""
    package_doc, api = public_api(project)
    summary = package_doc.strip().splitlines()[0] if package_doc.strip() else project.name
    lines = [
        "---",
        f"license: {project.license.lower()}",
        "tags:",
        "- kernels",
        "---",
        "",
        f"# {project.name}",
        "",
        summary,
        "",
        "This card is generated by `scripts/publish` from the package's `__all__`, build.toml, README.md and docs/.",
        "",
        "## Usage",
        "",
        "```python",
        "from kernels import get_kernel",
        "",
        f'{project.module} = get_kernel("{repo_id}", version={project.version}, trust_remote_code=True)',
        "```",
        "",
        f"`version={project.version}` loads the newest release of API v{project.version} (branch "
        f"`v{project.version}`). Pin a release with `revision=\"v{project.version}.0.0\"` (each release has a tag), "
        "or lock the commit with `kernels lock` and `load_kernel(..., lockfile=...)`. `trust_remote_code=True` is "
        "needed until the publishing organisation is a trusted kernel publisher.",
        "",
        f"## API v{project.version}",
        "",
        "| name | summary |",
        "| --- | --- |",
    ]
    lines += [f"| `{name}` | {doc.replace('|', '/')} |" for name, doc in api]
    archs = project.archs
    lines += [
        "",
        "## Build variants",
        "",
        "Pure Triton (noarch): the same Python package in every variant.",
        "",
    ]
    for variant in project.variants:
        _, backend_type, key = VARIANTS[variant]
        lines.append(f"- `build/{variant}`: backend `{backend_type}`, declared archs {', '.join(archs[key]) or 'any'}")
    benchmarks = sorted(path for path in benchmark_files(project) if Path(path).name.startswith("benchmark"))
    if benchmarks:
        lines += [
            "",
            "## Benchmarks",
            "",
            f"`kernels benchmark {repo_id}@v{project.version}` runs {', '.join(f'`{p}`' for p in benchmarks)} of this "
            "branch (needs `kernels[benchmark]`): each workload is timed and verified against float64 references.",
        ]
    hardware = _readme_section(project.root, "Supported hardware")
    if hardware:
        lines += ["", "## Supported hardware", *hardware]
        while lines[-1] == "":
            lines.pop()
    docs = _doc_summaries(project.root)
    if docs:
        lines += ["", "## Documentation (in the source repository's docs/)", ""]
        lines += [f"- **{title}** (`docs/{name}`)" + (f": {text}" if text else "") for name, title, text in docs]
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
    log=print,
) -> str | None:
    """Publish build/ as release `tag`. Returns the Hub commit the tag points to (None on a dry run).

    All local checks run before the first request; remote checks (an existing tag with other content, a newer
    release of the same major) run before the first write of content."""
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
        raise ReleaseError(f"git tag {tag} does not exist; create it on the commit being released") from None
    if tagged != commit:
        raise ReleaseError(f"git tag {tag} points to {tagged[:7]}, not HEAD {commit[:7]}; check out the tag")
    version = build_version(project, commit, dirty=False)
    if version != f"{major}.{minor}.{patch}":
        raise ReleaseError(f"HEAD's newest v{major} tag makes the build version {version}, not {tag[1:]}; "
                           f"release that tag, or check out a commit whose newest release tag is {tag}")
    trees = check_build_fresh(project, build_dir if build_dir is not None else root / "build", commit, version)
    # Hub path -> content of every file the release commits next to the card: the variants and the benchmarks.
    uploads = {f"build/{variant}/{rel}": content for variant, tree in trees.items() for rel, content in tree.items()}
    uploads.update(benchmark_files(project))
    uploaded_prefixes = (*(f"build/{variant}/" for variant in trees), f"{BENCHMARKS_DIR}/")
    if not dry_run and not token:
        raise ReleaseError("HF_TOKEN is not set: a write token for the kernel repo is needed (CI: secrets.HF_TOKEN)")
    if not dry_run:
        check_hub_client()

    branch = f"v{project.version}"
    card = render_card(project, repo_id).encode()
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
        description="Build the noarch variants (build/torch-cuda, torch-rocm, torch-universal) without nix.",
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


def main_publish(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="scripts/publish",
        description="Publish build/ to the Hub as release TAG: branch v<major>, card on main, tag TAG. "
        "Reads the token from HF_TOKEN and the Hub address from HF_ENDPOINT (default: the public Hub).",
    )
    parser.add_argument("--repo-id", default=None, help="kernel repo (default: build.toml [general.hub] repo-id)")
    parser.add_argument("--tag", default=None, help="release tag vMAJOR.MINOR.PATCH (default: the git tag on HEAD)")
    parser.add_argument("--build-dir", type=Path, default=None, help="variants to upload (default: <repo>/build)")
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
        )
    except ReleaseError as e:
        print(f"scripts/publish: refusing to publish: {e}", file=sys.stderr)
        return 2
    return 0
