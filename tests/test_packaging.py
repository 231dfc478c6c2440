"""Packaging: build.toml, the noarch build of scripts/build, and the release path of scripts/publish, end to end.

- build.toml passes the parser inside the `kernels` wheel; flake.nix is in the builder's form.
- scripts/build writes build/torch-{cpu,cuda,rocm} as kernel-builder's noarch build does (metadata with digest and
  provenance, the op namespace, the compatibility package folder): kernels' own validation passes on every variant,
  each loads with `kernels.get_local_kernel` and through `LOCAL_KERNELS` + `get_kernel(..., version=1)`, and its
  forward matches `fused_moe_forward_ref`. Versions are PEP 440.
- The release flow against tests/hub_server.py (a loopback test double of the Hub's HTTP API): scripts/release tags
  v1.0.0 on branch v1, scripts/publish --build (what CI runs on the tag) publishes it; then v1.1.0; fresh client
  processes load the newest v1, the pinned v1.0.0 and a `kernels lock`ed commit, and a version-2 request fails with
  the loader's error. Every refusal of scripts/release and scripts/publish changes and sends nothing.

Releases are made from a throw-away git repo holding a copy of this checkout's working tree, so the tests do not
depend on whether this checkout is clean. On a CPU-only machine the loader accepts `torch-cpu` from a repo, and
`backend=` can only name "cpu" or the machine's own backend; the cuda and rocm variants are therefore loaded by
pointing `get_local_kernel` / `LOCAL_KERNELS` at the variant directory itself.
"""

import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch
from packaging.version import Version

import kernel_build
from hub_server import HubServer

ROOT = Path(__file__).resolve().parents[1]
# What the client processes import by name: test_packaging and hub_server (tests/) and _hub_release (scripts/), two of
# the folders pytest.ini puts on sys.path here. Not torch-ext/: a client has only the kernels it loads, and checks
# each against the float64 references that kernel ships (check_forward).
CLIENT_PATH = [str(ROOT / folder) for folder in ("tests", "scripts")]
REPO_ID = "org/moe-dispatch"  # the test double's repo; the real id lives in build.toml only
TOKEN = "hf_test_token"
VARIANTS = ("torch-cpu", "torch-cuda", "torch-rocm")
ARCHS = {"torch-cpu": None, "torch-cuda": ["8.0", "9.0"], "torch-rocm": ["gfx942"]}
PREFERRED_VARIANT = kernel_build.PREFERRED_VARIANT  # the variant the loader picks from a full build on this machine
RELEASE_FILES = ["build.toml", "flake.nix", "LICENSE", ".gitignore", "README.md", "CHANGELOG.md", "docs",
                 "benchmarks", "scripts/_hub_release.py", "scripts/build", "scripts/release", "scripts/publish",
                 "torch-ext/moe_dispatch"]
# What .github/workflows/publish.yml runs on a pushed tag (after the tests); the release test runs the same.
CI_PUBLISH = '.venv/bin/python scripts/publish --build --tag "$GITHUB_REF_NAME"'
SOURCE_URL = "https://github.com/moe-dispatch/moe-dispatch"
HAS_GIT = shutil.which("git") is not None
requires_git = pytest.mark.skipif(not HAS_GIT, reason="needs the git command")
GIT_ENV = {"GIT_AUTHOR_NAME": "release-test", "GIT_AUTHOR_EMAIL": "release-test@example.invalid",
           "GIT_COMMITTER_NAME": "release-test", "GIT_COMMITTER_EMAIL": "release-test@example.invalid"}


# -- helpers (also imported by the client processes of the end-to-end tests) ------------------------------------------

def check_forward(module) -> None:
    """One small forward through the loaded kernel (T=4, H=32, F=32, E=4, top_k=2) against the float64 reference the
    kernel ships (`module.reference`, bound by name on the loaded package)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(0)
    T, H, F, E, top_k = 4, 32, 32, 4, 2
    x = torch.randn(T, H, generator=gen)
    router = torch.randn(E, H, generator=gen)
    w_gate, w_up = (torch.randn(E, F, H, generator=gen) * 0.2 for _ in range(2))
    w_down = torch.randn(E, H, F, generator=gen) * 0.2
    args = [t.to(device) for t in (x, router, w_gate, w_up, w_down)]
    out, ids, weights = module.fused_moe_forward(*args, E, top_k)
    ref_out, ref_ids, ref_weights = module.reference.fused_moe_forward_ref(*args, E, top_k)
    assert torch.equal(ids.long(), ref_ids), (ids, ref_ids)
    tol = 1e-5 if device == "cpu" else 5e-3  # fp32 on the interpreter is near exact; tf32 dots on a GPU are not
    rel_w = ((weights.double() - ref_weights).norm() / ref_weights.norm()).item()
    rel_out = ((out.double() - ref_out).norm() / ref_out.norm()).item()
    assert rel_w < tol and rel_out < tol, f"weights rel err {rel_w:.2e}, out rel err {rel_out:.2e} (tol {tol})"


def snapshot_of(module) -> tuple[str, str]:
    """(Hub commit, variant) a kernel loaded from the hub cache came from: .../snapshots/<sha>/build/<variant>/."""
    path = Path(module.__file__)  # not resolved: the snapshot's files are links into blobs/
    return path.parents[2].name, path.parent.name


def git(repo: Path, *args: str) -> str:
    result = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True,
                            env={**os.environ, **GIT_ENV}, check=True)
    return result.stdout.strip()


def make_release_repo(path: Path) -> Path:
    """A git repo at `path` with what a release needs from this checkout's working tree, committed."""
    for rel in RELEASE_FILES:
        src = ROOT / rel
        if src.is_dir():
            shutil.copytree(src, path / rel, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        elif src.exists():
            (path / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, path / rel)
    _as_before_the_first_release(path)
    git(path, "init", "-q", "-b", "main")
    git(path, "add", "-A")
    git(path, "commit", "-q", "-m", "release tree")
    return path


def _as_before_the_first_release(path: Path) -> None:
    """The release tests start from the tree as it was before its first release, whatever this checkout has released
    since: CHANGELOG.md's entries above 1.0.0 dropped, 1.0.0's undated, the package's version 1.0.0.dev0."""
    changelog = path / "CHANGELOG.md"
    text = changelog.read_text()
    header, first = text.split("\n## [", 1)[0], text[text.index("\n## [1.0.0]"):]
    first = re.sub(r"^## \[1\.0\.0\] - .*$", "## [1.0.0] - unreleased", first, count=1, flags=re.M)
    changelog.write_text(header + "\n" + first)
    version_file = path / "torch-ext" / "moe_dispatch" / "_version.py"
    version_file.write_text(re.sub(r'__version__ = "[^"]+"', '__version__ = "1.0.0.dev0"', version_file.read_text()))


def clean_env(**extra: str) -> dict[str, str]:
    """The environment of a script or client process: no token, no overrides, and no HF_HUB_DISABLE_TELEMETRY
    (kernels 0.17.2 then sends an empty user agent that huggingface_hub 2.x rejects)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_TOKEN", "HF_HUB_DISABLE_TELEMETRY", "LOCAL_KERNELS", "KERNELS_CACHE", "HF_HUB_OFFLINE")}
    env.update(HF_HUB_DISABLE_PROGRESS_BARS="1",
               PYTHONPATH=os.pathsep.join(p for p in (*CLIENT_PATH, os.environ.get("PYTHONPATH")) if p))
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    env.update(extra)
    return env


def run_script(repo: Path, script: str, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(repo / "scripts" / script), *args], cwd=repo, env=env,
                          capture_output=True, text=True)


def run_python(code: str, env: dict[str, str]) -> dict:
    """Run `code` in a fresh interpreter; it prints one JSON object last, which is returned."""
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def hub_release():
    """scripts/_hub_release.py (scripts/ is on pytest.ini's pythonpath)."""
    import _hub_release

    return _hub_release


CLI_MAIN = {"kernels": "kernels.cli", "hf": "huggingface_hub.cli.hf"}


def cli(name: str) -> list[str]:
    """argv prefix running the `kernels` or `hf` command with this interpreter (wheels installed with --target
    have their console scripts elsewhere)."""
    return [sys.executable, "-c", f"import sys; from {CLI_MAIN[name]} import main; sys.argv[0] = {name!r}; "
            "sys.exit(main())"]


# -- build.toml, flake.nix ---------------------------------------------------------------------------------------------

def test_build_toml_passes_the_kernels_parser():
    from kernels._rust import Backend, Build

    build = Build.open(ROOT)
    assert build.general.backends == [Backend.CUDA, Backend.ROCm, Backend.CPU]
    config = tomllib.loads((ROOT / "build.toml").read_text())
    general = config["general"]
    assert (general["name"], general["version"], general["edition"]) == ("moe-dispatch", 1, 5)
    assert general["license"] == "Apache-2.0" and (ROOT / "LICENSE").read_text().count("Apache License") >= 1
    assert re.fullmatch(r"[\w.-]+/moe-dispatch", general["hub"]["repo-id"])
    assert general["source"] == SOURCE_URL  # metadata.json's `source` and the card's Source section
    noarch = config["torch-noarch"]
    assert noarch["cuda_capabilities"] == ["8.0", "9.0"] and noarch["rocm_archs"] == ["gfx942"]
    assert "json" in noarch["pyext"]  # configs/*.json ship with the package
    assert "typed" in noarch["pyext"]  # and the py.typed marker (PEP 561)


def test_flake_is_in_the_builder_form():
    flake = (ROOT / "flake.nix").read_text()
    assert 'kernel-builder.url = "github:huggingface/kernels"' in flake
    assert re.search(r"kernel-builder\.lib\.genKernelFlakeOutputs\s*{\s*inherit self;\s*path = \./\.;\s*}", flake)


def test_workflows_test_every_push_and_publish_tags():
    yaml = pytest.importorskip("yaml")
    test = yaml.safe_load((ROOT / ".github" / "workflows" / "test.yml").read_text())
    publish = yaml.safe_load((ROOT / ".github" / "workflows" / "publish.yml").read_text())
    # YAML 1.1 reads the key `on` as True.
    assert {"pull_request", "push"} <= set(test[True])
    assert [step["run"] for step in test["jobs"]["test"]["steps"] if "run" in step] == ["bash scripts/test"]
    assert publish[True] == {"push": {"tags": ["v*"]}}
    steps = publish["jobs"]["publish"]["steps"]
    runs = [step["run"] for step in steps if "run" in step]
    # The tests, then the very command the release test below runs against the Hub's test double.
    assert runs == ["bash scripts/test", CI_PUBLISH]
    assert steps[-1]["env"] == {"HF_TOKEN": "${{ secrets.HF_TOKEN }}"}
    python = next(step["with"]["python-version"] for step in steps if step.get("uses", "").startswith("actions/setup"))
    assert python == ".".join(map(str, hub_release().MIN_PYTHON))  # CI runs the stated minimum


# -- scripts/build -----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def build_run() -> tuple[Path, frozenset[str] | None]:
    """scripts/build run on this checkout into a temporary directory, shared with tests/test_kernels_ci.py
    (kernel_build.build_variants) -> (directory, possible HEADs or None). Tests copy it before changing anything."""
    return kernel_build.build_variants()


@pytest.fixture(scope="module")
def built(build_run) -> Path:
    return build_run[0]


# written by scripts/build for each variant: the op namespace, the build's version, the compatibility package, metadata
GENERATED = {"_ops.py", "_version.py", "moe_dispatch/__init__.py", "metadata.json"}


def checkout_version() -> str:
    """`__version__` of this checkout's package, read here without scripts/ (what `import moe_dispatch` reports)."""
    return re.search(r'__version__ = "([^"]+)"', (ROOT / "torch-ext" / "moe_dispatch" / "_version.py").read_text())[1]


def package_files() -> set[str]:
    src = ROOT / "torch-ext" / "moe_dispatch"
    return {p.relative_to(src).as_posix() for p in src.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix in (".py", ".json", ".typed")
            and p.name not in GENERATED}


def built_version(variant_dir: Path) -> str:
    return re.search(r'__version__ = "([^"]+)"', (variant_dir / "_version.py").read_text()).group(1)


def test_build_writes_each_variant(build_run):
    from kernels import Metadata

    built, heads = build_run
    assert sorted(p.name for p in built.iterdir()) == sorted(VARIANTS)
    for variant in VARIANTS:
        vdir = built / variant
        files = {p.relative_to(vdir).as_posix() for p in vdir.rglob("*") if p.is_file()}
        assert files == package_files() | GENERATED, variant
        assert any(f.startswith("configs/") and f.endswith(".json") for f in files)
        assert "py.typed" in files  # the package says it is typed (PEP 561), beside its __init__.py
        for rel in package_files():
            assert (vdir / rel).read_bytes() == (ROOT / "torch-ext" / "moe_dispatch" / rel).read_bytes()
        metadata = Metadata.read_from_file(vdir / "metadata.json")  # the loader's strict parser
        backend = variant.removeprefix("torch-")
        match = re.fullmatch(rf"_moe_dispatch_{backend}_([0-9a-f]{{7}})(_dirty)?", metadata.id)
        assert match and (heads is None and match.group(2) or match.group(1) in heads), metadata.id
        assert str(metadata.name) == "moe-dispatch" and metadata.version == 1 and metadata.license == "Apache-2.0"
        assert metadata.python_depends == [] and metadata.kernel_depends == [] and metadata.source == SOURCE_URL
        assert str(metadata.kernels_minver) == "0.14.0"
        assert str(metadata.backend.backend_type).lower() == backend and metadata.backend.archs == ARCHS[variant]
        provenance = metadata.provenance
        assert provenance.dirty == (match.group(2) is not None)
        if heads is not None:  # a git checkout: the commit and its state, for the builder (this script) as well
            assert provenance.kernel.commit[:7] == match.group(1) and len(provenance.kernel.commit) == 40
            assert provenance.kernel.dirty == (match.group(2) is not None)
            assert provenance.kernel_builder.git.commit == provenance.kernel.commit
        assert "scripts/build" in provenance.kernel_builder.version  # says what built it: not kernel-builder
        ops = (vdir / "_ops.py").read_text()
        assert f'NAMESPACE = f"_moe_dispatch_{{_torch_backend()}}_{metadata.id.removeprefix(f"_moe_dispatch_{backend}_")}"' in ops
        version = built_version(vdir)
        # The checkout's own version, the commit added unless the build is the tagged release: the same public
        # version (PEP 440, before the "+") as `import moe_dispatch` from this checkout reports.
        source = checkout_version()
        assert Version(version).public == source, (version, source)
        assert re.fullmatch(rf"{re.escape(source)}\+g{match.group(1)}(\.dirty)?", version) or (
            version == source and ".dev" not in source), version


def test_kernels_validation_passes_on_every_variant(built, caplog):
    """kernels' own checks of a variant, as its loader and `kernels verify-signature` run them: the strict metadata
    parser, the digest against a rehash of the files, and the metadata validators (python dependencies, minimum
    kernels version, dirty builds, archs). A dirty build is loaded with kernels' warning; a clean one without."""
    import logging

    from kernels._rust import Digest, Metadata
    from kernels.validate import AllValidator, ArchValidator, default_metadata_validators

    validator = AllValidator(validators=[*default_metadata_validators(), ArchValidator()])
    for variant in VARIANTS:
        metadata = Metadata.read_from_file(built / variant / "metadata.json")
        assert metadata.digest is not None and str(metadata.digest.algorithm) == "sha256"
        metadata.digest.validate(Digest.hash_variant(metadata.digest.algorithm, built / variant))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kernels.validate"):
            validator.validate_metadata(metadata=metadata, variant=variant)
        warned = "built from a dirty git tree" in caplog.text
        assert warned == metadata.provenance.dirty, (variant, caplog.text)


def test_digest_catches_an_edited_variant(tmp_path, built):
    from kernels._rust import Digest, DigestValidationError, Metadata

    variant = tmp_path / "torch-cuda"
    shutil.copytree(built / "torch-cuda", variant)
    with open(variant / "moe.py", "a") as f:
        f.write("# edited after the build\n")
    metadata = Metadata.read_from_file(variant / "metadata.json")
    with pytest.raises(DigestValidationError, match="moe.py"):
        metadata.digest.validate(Digest.hash_variant(metadata.digest.algorithm, variant))


def test_compatibility_package_exports_the_variant(built):
    """build/<variant>/moe_dispatch/__init__.py, which kernels < 0.11.1 import, is the variant's package."""
    import importlib.util

    for variant in VARIANTS:
        spec = importlib.util.spec_from_file_location(f"compat_{variant.replace('-', '_')}",
                                                      built / variant / "moe_dispatch" / "__init__.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        assert module.__version__ == built_version(built / variant)
        assert module.__all__ and all(hasattr(module, name) for name in module.__all__)
        check_forward(module)


REFERENCE_ALONE = """
import importlib, json, sys, types

sys.modules["triton"] = None  # `import triton` now raises: a module that needs it cannot load
import torch
# The variant's folder as a bare package: its __init__.py (the kernels) never runs, reference.py's relative imports of
# its reference_*.py files resolve in the folder
folder = types.ModuleType("reference_alone")
folder.__path__ = [sys.argv[1]]
sys.modules["reference_alone"] = folder
reference = importlib.import_module("reference_alone.reference")
x, router = torch.randn(3, 8), torch.randn(4, 8)
ids, weights, logits = reference.moe_router_ref(x, router, 2)
print(json.dumps({"loaded": sorted(n for n, m in sys.modules.items() if m is not None
                            and n.split(".")[0] in ("triton", "moe_dispatch")),
                  "ids": list(ids.shape), "dtype": str(weights.dtype)}))
"""


def test_reference_ships_and_launches_nothing_on_import(built):
    """moe_dispatch.reference, the float64 references the tests, the scripts and the Hub benchmark check kernels
    against, ships in every variant with the reference_*.py files it names, and they import torch and each other
    only: they load with triton unimportable and none of the package around them, so importing them compiles and
    launches no kernel."""
    folder = ROOT / "torch-ext" / "moe_dispatch"
    sources = sorted(folder.glob("reference*.py"))
    names = {path.stem for path in sources}
    assert "reference.py" in package_files() and {"reference", "reference_moe", "reference_checks"} <= names, names
    import ast

    for source in sources:
        for variant in VARIANTS:
            assert (built / variant / source.name).read_bytes() == source.read_bytes(), (variant, source.name)
        tree = ast.parse(source.read_text())
        imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        imported |= {"." * node.level + (node.module or "") for node in ast.walk(tree)
                     if isinstance(node, ast.ImportFrom)}
        assert imported <= {"torch"} | {f".{name}" for name in names - {"reference"}}, (source.name, imported)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([sys.executable, "-c", REFERENCE_ALONE, str(built / "torch-cpu")],
                            capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report == {"loaded": [], "ids": [3, 2], "dtype": "torch.float64"}, report


def test_checkout_version_is_the_release_its_changelog_prepares():
    """A checkout says what it is, in the form its builds report: X.Y.Z.dev0 while CHANGELOG.md prepares X.Y.Z (its
    newest entry, `unreleased`, above every dated release), X.Y.Z only in a release commit (X.Y.Z the newest entry,
    dated). An entry that adds to the API (`### Added`) is a minor release at least. The rule is checked here without
    scripts/, and the same checks reject trees that break it (the last loop)."""
    with open(ROOT / "build.toml", "rb") as f:
        major = tomllib.load(f)["general"]["version"]
    changelog = (ROOT / "CHANGELOG.md").read_text()

    def violations(source: str, changelog: str) -> list[str]:
        found = []
        version = Version(source)
        if version.major != major:
            found.append(f"major {version.major}, build.toml {major}")
        if not re.fullmatch(r"\d+\.\d+\.\d+(\.dev0)?", source):
            found.append(f"{source} is neither X.Y.Z nor X.Y.Z.dev0")
        headings = re.findall(r"^## \[(\d+\.\d+\.\d+)\] - (\S+)$", changelog, re.M)
        versions = [Version(v) for v, _ in headings]
        if versions != sorted(versions, reverse=True):
            found.append(f"entries not newest first: {headings}")
        if not headings or headings[0][0] != version.base_version:
            found.append(f"the newest entry is not {version.base_version}: {headings[:1]}")
            return found
        undated = [v for v, when in headings if when == "unreleased"]
        dated = [v for v, when in headings if re.fullmatch(r"\d{4}-\d\d-\d\d", when)]
        if len(undated) + len(dated) != len(headings) or len(undated) > 1:
            found.append(f"entries neither dated nor the one `unreleased`: {headings}")
        if version.is_devrelease != (headings[0][1] == "unreleased"):
            found.append(f"{source} but its entry says {headings[0][1]}")
        body = changelog.split(f"## [{headings[0][0]}] - {headings[0][1]}", 1)[1].split("\n## [", 1)[0]
        if version.is_devrelease and dated and "\n### Added" in body:
            last = Version(dated[0])
            if (version.major, version.minor) == (last.major, last.minor):
                found.append(f"{source} adds to the API after {last}: a minor release")
        return found

    source = checkout_version()
    assert violations(source, changelog) == [], (source, violations(source, changelog))
    released = "## [1.0.0] - 2026-12-02\n"
    for source, text in (("1.0.0", f"## [1.1.0] - unreleased\n\n### Added\n- x\n\n{released}"),  # says released
                         ("1.1.0", f"## [1.1.0] - unreleased\n\n{released}"),  # a release before its release
                         ("1.0.1.dev0", f"## [1.0.1] - unreleased\n\n### Added\n- x\n\n{released}"),  # a feature
                         ("1.1.0.dev0", f"## [1.2.0] - unreleased\n\n{released}"),  # another version
                         ("1.0.0.dev0", released)):  # dated already
        assert violations(source, text), (source, text)
    # The release commit's form passes, and so does the tree scripts/release opens after it.
    assert violations("1.0.0", released) == [] and violations("1.0.1.dev0", f"## [1.0.1] - unreleased\n\n{released}") == []


CHANGELOG_PREPARING = "# Changelog\n\n## [1.1.0] - unreleased\n\n### Added\n- A function.\n\n## [1.0.0] - 2026-12-02\n"
CHANGELOG_RELEASED = "# Changelog\n\n## [1.0.0] - 2026-12-02\n"
CHANGELOG_FIRST = "# Changelog\n\n## [1.0.0] - unreleased\n"


def version_project(tmp_path, source: str, changelog: str | None):
    """A project holding only what decides a build's version: build.toml, _version.py and CHANGELOG.md (or none)."""
    release_module = hub_release()
    root = tmp_path / "repo"
    (root / "torch-ext" / "moe_dispatch").mkdir(parents=True)
    shutil.copy2(ROOT / "build.toml", root / "build.toml")
    version_file = root / "torch-ext" / "moe_dispatch" / "_version.py"
    shutil.copy2(ROOT / "torch-ext" / "moe_dispatch" / "_version.py", version_file)
    release_module.set_source_version(version_file, source)
    if changelog is not None:
        (root / "CHANGELOG.md").write_text(changelog)
    return release_module.load_project(root)


def test_setting_the_source_version_changes_its_line_only(tmp_path):
    """scripts/release sets `__version__` and nothing else of _version.py (its docstring, the rule of versions, has
    no second copy in the release code); a file without exactly one such line is refused."""
    version_file = tmp_path / "_version.py"
    shutil.copy2(ROOT / "torch-ext" / "moe_dispatch" / "_version.py", version_file)
    before = version_file.read_text()
    hub_release().set_source_version(version_file, "9.8.7.dev0")
    after = version_file.read_text()
    assert '__version__ = "9.8.7.dev0"' in after
    assert [a for a, b in zip(after.splitlines(), before.splitlines()) if a != b] == ['__version__ = "9.8.7.dev0"']
    for text in ('"""no version here"""\n', '__version__ = "1.0.0"\n__version__ = "1.0.1"\n'):
        version_file.write_text(text)
        with pytest.raises(hub_release().ReleaseError, match="expected one line"):
            hub_release().set_source_version(version_file, "1.0.0")
        assert version_file.read_text() == text


@pytest.mark.parametrize("source,changelog,tags_on_head,dirty,want,warned", [
    ("1.1.0.dev0", CHANGELOG_PREPARING, (), False, "1.1.0.dev0+g0123456", None),  # preparing 1.1.0: a checkout of main
    ("1.1.0.dev0", CHANGELOG_PREPARING, (), True, "1.1.0.dev0+g0123456.dirty", None),  # with local edits
    ("1.1.0.dev0", CHANGELOG_PREPARING, ("v1.0.0",), False, "1.1.0.dev0+g0123456", "v1.0.0"),  # an old tag here
    ("1.1.0.dev0", CHANGELOG_PREPARING, ("v1.1.0",), False, "1.1.0.dev0+g0123456", "v1.1.0"),  # a tag before its date
    ("1.0.0", CHANGELOG_RELEASED, ("v1.0.0",), False, "1.0.0", None),  # the release build: recorded and confirmed
    ("1.0.0", CHANGELOG_RELEASED, ("v1.0.0",), True, "1.0.0+g0123456.dirty", None),  # edits on the release
    ("1.0.0", CHANGELOG_RELEASED, (), False, "1.0.0+g0123456", None),  # the release commit, no tag: a clone without
    ("1.0.0", CHANGELOG_RELEASED, ("nightly",), False, "1.0.0+g0123456", None),  # not a release tag: nothing to say
    ("1.0.1.dev0", None, (), False, "1.0.1.dev0+g0123456", None),  # _version.py alone: taken as it is
    ("1.0.0", None, ("v1.0.0",), False, "1.0.0", None),
    ("1.0.0.dev0", CHANGELOG_FIRST, (), False, "1.0.0.dev0+g0123456", None),  # before the first release
    ("1.0.0.dev0", CHANGELOG_FIRST, ("v1.0.0",), False, "1.0.0.dev0+g0123456", "v1.0.0"),  # a tag on an undated entry
], ids=["preparing", "preparing-dirty", "old-tag", "early-tag", "release", "release-dirty", "release-untagged",
        "other-name", "no-changelog", "no-changelog-tagged", "before-release", "undated-tag"])
def test_build_versions_come_from_the_tree(tmp_path, source, changelog, tags_on_head, dirty, want, warned):
    """A build reports the tree's version (its public part is always _version.py's), with the commit added unless it
    is the clean, tagged release."""
    release_module = hub_release()
    project = version_project(tmp_path, source, changelog)
    revision = release_module.Revision(commit="0123456789" * 4, dirty=dirty, in_git=True, builder_dirty=False,
                                       tags_on_head=tags_on_head)
    logged = []
    version = release_module.build_version(project, revision, log=logged.append)
    assert version == want and str(Version(version)) == want and Version(version).public == source
    if warned is None:
        assert logged == []
    else:
        assert len(logged) == 1 and f"tag {warned}" in logged[0] and "scripts/publish refuses it" in logged[0], logged


@pytest.mark.parametrize("source,changelog,reason", [
    ("1.0.0", "## [1.1.0] - 2026-12-09\n\n## [1.0.0] - 2026-12-02\n", "dates the later release 1.1.0"),
    ("1.0.0", CHANGELOG_PREPARING, "prepares 1.1.0 (`## [1.1.0] - unreleased`)"),
    ("1.1.0", CHANGELOG_PREPARING, "a release, but CHANGELOG.md's entry says unreleased"),
    ("1.2.0.dev0", CHANGELOG_PREPARING, "no `## [1.2.0]` entry"),
    ("1.0.0.dev0", CHANGELOG_RELEASED, "dates 1.0.0 (2026-12-02): it is released"),
    ("1.0.0.dev0", "## [1.0.0] - unreleased\n\n## [1.0.0] - 2026-12-02\n", "dates 1.0.0"),
    ("1.0.0.dev0", "## [1.0.0] - unreleased\n\n## [1.1.0] - 2026-12-09\n", "must come after it, 1.1.1 or later"),
    ("1.1.0.dev0", "## [1.2.0] - unreleased\n\n## [1.1.0] - unreleased\n\n## [1.0.0] - 2026-12-02\n",
     "several `unreleased` entries (1.2.0, 1.1.0)"),
    ("1.0.1.dev0", "## [1.0.1] - unreleased\n\n### Added\n- x\n\n## [1.0.0] - 2026-12-02\n",
     "adds to the API (### Added): the release after 1.0.0 is then 1.1.0"),
    ("1.1.0.dev1", CHANGELOG_PREPARING, "not X.Y.Z.dev0"),
    ("1.1.0rc1", CHANGELOG_PREPARING, "not X.Y.Z.dev0"),
    ("2.0.0.dev0", "## [2.0.0] - unreleased\n", "build.toml has version = 1"),
])
def test_build_versions_refuse_records_that_disagree(tmp_path, source, changelog, reason):
    """_version.py and CHANGELOG.md record the tree's version together (scripts/release writes both): a tree where
    they disagree has no version, and every script refuses it."""
    release_module = hub_release()
    project = version_project(tmp_path, source, changelog)
    revision = release_module.Revision(commit="0123456789" * 4, dirty=False, in_git=True, builder_dirty=False)
    with pytest.raises(release_module.ReleaseError, match=re.escape(reason)):
        release_module.build_version(project, revision)


def test_a_patch_entry_without_additions_and_a_minor_one_with_them_pass(tmp_path):
    """The other side of the ### Added rule: fixes alone may be a patch release, additions a minor one."""
    release_module = hub_release()
    revision = release_module.Revision(commit="0123456789" * 4, dirty=False, in_git=True, builder_dirty=False)
    for source, changelog in (("1.0.1.dev0", "## [1.0.1] - unreleased\n\n### Fixed\n- x\n\n## [1.0.0] - 2026-12-02\n"),
                              ("1.1.0.dev0", CHANGELOG_PREPARING)):
        project = version_project(tmp_path / source, source, changelog)
        assert release_module.build_version(project, revision) == f"{source}+g0123456"


@requires_git
def test_build_id_marks_a_dirty_tree(tmp_path):
    repo = make_release_repo(tmp_path / "repo")
    head = git(repo, "rev-parse", "HEAD")[:7]

    def built_metadata() -> dict:
        result = run_script(repo, "build", env=clean_env())
        assert result.returncode == 0, result.stderr
        return json.loads((repo / "build" / "torch-cuda" / "metadata.json").read_text())

    clean = built_metadata()
    assert clean["id"] == f"_moe_dispatch_cuda_{head}" and clean["provenance"]["kernel"]["dirty"] is False
    (repo / "notes.txt").write_text("untracked\n")  # kernel-builder counts tracked changes only
    assert built_metadata()["id"] == f"_moe_dispatch_cuda_{head}"
    with open(repo / "torch-ext" / "moe_dispatch" / "__init__.py", "a") as f:
        f.write("# local edit\n")
    dirty = built_metadata()
    assert dirty["id"] == f"_moe_dispatch_cuda_{head}_dirty" and dirty["provenance"]["kernel"]["dirty"] is True
    assert dirty["provenance"]["kernel-builder"]["dirty"] is False  # scripts/build itself is unchanged


def test_build_outside_a_git_checkout_is_marked_dirty(tmp_path):
    tree = tmp_path / "tree"
    for rel in ("build.toml", "CHANGELOG.md", "scripts/_hub_release.py", "scripts/build", "torch-ext/moe_dispatch"):
        copy = shutil.copytree if (ROOT / rel).is_dir() else shutil.copy2
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        copy(ROOT / rel, tree / rel)
    env = clean_env(MOE_DISPATCH_COMMIT="0123456789abcdef", GIT_CEILING_DIRECTORIES=str(tmp_path))
    result = run_script(tree, "build", env=env)
    assert result.returncode == 0, result.stderr
    metadata = json.loads((tree / "build" / "torch-rocm" / "metadata.json").read_text())
    assert metadata["id"] == "_moe_dispatch_rocm_0123456_dirty"
    assert "kernel" not in metadata["provenance"]  # no git: the kernel's revision is unknown
    want = f"{checkout_version()}+g0123456.dirty"
    assert built_version(tree / "build" / "torch-rocm") == want  # no git, no tags: the tree's version


@requires_git
def test_build_refuses_files_pyext_would_drop(tmp_path):
    repo = make_release_repo(tmp_path / "repo")
    (repo / "torch-ext" / "moe_dispatch" / "configs" / "notes.txt").write_text("not shipped\n")
    result = run_script(repo, "build", env=clean_env())
    assert result.returncode == 2 and "notes.txt" in result.stderr and "pyext" in result.stderr


def test_each_variant_loads_with_get_local_kernel(built):
    from kernels import get_local_kernel

    for variant in VARIANTS:
        module = get_local_kernel(built / variant)
        assert module.__name__ == json.loads((built / variant / "metadata.json").read_text())["id"]
        assert Path(module.__file__).parent == built / variant
        check_forward(module)
        # v1 module paths under the variant's own module name (its __init__ registers them in sys.modules)
        assert importlib.import_module(f"{module.__name__}.fp8") is module.formats.fp8 is module.fp8
        assert importlib.import_module(f"{module.__name__}.tiles") is module.host.tiles is module.tiles
    # The build root: the loader picks this machine's variant.
    assert Path(get_local_kernel(built).__file__).parent.name == PREFERRED_VARIANT


def test_get_kernel_version_1_through_local_kernels(built):
    module = kernel_build.get_kernel_from(built, REPO_ID)  # LOCAL_KERNELS=<repo>=<build root>, get_kernel(version=1)
    assert Path(module.__file__).parent.name == PREFERRED_VARIANT
    check_forward(module)
    for variant in VARIANTS:  # a path to one variant directory loads that variant on any machine
        module = kernel_build.get_kernel_from(built / variant, REPO_ID)
        assert Path(module.__file__).parent == built / variant
        check_forward(module)


# -- scripts/publish against the Hub test double ---------------------------------------------------------------------

def test_publish_refuses_a_hub_client_without_kernel_repo_commits(monkeypatch):
    import huggingface_hub

    release_module = hub_release()
    monkeypatch.setattr(huggingface_hub, "__version__", "1.33.0")
    with pytest.raises(release_module.ReleaseError, match="cannot commit to kernel repos"):
        release_module.check_hub_client()


@requires_git
def test_git_blob_id_is_gits_object_id(tmp_path):
    """The one blob hash, used by scripts/publish and by the Hub's test double, is git's own object id."""
    path = tmp_path / "file"
    path.write_bytes(b"moe\0dispatch\n")
    git_id = subprocess.run(["git", "hash-object", str(path)], capture_output=True, text=True, check=True).stdout
    assert hub_release().git_blob_id(path.read_bytes()) == git_id.strip()


@pytest.fixture(scope="module")
def hub():
    with HubServer(token=TOKEN) as server:
        yield server


def publish(repo: Path, hub: HubServer, *args: str, token: str | None = TOKEN) -> subprocess.CompletedProcess:
    env = clean_env(HF_ENDPOINT=hub.url, HF_HOME=str(repo.parent / "publisher_hf_home"))
    if token:
        env["HF_TOKEN"] = token
    return run_script(repo, "publish", "--repo-id", REPO_ID, *args, env=env)


def release(repo: Path, hub: HubServer, version: str) -> str:
    """The release flow: scripts/release tags it on branch v1 and opens the next patch on main, then CI's command,
    on a checkout of the tag, builds and publishes it. Returns the Hub commit of the tag."""
    result = run_script(repo, "release", version, env=clean_env(**GIT_ENV))
    assert result.returncode == 0, result.stdout + result.stderr
    tag = f"v{version}"
    assert git(repo, "rev-parse", f"{tag}^{{commit}}") == git(repo, "rev-parse", "v1") == git(repo, "rev-parse", "HEAD~1")
    assert git(repo, "cat-file", "-t", tag) == "tag"  # annotated
    major, minor, patch = version.split(".")
    assert git(repo, "log", "-1", "--format=%s") == f"Open {major}.{minor}.{int(patch) + 1}.dev0 after {tag}"
    git(repo, "checkout", "-q", tag)  # what CI checks out on the pushed tag
    try:
        ci_args = CI_PUBLISH.split("scripts/publish ", 1)[1].replace('"$GITHUB_REF_NAME"', tag).split()
        result = publish(repo, hub, *ci_args)
        assert result.returncode == 0, result.stdout + result.stderr
    finally:
        git(repo, "checkout", "-q", "main")
    return hub.state.repos[("kernel", REPO_ID)].tags[tag]


def hub_client_can_publish() -> bool:
    release_module = hub_release()
    try:
        release_module.check_hub_client()
    except release_module.ReleaseError:
        return False
    return True


@pytest.fixture(scope="module")
def releases(hub, tmp_path_factory):
    """v1.0.0, a `kernels lock` of version 1 taken then, and v1.1.0 with a changed file, all on the test double."""
    if not HAS_GIT:
        pytest.skip("needs the git command")
    if not hub_client_can_publish():  # e.g. a GPU image whose huggingface_hub predates kernel-repo commits
        import huggingface_hub

        pytest.skip(f"scripts/publish refuses huggingface_hub {huggingface_hub.__version__} (needs >= 2.4)")
    try:  # the `kernels` command must import: it imports sigstore eagerly, whose `cryptography` some images lack
        importlib.import_module("kernels.cli")
    except ImportError as e:
        pytest.skip(f"the kernels command does not import here: {e}")
    base = tmp_path_factory.mktemp("releases")
    repo = make_release_repo(base / "repo")
    first = release(repo, hub, "1.0.0")

    project = base / "consumer"
    project.mkdir()
    (project / "pyproject.toml").write_text(
        f'[project]\nname = "consumer"\nversion = "0.1.0"\n\n[tool.kernels.dependencies]\n"{REPO_ID}" = 1\n')
    # `kernels lock` (0.17.2) has no trust_remote_code switch: it only locks kernels of trusted publishers.
    hub.state.trusted_orgs.add("org")
    result = subprocess.run([*cli("kernels"), "lock", str(project)], capture_output=True, text=True,
                            env=clean_env(HF_ENDPOINT=hub.url, HF_HOME=str(base / "lock_hf_home")))
    hub.state.trusted_orgs.discard("org")
    assert result.returncode == 0, result.stderr

    init = repo / "torch-ext" / "moe_dispatch" / "__init__.py"
    init.write_text(init.read_text() + "# release v1.1.0\n")
    changelog = repo / "CHANGELOG.md"  # the opened 1.0.1 becomes 1.1.0: it adds to the API
    changelog.write_text(changelog.read_text().replace("## [1.0.1] - unreleased\n", "## [1.1.0] - unreleased\n\n"
                                                       "### Added\n- A change.\n", 1))
    hub_release().set_source_version(repo / "torch-ext" / "moe_dispatch" / "_version.py", "1.1.0.dev0")
    git(repo, "commit", "-q", "-am", "change for v1.1.0")
    second = release(repo, hub, "1.1.0")
    return {"repo": repo, "v1.0.0": first, "v1.1.0": second, "lockfile": project / "kernels.lock", "base": base}


def test_release_layout_on_the_hub(hub, releases):
    repo = hub.state.repos[("kernel", REPO_ID)]
    first, second = releases["v1.0.0"], releases["v1.1.0"]
    assert repo.branches["v1"] == second and repo.tags == {"v1.0.0": first, "v1.1.0": second}
    assert first != second and repo.commits[second].parent == first  # v1 history: release after release
    files = repo.commits[second].files
    for variant in VARIANTS:
        assert {p.split("/", 2)[2] for p in files if p.startswith(f"build/{variant}/")} == \
            package_files() | GENERATED
    benchmarks = {p for p in files if p.startswith("benchmarks/")}  # the Hub's benchmark convention, beside build/
    assert benchmarks == {f"benchmarks/{p.name}" for p in (ROOT / "benchmarks").glob("*.py")}
    assert "benchmarks/benchmark_moe.py" in benchmarks
    assert b"# release v1.1.0" in files["build/torch-cpu/__init__.py"]
    assert b"# release v1.1.0" not in repo.commits[first].files["build/torch-cpu/__init__.py"]
    for commit, version in ((first, "1.0.0"), (second, "1.1.0")):  # each release's files carry its version
        for variant in VARIANTS:
            assert f'__version__ = "{version}"'.encode() in repo.commits[commit].files[f"build/{variant}/_version.py"]
            metadata = json.loads(repo.commits[commit].files[f"build/{variant}/metadata.json"])
            assert metadata["provenance"]["kernel"]["dirty"] is False and "_dirty" not in metadata["id"]
    card = repo.resolve("main").files["README.md"].decode()
    assert card.startswith("---\nlibrary_name: kernels\nlicense: apache-2.0\n")  # the builder's card fields
    assert f"available at {SOURCE_URL}" in card and "## Available functions" in card
    assert f'get_kernel("{REPO_ID}", version=1' in card and 'revision="v1.1.0"' in card and "kernels lock" in card
    assert f"kernels benchmark {REPO_ID}@v1" in card
    for name in ("fused_moe_forward", "fused_experts", "moe_router", "grouped_gemm"):
        assert f"`{name}`" in card
    assert hub.state.unhandled == []


CLIENT = """
import json
from kernels import get_kernel
from test_packaging import check_forward, snapshot_of

report = {}
try:
    get_kernel("REPO_ID", version=1)
except ValueError as e:
    report["untrusted"] = str(e)
newest = get_kernel("REPO_ID", version=1, trust_remote_code=True)
check_forward(newest)
pinned = get_kernel("REPO_ID", revision="v1.0.0", trust_remote_code=True)
check_forward(pinned)
report["newest"], report["pinned"] = snapshot_of(newest), snapshot_of(pinned)
report["versions"] = [newest.__version__, pinned.__version__]
report["newest_marked"] = "# release v1.1.0" in open(newest.__file__).read()
report["pinned_marked"] = "# release v1.1.0" in open(pinned.__file__).read()
try:
    get_kernel("REPO_ID", version=2, trust_remote_code=True)
except ValueError as e:
    report["version_2"] = str(e)
print(json.dumps(report))
""".replace("REPO_ID", REPO_ID)


def test_fresh_client_gets_newest_v1_pinned_release_and_version_error(hub, releases, tmp_path):
    report = run_python(CLIENT, clean_env(HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path / "hf_home")))
    assert "not from a trusted publisher" in report["untrusted"]
    assert report["newest"] == [releases["v1.1.0"], PREFERRED_VARIANT] and report["newest_marked"]
    assert report["pinned"] == [releases["v1.0.0"], PREFERRED_VARIANT] and not report["pinned_marked"]
    assert report["version_2"] == "Version 2 not found, available versions: 1"
    assert report["versions"] == ["1.1.0", "1.0.0"]  # __version__ of each release build (PEP 440)
    assert all(str(Version(v)) == v for v in report["versions"])


LOCKED_CLIENT = """
import json, subprocess
from pathlib import Path
from kernels import get_locked_kernel, load_kernel
from test_packaging import check_forward, snapshot_of

report = {}
lockfile = Path(LOCKFILE)
try:  # after `kernels download`: one variant in the cache, and the snapshot counts as incomplete
    load_kernel("REPO_ID", lockfile=lockfile)
except FileNotFoundError as e:
    report["after_kernels_download"] = str(e)
subprocess.run([*HF_CMD, "download", "REPO_ID", "--repo-type", "kernel", "--revision", COMMIT], check=True,
               capture_output=True)
module = load_kernel("REPO_ID", lockfile=lockfile)
check_forward(module)
report["locked"] = snapshot_of(module)
report["get_locked"] = snapshot_of(get_locked_kernel("REPO_ID", lockfile=lockfile, trust_remote_code=True))
print(json.dumps(report))
"""


def test_kernels_lock_then_load_kernel_reproduces_the_locked_commit(hub, releases, tmp_path):
    locks = json.loads(releases["lockfile"].read_text())
    assert locks == [{"dependency": {"repo-id": REPO_ID, "version": 1}, "lock": {"commit": releases["v1.0.0"]}}]
    env = clean_env(HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path / "hf_home"))
    result = subprocess.run([*cli("kernels"), "download", str(releases["lockfile"].parent)], env=env,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    code = (LOCKED_CLIENT.replace("REPO_ID", REPO_ID).replace("LOCKFILE", repr(str(releases["lockfile"])))
            .replace("HF_CMD", repr(cli("hf"))).replace("COMMIT", repr(releases["v1.0.0"])))
    report = run_python(code, env)
    # Documented in docs/releasing.md: load_kernel needs the commit's whole snapshot (kernels 0.17.2 with
    # huggingface_hub 2.4), which `kernels download` does not fetch; `hf download --revision <commit>` does.
    assert "Cannot find a local snapshot" in report["after_kernels_download"]
    # v1 has moved on to v1.1.0; the lock still loads the commit it recorded.
    assert report["locked"] == report["get_locked"] == [releases["v1.0.0"], PREFERRED_VARIANT]


def test_publishing_the_same_release_again_changes_nothing(hub, releases):
    repo_state = hub.state.repos[("kernel", REPO_ID)]
    refs_before = (dict(repo_state.branches), dict(repo_state.tags), len(repo_state.commits))
    n_requests = len(hub.state.requests)
    git(releases["repo"], "checkout", "-q", "v1.1.0")  # the tag on HEAD, as CI checks it out
    try:
        result = publish(releases["repo"], hub)
    finally:
        git(releases["repo"], "checkout", "-q", "main")
    assert result.returncode == 0, result.stderr
    assert "already points to" in result.stdout and "nothing to do" in result.stdout
    assert (dict(repo_state.branches), dict(repo_state.tags), len(repo_state.commits)) == refs_before
    writes = [(m, p) for m, p in hub.state.requests[n_requests:] if m != "GET" and m != "HEAD"]
    assert writes == [("POST", "/api/repos/create")]  # exist_ok: answered 409, nothing created


def test_publish_refuses_to_move_a_release_tag_or_go_back(hub, releases, tmp_path):
    repo_state = hub.state.repos[("kernel", REPO_ID)]
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(releases["repo"]), str(clone)], check=True, capture_output=True)
    init = clone / "torch-ext" / "moe_dispatch" / "__init__.py"
    init.write_text(init.read_text() + "# another change\n")
    git(clone, "commit", "-q", "-am", "another change")
    before = (dict(repo_state.branches), dict(repo_state.tags), len(repo_state.commits))
    version_file = clone / "torch-ext" / "moe_dispatch" / "_version.py"
    changelog = clone / "CHANGELOG.md"
    # The records of a release commit made here: the entry scripts/release opened after v1.1.0 taken out again.
    released = changelog.read_text().replace("## [1.1.1] - unreleased\n\n", "", 1)
    for tag, reason in (("v1.1.0", "already exists"), ("v1.0.1", "newer v1 releases exist")):
        git(clone, "tag", "-d", "v1.1.0")  # the tag under test is the one on HEAD, and the release the tree records
        hub_release().set_source_version(version_file, tag[1:])
        # The records of a 1.0.1 made on a tree that never had 1.1.0: its dated entry is the newest.
        changelog.write_text(re.sub(r"^## \[1\.1\.0\]", f"## [{tag[1:]}]", released, flags=re.M))
        git(clone, "commit", "-q", "-am", f"source version {tag[1:]}")
        git(clone, "tag", tag)
        assert run_script(clone, "build", env=clean_env()).returncode == 0
        result = publish(clone, hub, "--tag", tag)
        assert result.returncode == 2 and reason in result.stderr, result.stderr
    assert (dict(repo_state.branches), dict(repo_state.tags), len(repo_state.commits)) == before


def _tag_major_mismatch(repo):
    git(repo, "tag", "v2.0.0")
    return ["--tag", "v2.0.0"], "has major 2 but build.toml has version = 1"


def _malformed_tag(repo):
    git(repo, "tag", "v1.0")
    return ["--tag", "v1.0"], "not of the form v<major>.<minor>.<patch>"


def _dirty_tree(repo):
    git(repo, "tag", "v1.0.0")
    with open(repo / "build.toml", "a") as f:
        f.write("# uncommitted\n")
    return [], "the git tree is dirty"


def _tag_not_on_head(repo):
    git(repo, "tag", "v1.0.0")
    git(repo, "commit", "-q", "--allow-empty", "-m", "after the tag")
    return ["--tag", "v1.0.0"], "not HEAD"


def _release_commit(repo):
    """The commit scripts/release 1.0.0 makes, without its tag: CHANGELOG.md dates 1.0.0, _version.py says 1.0.0."""
    changelog = repo / "CHANGELOG.md"
    changelog.write_text(changelog.read_text().replace("## [1.0.0] - unreleased", "## [1.0.0] - 2026-12-02", 1))
    hub_release().set_source_version(repo / "torch-ext" / "moe_dispatch" / "_version.py", "1.0.0")
    git(repo, "commit", "-q", "-am", "Release v1.0.0")


def _stale_commit(repo):
    _release_commit(repo)  # after the build
    git(repo, "tag", "v1.0.0")
    return [], "build is stale"


def _tag_and_build(repo, tag):
    """A build of a tagged commit: a release build when the tree records the tag's release."""
    git(repo, "tag", tag)
    assert run_script(repo, "build", env=clean_env()).returncode == 0


def _stale_files(repo):
    _release_commit(repo)
    _tag_and_build(repo, "v1.0.0")
    with open(repo / "build" / "torch-rocm" / "moe.py", "a") as f:
        f.write("# edited after the build\n")
    return [], "torch-rocm differs from torch-ext/moe_dispatch in ['moe.py']"


def _build_before_the_tag(repo):
    _release_commit(repo)
    assert run_script(repo, "build", env=clean_env()).returncode == 0  # says 1.0.0+g<commit>: no tag confirms it
    git(repo, "tag", "v1.0.0")  # the build (made before) is not 1.0.0's (and so its digest)
    return [], "torch-cpu differs from torch-ext/moe_dispatch in ['_version.py', 'metadata.json']"


def _tag_the_tree_does_not_record(repo):
    git(repo, "tag", "v1.0.0")  # on the tree before its release: CHANGELOG.md says 1.0.0 is unreleased
    result = run_script(repo, "build", env=clean_env())
    assert result.returncode == 0 and "warning: HEAD carries the tag v1.0.0 but CHANGELOG.md does not date 1.0.0" \
        in result.stdout, result.stdout + result.stderr
    assert re.fullmatch(r"1\.0\.0\.dev0\+g[0-9a-f]{7}", built_version(repo / "build" / "torch-cpu"))
    return [], "CHANGELOG.md does not date 1.0.0 (its entry says unreleased; _version.py says 1.0.0.dev0)"


def _tag_other_than_the_source_version(repo):
    _tag_and_build(repo, "v1.0.1")  # the source says 1.0.0.dev0: scripts/release would have set 1.0.1
    return [], "says 1.0.0.dev0; scripts/release 1.0.1 sets it"


def _missing_token(repo):
    _release_commit(repo)
    _tag_and_build(repo, "v1.0.0")
    return [], "HF_TOKEN is not set"


REFUSALS = [_tag_major_mismatch, _malformed_tag, _dirty_tree, _tag_not_on_head, _stale_commit, _stale_files,
            _build_before_the_tag, _tag_other_than_the_source_version, _tag_the_tree_does_not_record, _missing_token]


@requires_git
@pytest.mark.parametrize("case", REFUSALS, ids=[case.__name__.strip("_") for case in REFUSALS])
def test_publish_refuses_and_sends_nothing(hub, tmp_path, case):
    repo = make_release_repo(tmp_path / "repo")
    assert run_script(repo, "build", env=clean_env()).returncode == 0
    args, reason = case(repo)
    n_requests = len(hub.state.requests)
    result = publish(repo, hub, *args, token=None if case is _missing_token else TOKEN)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "refusing to publish" in result.stderr and reason in result.stderr, result.stderr
    assert hub.state.requests[n_requests:] == []


def _release_major_mismatch(repo):
    return "2.0.0", "has major 2 but build.toml has version = 1"


def _release_dirty_tree(repo):
    (repo / "notes.txt").write_text("untracked\n")
    return "1.0.0", "the git tree is dirty"


def _release_without_changelog_entry(repo):
    return "1.0.1", "CHANGELOG.md has no entry for 1.0.1"


def _release_tag_exists(repo):
    git(repo, "tag", "v1.0.0")
    return "1.0.0", "tag v1.0.0 exists already"


def _release_older_than_a_tag(repo):
    git(repo, "tag", "v1.2.0")
    return "1.0.0", "release tags newer than v1.0.0 exist (v1.2.0)"


def _release_again_in_a_clone_without_tags(repo):
    assert run_script(repo, "release", "1.0.0", env=clean_env(**GIT_ENV)).returncode == 0
    git(repo, "tag", "-d", "v1.0.0")
    git(repo, "branch", "-D", "v1")  # what a clone of main alone has: the release commit and the next, no tag, no v1
    return "1.0.0", ("the tree prepares 1.0.1 (torch-ext/moe_dispatch/_version.py, CHANGELOG.md): "
                     "1.0.0 is not after")


def _release_again_on_its_commit_without_tags(repo):
    assert run_script(repo, "release", "1.0.0", env=clean_env(**GIT_ENV)).returncode == 0
    git(repo, "tag", "-d", "v1.0.0")
    git(repo, "branch", "-D", "v1")
    git(repo, "checkout", "-q", "--detach", "HEAD~1")  # the release commit itself
    return "1.0.0", ("the tree records release 1.0.0 (torch-ext/moe_dispatch/_version.py, CHANGELOG.md): "
                     "1.0.0 is not after")


def _release_rewriting_branch_v1(repo):
    git(repo, "branch", "v1")
    git(repo, "checkout", "-q", "v1")
    git(repo, "commit", "-q", "--allow-empty", "-m", "only on v1")
    git(repo, "checkout", "-q", "main")
    return "1.0.0", "branch v1 is not an ancestor of HEAD"


RELEASE_REFUSALS = [_release_major_mismatch, _release_dirty_tree, _release_without_changelog_entry,
                    _release_tag_exists, _release_older_than_a_tag, _release_again_in_a_clone_without_tags,
                    _release_again_on_its_commit_without_tags, _release_rewriting_branch_v1]


@requires_git
@pytest.mark.parametrize("case", RELEASE_REFUSALS, ids=[case.__name__.strip("_") for case in RELEASE_REFUSALS])
def test_release_refuses_and_changes_nothing(tmp_path, case):
    repo = make_release_repo(tmp_path / "repo")
    version, reason = case(repo)
    refs = git(repo, "show-ref")
    status = git(repo, "status", "--porcelain")
    result = run_script(repo, "release", version, env=clean_env(**GIT_ENV))
    assert result.returncode == 2 and "refusing to release" in result.stderr and reason in result.stderr, \
        result.stdout + result.stderr
    assert git(repo, "show-ref") == refs and git(repo, "status", "--porcelain") == status


@requires_git
def test_release_dates_the_changelog_sets_the_version_and_opens_the_next(tmp_path):
    """scripts/release 1.0.0: the release commit (entry dated, _version.py 1.0.0) carries the tag and branch v1; main
    goes on with 1.0.1.dev0 (an `unreleased` entry above the release), so no later commit says it is 1.0.0. Each
    commit's build reports its checkout's version."""
    repo = make_release_repo(tmp_path / "repo")
    result = run_script(repo, "release", "1.0.0", env=clean_env(**GIT_ENV))
    assert result.returncode == 0, result.stderr
    assert git(repo, "log", "-2", "--format=%s").splitlines() == ["Open 1.0.1.dev0 after v1.0.0", "Release v1.0.0"]
    assert 'git push origin v1 v1.0.0' in result.stdout
    assert git(repo, "rev-parse", "--abbrev-ref", "HEAD") == "main"  # the branch it ran on; v1 follows releases
    assert git(repo, "rev-parse", "v1") == git(repo, "rev-parse", "v1.0.0^{commit}") == git(repo, "rev-parse", "HEAD~1")
    version_file = repo / "torch-ext" / "moe_dispatch" / "_version.py"
    changelog = (repo / "CHANGELOG.md").read_text()
    assert re.search(r"^## \[1\.0\.1\] - unreleased\n\n## \[1\.0\.0\] - \d{4}-\d\d-\d\d$", changelog, re.M), changelog
    assert '__version__ = "1.0.1.dev0"' in version_file.read_text()
    assert run_script(repo, "build", env=clean_env()).returncode == 0
    head = git(repo, "rev-parse", "HEAD")[:7]
    assert built_version(repo / "build" / "torch-cpu") == f"1.0.1.dev0+g{head}"  # past 1.0.0, as the checkout says
    git(repo, "checkout", "-q", "v1.0.0")
    assert '__version__ = "1.0.0"' in version_file.read_text()
    assert run_script(repo, "build", env=clean_env()).returncode == 0
    assert built_version(repo / "build" / "torch-cpu") == "1.0.0"  # the release build


@requires_git
def test_release_on_branch_v1_opens_nothing(tmp_path):
    """Released from branch v1 itself, the release commit stays its tip: the next version is opened elsewhere."""
    repo = make_release_repo(tmp_path / "repo")
    git(repo, "checkout", "-q", "-b", "v1")
    result = run_script(repo, "release", "1.0.0", env=clean_env(**GIT_ENV))
    assert result.returncode == 0, result.stderr
    assert git(repo, "log", "-1", "--format=%s") == "Release v1.0.0" and "open 1.0.1.dev0 on your" in result.stdout
    assert git(repo, "rev-parse", "HEAD") == git(repo, "rev-parse", "v1.0.0^{commit}") == git(repo, "rev-parse", "v1")


@requires_git
def test_a_clone_without_tags_builds_the_version_its_files_say(tmp_path):
    """The version comes from the tree: a clone that has neither the tags nor branch v1 (they live where the release
    was made and on the Hub) builds 1.0.1.dev0+g<commit> after the release, and 1.0.0+g<commit> on the release commit
    (the release's files, no tag confirming them); scripts/publish refuses the untagged tree."""
    repo = make_release_repo(tmp_path / "repo")
    assert run_script(repo, "release", "1.0.0", env=clean_env(**GIT_ENV)).returncode == 0
    git(repo, "commit", "-q", "--allow-empty", "-m", "after the release")
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", "--no-tags", "--single-branch", "--branch", "main", str(repo), str(clone)],
                   check=True, capture_output=True)
    assert git(clone, "tag", "--list") == "" and git(clone, "branch", "--list", "v1") == ""
    commits = [git(clone, "rev-parse", rev) for rev in ("HEAD", "HEAD~1", "HEAD~2")]  # after, the opening, the release
    for commit, want in zip(commits, ("1.0.1.dev0", "1.0.1.dev0", "1.0.0")):
        git(clone, "checkout", "-q", "--detach", commit)
        result = run_script(clone, "build", env=clean_env())
        assert result.returncode == 0 and "warning: HEAD carries" not in result.stdout, result.stdout + result.stderr
        assert built_version(clone / "build" / "torch-cpu") == f"{want}+g{git(clone, 'rev-parse', 'HEAD')[:7]}"
    result = run_script(clone, "publish", "--dry-run", env=clean_env())
    assert result.returncode == 2 and "HEAD carries no git tag" in result.stderr, result.stderr


@requires_git
def test_dry_run_prints_every_step_and_sends_nothing(hub, tmp_path):
    repo = make_release_repo(tmp_path / "repo")
    _release_commit(repo)
    _tag_and_build(repo, "v1.0.0")
    n_requests = len(hub.state.requests)
    result = publish(repo, hub, "--dry-run", token=None)
    assert result.returncode == 0, result.stderr
    assert hub.state.requests[n_requests:] == []
    out = result.stdout
    for step in ("create kernel repo", "README.md", "create branch v1", "commit to v1", "deleting files",
                 "create tag v1.0.0", "nothing was sent"):
        assert step in out, step
    for variant in VARIANTS:
        assert f"build/{variant}/metadata.json" in out and f"build/{variant}/_ops.py" in out
        assert f"build/{variant}/_version.py" in out
    assert "benchmarks/benchmark_moe.py" in out


def _package_modules() -> dict:
    """The package's modules by dotted name below it ("moe", "gemm.jit"; a sub-package is its __init__.py, the top one
    "__init__") -> (source, its own package as dotted parts)."""
    folder = ROOT / "torch-ext" / "moe_dispatch"
    modules = {}
    for path in sorted(folder.rglob("*.py")):
        parts = path.relative_to(folder).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts) or "__init__"
        modules[name] = (path.read_text(), parts[:-1])
    return modules


def _package_imports(source: str, package: tuple, modules) -> dict:
    """{module of the package: names imported from it} for a module's top-level relative imports (function-level
    imports are not counted: they are how a cycle hides, and the test below wants none of those either);
    `from .gemm import jit` counts as an import of gemm.jit."""
    import ast

    found = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.ImportFrom) and node.level:
            base = list(package[:len(package) - (node.level - 1)]) + (node.module.split(".") if node.module else [])
            for alias in node.names:
                submodule = ".".join(base + [alias.name])
                if submodule in modules:
                    found.setdefault(submodule, set())
                else:
                    found.setdefault(".".join(base) or "__init__", set()).add(alias.name)
    return found


def _jit_functions(source: str) -> set:
    """Names of a module's top-level (or top-level `if`-nested) `@triton.jit` functions."""
    import ast

    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in node.decorator_list):
            found.add(node.name)
    return found


# The layers of the package (the top __init__.py's docstring draws them): a module imports only from its own
# sub-package and from layers before its own.
LAYERS = (("_ops", "_version", "reference_moe", "reference_checks"), ("reference_binned", "reference_quant"),
          ("reference",), ("host",), ("formats",), ("routing", "dispatch"), ("gemm",),
          ("backward",), ("experts",), ("moe",), ("integrations",), ("parallel",), ("__init__",))


def test_package_import_graph_is_layered_without_cycles_and_the_kernels_floor_imports_nothing():
    """The package's modules import each other without a cycle and along its layers, no module imports another inside
    a function to dodge one, the sub-packages' __init__.py files import nothing (each says what its files hold), and
    the `@triton.jit` floor (gemm/jit.py) imports only the WEIGHT_SCALE codes, which import nothing."""
    import ast

    modules = _package_modules()
    sources = {name: source for name, (source, _) in modules.items()}
    imports = {name: _package_imports(source, package, modules) for name, (source, package) in modules.items()}
    graph = {name: set(found) for name, found in imports.items()}
    assert {"gemm.jit", "host.replay", "dispatch.segments", "gemm.planner"} <= set(graph), sorted(graph)
    assert graph["gemm.jit"] == {"formats.scale_codes"} and graph["formats.scale_codes"] == set()
    for name, text in sources.items():
        nested = [node.module for node in ast.walk(ast.parse(text)) if isinstance(node, ast.ImportFrom)
                  and node.level and node.col_offset > 0]
        assert name == "__init__" or not nested, (name, nested)
        if name != "__init__" and "." not in name and modules[name][1]:  # a sub-package's __init__.py
            assert not graph[name] and ast.get_docstring(ast.parse(text)), name

    layer = {top: index for index, tops in enumerate(LAYERS) for top in tops}
    assert {name.split(".")[0] for name in graph} == set(layer), "a module outside LAYERS"
    for name, deps in graph.items():
        for dep in deps:
            top, dep_top = name.split(".")[0], dep.split(".")[0]
            assert top == dep_top or layer[dep_top] < layer[top], f"{name} imports {dep}: against the layers"

    done, path = set(), []

    def visit(name):
        assert name not in path, f"import cycle: {' -> '.join(path[path.index(name):] + [name])}"
        if name in done:
            return
        path.append(name)
        for dep in sorted(graph[name] - {"__init__"}):
            visit(dep)
        path.pop()
        done.add(name)

    for name in sorted(graph):
        visit(name)

    # The planner decides which kernel runs and launches nothing: no module under it starts a kernel.
    below, stack = set(), ["gemm.planner"]
    while stack:
        for dep in graph[stack.pop()] - below:
            below.add(dep)
            stack.append(dep)
    launchers = {name for name in below | {"gemm.planner"} if re.search(r"\blaunch(_gather)?\(", sources[name])}
    assert not launchers, f"the planner reaches modules that launch kernels: {sorted(launchers)}"

    # The kernels floor: modules whose `@triton.jit` helpers other modules import hold no launcher and import only
    # the floor and host-side base modules (no stage, no launcher); every launcher lives beside its own kernels.
    floor = {name for name, text in sources.items()
             if any(imports[user].get(name, set()) & _jit_functions(text) for user in sources)}
    assert {"gemm.jit", "gemm.w8a8_jit"} <= floor, floor
    for name in floor:
        assert not re.search(r"\blaunch\(", sources[name]), f"{name} holds shared jit code and launches kernels"
        above = graph[name] - floor - {"host.device", "host.host_math", "formats.scale_codes"}
        assert not above, f"the jit floor module {name} imports {sorted(above)}"

    # The tile choice has one home: only the planner asks the tables (host/tiles.py's select_* functions).
    choosers = {name for name, text in sources.items() if name not in ("gemm.planner", "host.tiles")
                and re.search(r"\bselect_\w*tiles?\(", text)}
    assert not choosers, f"modules choosing tiles outside gemm/planner.py: {sorted(choosers)}"


# Facts the package once wrote in several places, each now defined by one module and imported by the others.
ONE_HOME = {"TMA_ALIGN": "host.device", "tma_readable": "host.device", "_PLAIN_TENSORS": "host.library",
            "DEFAULT_FP8_BLOCK_SHAPE": "formats.fp8", "FP8_DTYPES": "formats.fp8"}


def _top_level_definitions(source: str) -> set:
    """Names a module defines at its top level: assignments, functions and classes (imports are not definitions)."""
    import ast

    names = set()
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        for target in node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]:
            if isinstance(target, ast.Name):
                names.add(target.id)
    return names


def test_each_shared_fact_has_one_home():
    """TMA's alignment and the test of it, the eager paths' plain tensor types, the FP8 block default and the float8
    dtypes are each defined in one module (ONE_HOME), which the others import; the references (reference*.py), which
    import nothing else of the package, keep their own literals."""
    definitions = {name: _top_level_definitions(source) for name, (source, _) in _package_modules().items()}
    for fact, home in ONE_HOME.items():
        homes = sorted(name for name, names in definitions.items() if fact in names)
        assert homes == [home], f"{fact} is defined in {homes}; its one home is {home} (import it from there)"
    assert _top_level_definitions("A = 1\nB: int = 2\ndef f(): pass\nfrom x import C\n") == {"A", "B", "f"}


def test_python_minimum_is_stated_everywhere_and_checked():
    """Python >= 3.11 (tomllib in scripts/build): said in build.toml and the README, refused by scripts/setup-env and the
    release scripts with a clear message, what CI runs (test_workflows above), and the grammar of every source file."""
    import ast

    minimum = hub_release().MIN_PYTHON
    text = ".".join(map(str, minimum))
    assert f"Python >= {text}" in (ROOT / "build.toml").read_text()
    assert f"Python >= {text}" in (ROOT / "README.md").read_text()
    assert f'min_python="{text}"' in (ROOT / "scripts" / "setup-env").read_text()
    assert sys.version_info >= minimum
    sources = [*ROOT.glob("torch-ext/moe_dispatch/**/*.py"), *ROOT.glob("scripts/*.py"), *ROOT.glob("benchmarks/*.py"),
               *ROOT.glob("examples/*.py"), *ROOT.glob("tests/*.py"),
               *(ROOT / "scripts" / name for name in ("build", "publish", "release"))]
    assert ROOT / "examples" / "ep_example.py" in sources  # the globs found the folders
    for path in sources:
        ast.parse(path.read_text(), filename=str(path), feature_version=minimum)
    # What an older interpreter sees: the check at the top of _hub_release (which scripts/build imports) exits first.
    source = (ROOT / "scripts" / "_hub_release.py").read_text()
    code = ("import sys; sys.version_info = (3, 10, 12, 'final', 0); sys.version = '3.10.12'; "
            f"exec(compile({source!r}, '_hub_release.py', 'exec'), {{'__name__': '_hub_release'}})")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 1 and f"need Python >= {text} (tomllib); this is 3.10.12" in result.stderr, result.stderr
