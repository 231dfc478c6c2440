"""Packaging: build.toml, the noarch build of scripts/build, and the release path of scripts/publish, end to end.

- build.toml passes the parser inside the `kernels` wheel; flake.nix is in the builder's form.
- scripts/build writes build/torch-{cuda,rocm,universal}: each loads with `kernels.get_local_kernel` and through
  `LOCAL_KERNELS` + `get_kernel(..., version=1)`, and its forward matches `fused_moe_forward_ref`.
- scripts/publish, against tests/hub_server.py (a loopback test double of the Hub's HTTP API): two releases, then
  fresh client processes load the newest v1, the pinned v1.0.0 and a `kernels lock`ed commit, and a version-2
  request fails with the loader's error. Every refusal of scripts/publish sends nothing.

Releases are made from a throw-away git repo holding a copy of this checkout's working tree, so the tests do not
depend on whether this checkout is clean. On a CPU-only machine the loader accepts only `torch-universal` (and
`torch-cpu`) from a repo, and `backend=` can only name "cpu" or the machine's own backend; the cuda and rocm
variants are therefore loaded by pointing `get_local_kernel` / `LOCAL_KERNELS` at the variant directory itself.
"""

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

from hub_server import HubServer
from reference import fused_moe_forward_ref

ROOT = Path(__file__).resolve().parents[1]
# What the client processes import by name: test_packaging and hub_server (tests/), the float64 references
# (benchmarks/) and _hub_release (scripts/), the folders conftest.py puts on sys.path here.
CLIENT_PATH = [str(ROOT / folder) for folder in ("tests", "benchmarks", "scripts")]
REPO_ID = "org/moe-dispatch"  # the test double's repo; the real id lives in build.toml only
TOKEN = "hf_test_token"
VARIANTS = ("torch-cuda", "torch-rocm", "torch-universal")
BACKEND_OF = {"torch-cuda": ("cuda", "cuda"), "torch-rocm": ("rocm", "rocm"), "torch-universal": ("universal", "cuda")}
ON_CUDA = torch.cuda.is_available() and torch.version.cuda is not None
# The variant the loader picks from a full build on this machine.
PREFERRED_VARIANT = "torch-cuda" if ON_CUDA else "torch-rocm" if torch.cuda.is_available() else "torch-universal"
RELEASE_FILES = ["build.toml", "flake.nix", "LICENSE", ".gitignore", "README.md", "docs", "benchmarks",
                 "scripts/_hub_release.py", "scripts/build", "scripts/publish", "torch-ext/moe_dispatch"]
HAS_GIT = shutil.which("git") is not None
requires_git = pytest.mark.skipif(not HAS_GIT, reason="needs the git command")
GIT_ENV = {"GIT_AUTHOR_NAME": "release-test", "GIT_AUTHOR_EMAIL": "release-test@example.invalid",
           "GIT_COMMITTER_NAME": "release-test", "GIT_COMMITTER_EMAIL": "release-test@example.invalid"}


# -- helpers (also imported by the client processes of the end-to-end tests) ------------------------------------------

def check_forward(module) -> None:
    """One small forward through the loaded kernel (T=4, H=32, F=32, E=4, top_k=2) against the float64 reference."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(0)
    T, H, F, E, top_k = 4, 32, 32, 4, 2
    x = torch.randn(T, H, generator=gen)
    router = torch.randn(E, H, generator=gen)
    w_gate, w_up = (torch.randn(E, F, H, generator=gen) * 0.2 for _ in range(2))
    w_down = torch.randn(E, H, F, generator=gen) * 0.2
    args = [t.to(device) for t in (x, router, w_gate, w_up, w_down)]
    out, ids, weights = module.fused_moe_forward(*args, E, top_k)
    ref_out, ref_ids, ref_weights = fused_moe_forward_ref(*args, E, top_k)
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
    git(path, "init", "-q", "-b", "main")
    git(path, "add", "-A")
    git(path, "commit", "-q", "-m", "release tree")
    return path


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
    """scripts/_hub_release.py (scripts/ is on sys.path through conftest.py)."""
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
    assert build.general.backends == [Backend.CUDA, Backend.ROCm]
    config = tomllib.loads((ROOT / "build.toml").read_text())
    general = config["general"]
    assert (general["name"], general["version"], general["edition"]) == ("moe-dispatch", 1, 5)
    assert general["license"] == "Apache-2.0" and (ROOT / "LICENSE").read_text().count("Apache License") >= 1
    assert re.fullmatch(r"[\w.-]+/moe-dispatch", general["hub"]["repo-id"])
    noarch = config["torch-noarch"]
    assert noarch["cuda_capabilities"] == ["8.0", "9.0"] and noarch["rocm_archs"] == ["gfx942"]
    assert "json" in noarch["pyext"]  # configs/*.json ship with the package


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
    assert runs[0] == "bash scripts/test" and "scripts/build" in runs[1] and "scripts/publish" in runs[2]
    assert steps[-1]["env"] == {"HF_TOKEN": "${{ secrets.HF_TOKEN }}"}


# -- scripts/build -----------------------------------------------------------------------------------------------------

def checkout_head() -> str | None:
    """HEAD's first 7 hex digits, or None outside a git checkout (e.g. a copy of the tree on a GPU machine)."""
    try:
        return git(ROOT, "rev-parse", "HEAD")[:7] if HAS_GIT else None
    except subprocess.CalledProcessError:
        return None


@pytest.fixture(scope="module")
def build_run(tmp_path_factory) -> tuple[Path, set[str] | None]:
    """scripts/build run on this checkout into a temporary directory -> (directory, possible HEADs or None)."""
    out = tmp_path_factory.mktemp("build")
    before = checkout_head()
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "build"), "--out", str(out)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return out, None if before is None else {before, checkout_head()}  # others may commit while it runs


@pytest.fixture(scope="module")
def built(build_run) -> Path:
    return build_run[0]


GENERATED = {"_ops.py", "_version.py", "metadata.json"}  # written by scripts/build for each variant


def package_files() -> set[str]:
    src = ROOT / "torch-ext" / "moe_dispatch"
    return {p.relative_to(src).as_posix() for p in src.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix in (".py", ".json") and p.name not in GENERATED}


def test_build_writes_each_variant(build_run):
    from kernels import Metadata

    built, heads = build_run
    assert sorted(p.name for p in built.iterdir()) == sorted(VARIANTS)
    for variant in VARIANTS:
        vdir = built / variant
        files = {p.relative_to(vdir).as_posix() for p in vdir.rglob("*") if p.is_file()}
        assert files == package_files() | GENERATED, variant
        assert any(f.startswith("configs/") and f.endswith(".json") for f in files)
        for rel in package_files():
            assert (vdir / rel).read_bytes() == (ROOT / "torch-ext" / "moe_dispatch" / rel).read_bytes()
        metadata = Metadata.read_from_file(vdir / "metadata.json")  # the loader's strict parser
        backend, backend_type = BACKEND_OF[variant]
        match = re.fullmatch(rf"_moe_dispatch_{backend}_([0-9a-f]{{7}})(_dirty)?", metadata.id)
        assert match and (heads is None and match.group(2) or match.group(1) in heads), metadata.id
        assert str(metadata.name) == "moe-dispatch" and metadata.version == 1 and metadata.license == "Apache-2.0"
        assert metadata.python_depends == []
        assert str(metadata.backend.backend_type).lower() == backend_type
        assert metadata.backend.archs == (["gfx942"] if backend == "rocm" else ["8.0", "9.0"])
        assert f'NAMESPACE = "{metadata.id}"' in (vdir / "_ops.py").read_text()
        # No release tag on this checkout's HEAD is assumed: a development build says so, with its commit.
        version = re.search(r'__version__ = "([^"]+)"', (vdir / "_version.py").read_text()).group(1)
        assert re.fullmatch(rf"1\.x\.dev\+{match.group(1)}(\.dirty)?", version) or re.fullmatch(r"1\.\d+\.\d+", version)


def test_source_version_names_the_api_major():
    """A checkout's __version__ is "<build.toml version>.x.dev"; builds get theirs from the git tag."""
    with open(ROOT / "build.toml", "rb") as f:
        major = tomllib.load(f)["general"]["version"]
    source = (ROOT / "torch-ext" / "moe_dispatch" / "_version.py").read_text()
    assert f'__version__ = "{major}.x.dev"' in source


@requires_git
def test_build_id_marks_a_dirty_tree(tmp_path):
    repo = make_release_repo(tmp_path / "repo")
    head = git(repo, "rev-parse", "HEAD")[:7]

    def built_id() -> str:
        result = run_script(repo, "build", env=clean_env())
        assert result.returncode == 0, result.stderr
        return json.loads((repo / "build" / "torch-cuda" / "metadata.json").read_text())["id"]

    assert built_id() == f"_moe_dispatch_cuda_{head}"
    with open(repo / "torch-ext" / "moe_dispatch" / "__init__.py", "a") as f:
        f.write("# local edit\n")
    assert built_id() == f"_moe_dispatch_cuda_{head}_dirty"


def test_build_outside_a_git_checkout_is_marked_dirty(tmp_path):
    tree = tmp_path / "tree"
    for rel in ("build.toml", "scripts/_hub_release.py", "scripts/build", "torch-ext/moe_dispatch"):
        copy = shutil.copytree if (ROOT / rel).is_dir() else shutil.copy2
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        copy(ROOT / rel, tree / rel)
    env = clean_env(MOE_DISPATCH_COMMIT="0123456789abcdef", GIT_CEILING_DIRECTORIES=str(tmp_path))
    result = run_script(tree, "build", env=env)
    assert result.returncode == 0, result.stderr
    assert json.loads((tree / "build" / "torch-rocm" / "metadata.json").read_text())["id"] == \
        "_moe_dispatch_rocm_0123456_dirty"


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
    # The build root: the loader picks this machine's variant.
    assert Path(get_local_kernel(built).__file__).parent.name == PREFERRED_VARIANT


def test_get_kernel_version_1_through_local_kernels(built, monkeypatch):
    from kernels import get_kernel

    monkeypatch.setenv("LOCAL_KERNELS", f"{REPO_ID}={built}")
    module = get_kernel(REPO_ID, version=1)
    assert Path(module.__file__).parent.name == PREFERRED_VARIANT
    check_forward(module)
    for variant in VARIANTS:  # a path to one variant directory loads that variant on any machine
        monkeypatch.setenv("LOCAL_KERNELS", f"{REPO_ID}={built / variant}")
        module = get_kernel(REPO_ID, version=1)
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


def release(repo: Path, hub: HubServer, tag: str) -> str:
    """Tag HEAD, build, publish; returns the Hub commit of the tag."""
    git(repo, "tag", tag)
    assert run_script(repo, "build", env=clean_env()).returncode == 0
    result = publish(repo, hub)
    assert result.returncode == 0, result.stdout + result.stderr
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
    try:
        import kernels.cli  # noqa: F401  (imports sigstore eagerly; the GPU image lacks its `cryptography`)
    except ImportError as e:
        pytest.skip(f"the kernels command does not import here: {e}")
    base = tmp_path_factory.mktemp("releases")
    repo = make_release_repo(base / "repo")
    first = release(repo, hub, "v1.0.0")

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
    git(repo, "commit", "-q", "-am", "change for v1.1.0")
    second = release(repo, hub, "v1.1.0")
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
    assert b"# release v1.1.0" in files["build/torch-universal/__init__.py"]
    assert b"# release v1.1.0" not in repo.commits[first].files["build/torch-universal/__init__.py"]
    card = repo.resolve("main").files["README.md"].decode()
    assert f'get_kernel("{REPO_ID}", version=1' in card and "revision=" in card and "kernels lock" in card
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
    assert report["versions"] == ["1.1.0", "1.0.0"]  # __version__ written by scripts/build from the release tag


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
    result = publish(releases["repo"], hub)
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
    for tag, reason in (("v1.1.0", "already exists"), ("v1.0.1", "newer v1 releases exist")):
        git(clone, "tag", "-d", "v1.1.0")  # HEAD carries only the tag under test (the build's __version__ is its)
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


def _stale_commit(repo):
    git(repo, "commit", "-q", "--allow-empty", "-m", "after the build")
    git(repo, "tag", "v1.0.0")
    return [], "build is stale"


def _tag_and_build(repo, tag):
    """A release build: scripts/build writes the tag on HEAD into the build's __version__."""
    git(repo, "tag", tag)
    assert run_script(repo, "build", env=clean_env()).returncode == 0


def _stale_files(repo):
    _tag_and_build(repo, "v1.0.0")
    with open(repo / "build" / "torch-rocm" / "moe.py", "a") as f:
        f.write("# edited after the build\n")
    return [], "torch-rocm differs from torch-ext/moe_dispatch in ['moe.py']"


def _build_before_the_tag(repo):
    git(repo, "tag", "v1.0.0")  # the build (made before) says 1.x.dev+<commit>, not 1.0.0
    return [], "torch-cuda differs from torch-ext/moe_dispatch in ['_version.py']"


def _older_of_two_tags(repo):
    git(repo, "tag", "v1.0.0")
    _tag_and_build(repo, "v1.0.1")  # the build's __version__ is HEAD's newest release tag
    return ["--tag", "v1.0.0"], "makes the build version 1.0.1, not 1.0.0"


def _missing_token(repo):
    _tag_and_build(repo, "v1.0.0")
    return [], "HF_TOKEN is not set"


REFUSALS = [_tag_major_mismatch, _malformed_tag, _dirty_tree, _tag_not_on_head, _stale_commit, _stale_files,
            _build_before_the_tag, _older_of_two_tags, _missing_token]


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


@requires_git
def test_dry_run_prints_every_step_and_sends_nothing(hub, tmp_path):
    repo = make_release_repo(tmp_path / "repo")
    git(repo, "tag", "v1.0.0")
    assert run_script(repo, "build", env=clean_env()).returncode == 0
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


def _package_imports(source: str) -> set:
    """Modules of the package that a module imports at its top level (function-level imports are not counted: they
    are how a cycle hides, and the test below wants none of those either)."""
    import ast

    found = set()
    for node in ast.parse(source).body:
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                found.add(node.module.split(".")[0])
            else:
                found.update(alias.name for alias in node.names)
    return found


def test_package_import_graph_has_no_cycle_and_the_kernels_floor_imports_nothing():
    """The package's modules import each other without a cycle, no module imports another inside a function to dodge
    one, and the `@triton.jit` floor (gemm_jit.py) imports nothing of the package."""
    import ast

    folder = Path(__file__).resolve().parents[1] / "torch-ext" / "moe_dispatch"
    sources = {path.stem: path.read_text() for path in folder.glob("*.py")}
    graph = {name: _package_imports(text) & set(sources) for name, text in sources.items()}
    assert graph["gemm_jit"] == set()
    for name, text in sources.items():
        nested = [node.module for node in ast.walk(ast.parse(text)) if isinstance(node, ast.ImportFrom)
                  and node.level == 1 and node.col_offset > 0]
        assert name in ("expert_parallel", "__init__") or not nested, (name, nested)

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
