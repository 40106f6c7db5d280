"""Container images built here, without a registry (issue 18, item 2).

No registry can be reached from these machines and ``podman run`` does not work, but
``podman build --isolation chroot`` does. This module builds the images a real node needs
and saves each as a ``docker-archive`` tarball, which ``ctr images import`` (containerd
2.x) loads under the image's name:

=========================================  ===============================================
``registry.k8s.io/pause:3.10.1``           the Pod sandbox: ``FROM scratch``, the static
                                           ``pause`` of ``tests/k8s/pause.c``, ``USER
                                           65535``, ``ENTRYPOINT ["/pause"]``
``ghcr.io/kelastic/kelastic:<version>``    the repo-root ``Dockerfile`` (operator + sidecar)
``ghcr.io/kelastic/digits-example:<ver>``  ``examples/digits/Dockerfile`` (the trainer), with
                                           torch less its GPU-only extras (see
                                           :data:`TORCH_LEFT_OUT`)
=========================================  ===============================================

``<version>`` is ``kelastic.__version__``; the names are the ones the product's manifests
use (the operator's sidecar image, ``deploy/``, ``examples/digits/elasticjob.yaml``).

How they are built:

- The Dockerfiles' ``FROM`` (``ARG PYTHON_IMAGE``, a ``python:3.11-slim-bookworm``) is
  stood in for by Debian bookworm made with ``debootstrap`` (minbase + python3,
  python3-venv, python-is-python3, ca-certificates, netbase, tzdata), slimmed, tarred once
  into the cache and imported into podman under that very name.
- podman and buildah keep their storage under the cache too (``<cache>/containers``),
  apart from the machine's own images, so rebuilds reuse layers.
- The kelastic image's pip reaches PyPI during the build, as a user's build does (the
  machine's CA bundle goes in as the ``pip-cert`` build secret, for TLS proxies).
- The trainer's pip is offline: its wheels are fetched once with ``pip download`` into a
  wheelhouse in the cache (``<cache>/wheelhouse``: torch's 527 MB wheel and its ~2.5 GB
  of CUDA wheels, scikit-learn, numpy, hatchling, ...), handed to the build in a home
  folder mounted over ``/root`` whose ``pip.conf`` says ``no-index`` and ``find-links``:
  the Dockerfile is built unchanged and nothing of this lands in the image.

Caching: each archive is ``<cache>/images/<name>-<key>.tar`` where ``<key>`` is a SHA-256
over every input of the build: the Dockerfile's text, the build arguments, each file of
the build context that its ``.dockerignore`` lets in (path, mode and content), the base
tarball's name (itself keyed by the debootstrap inputs), the wheelhouse's file names and
sizes, and :data:`RECIPE` (bumped when this module builds differently). An unchanged
input returns the archive at once; a changed one rebuilds it and removes the older
archive. A lock file (``fcntl.flock``) serializes builds across processes, and every file
is written under a temporary name, then ``os.replace``-d into place.

``<cache>`` is ``$KELASTIC_TEST_CACHE``, else ``$XDG_CACHE_HOME/kelastic-test``, else
``~/.cache/kelastic-test``.

Needs root, ``podman``, ``buildah`` and ``debootstrap`` (``apt-get install -y podman
buildah debootstrap``; ``scripts/test-tools.sh`` installs them), ``gcc`` when the node's
``pause`` binary is not built yet, and the network to PyPI and Debian's mirror for the
first build.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import platform
import re
import shutil
import ssl
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kelastic import __version__

REPO = Path(__file__).resolve().parents[2]
ROOT_DOCKERFILE = REPO / "Dockerfile"
DIGITS_DOCKERFILE = REPO / "examples" / "digits" / "Dockerfile"
DIGITS_REQUIREMENTS = REPO / "examples" / "digits" / "requirements.txt"
PAUSE_SOURCE = REPO / "tests" / "k8s" / "pause.c"

PAUSE = "registry.k8s.io/pause:3.10.1"
"""The Pod sandbox image kubelet 1.36 names (its default ``--pod-infra-container-image``)."""
KELASTIC = f"ghcr.io/kelastic/kelastic:{__version__}"
"""The operator and sidecar image (the repo-root ``Dockerfile``)."""
DIGITS = f"ghcr.io/kelastic/digits-example:{__version__}"
"""The digits example's trainer image (``examples/digits/Dockerfile``)."""
ALL: tuple[str, ...] = (PAUSE, KELASTIC, DIGITS)
"""Every image :func:`build_images` knows, in build order."""

RECIPE = 3
"""Part of every cache key: bump it when this module changes how an image is built."""

SUITE = "bookworm"
MIRROR = os.environ.get("KELASTIC_DEBIAN_MIRROR", "http://deb.debian.org/debian")
BASE_PACKAGES = (
    "python3",
    "python3-venv",
    "python-is-python3",
    "ca-certificates",
    "netbase",
    "tzdata",
)
# What the official python image sets; the label marks which cached tarball it came from.
BASE_CHANGES = ("ENV LANG=C.UTF-8", 'CMD ["python3"]')
BASE_LABEL = "io.kelastic.test.base"
KEY_LABEL = "io.kelastic.test.key"
# The inputs podman's layer cache cannot see (the wheelhouse, this module's recipe): a
# build whose tagged predecessor has another value of this label starts with --no-cache.
OUTSIDE_LABEL = "io.kelastic.test.outside"
APT_LINE = "apt-get install -y podman buildah debootstrap"

TORCH_LEFT_OUT = frozenset(
    {"triton", "nvidia-cusolver", "cuda-bindings", "cuda-pathfinder", "cuda-toolkit", "nvidia-nvtx"}
)
"""What the trainer built here leaves out of torch's requirements (~1 GB installed): triton
(torch.compile's GPU kernels), cuSOLVER (loaded only by CUDA linear algebra), the CUDA
Python bindings and NVTX. The other nvidia-* libraries stay: torch's Linux wheel links
against them and ``import torch`` fails without them, even on a machine with no GPU."""

PAUSE_CONTAINERFILE = """\
FROM scratch
COPY pause /pause
USER 65535:65535
ENTRYPOINT ["/pause"]
"""

TIMINGS: dict[str, float] = {}
"""Seconds this process spent per step (``debootstrap``, ``build <name>``, ``save <name>``,
``wheelhouse``, ``import <archive name>``): the tests print them."""


class ImageError(RuntimeError):
    """A build, save or import step failed; the message holds the command and its output."""


class ToolMissing(ImageError):
    """A tool the images need is not installed; the message says how to install it."""


@dataclass(frozen=True)
class Build:
    """One image as :func:`build_images` returned it.

    ``built`` is True when this call built the archive and False when it reused the cached
    one; ``seconds`` is the wall time of that (build + save, or the cache look-up).
    """

    name: str
    key: str
    archive: Path
    built: bool
    seconds: float


BUILDS: list[Build] = []
"""Every image :func:`build_images` returned in this process, in order (the tests read
``built`` to see a cache hit)."""


# ---- paths and tools ----


def cache_dir() -> Path:
    """The test cache's root: ``$KELASTIC_TEST_CACHE``, else ``<XDG cache>/kelastic-test``."""
    env = os.environ.get("KELASTIC_TEST_CACHE")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "kelastic-test"


def images_dir() -> Path:
    """Where the archives live: ``<cache>/images``."""
    return cache_dir() / "images"


def need_tools(*tools: str) -> None:
    """Raise :class:`ToolMissing` naming each of ``tools`` not on PATH and how to install it."""
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        raise ToolMissing(
            f"missing {', '.join(missing)}: building the test images needs them "
            f"(Debian: `{APT_LINE}`, or `bash scripts/test-tools.sh`)"
        )


def run(
    cmd: Sequence[str], timeout: float, *, check: bool = True, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` (``timeout`` in seconds), capturing its output.

    Raises :class:`ImageError` with the command and the tail of its output when it exits
    non-zero (with ``check``) or outlives ``timeout``.
    """
    try:
        proc = subprocess.run(
            list(cmd), capture_output=True, text=True, timeout=timeout, env=env, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise ImageError(f"`{' '.join(cmd)}` ran past {timeout:.0f} s") from exc
    if check and proc.returncode != 0:
        out = (proc.stdout + proc.stderr)[-6000:]
        raise ImageError(f"`{' '.join(cmd)}` exited {proc.returncode}:\n{out}")
    return proc


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if missing) for the block."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def ca_bundle() -> str | None:
    """The CA bundle this machine's pip trusts (handed to builds as the ``pip-cert`` secret)."""
    for cand in (
        os.environ.get("PIP_CERT"),
        os.environ.get("SSL_CERT_FILE"),
        os.environ.get("REQUESTS_CA_BUNDLE"),
        ssl.get_default_verify_paths().cafile,
        "/etc/ssl/certs/ca-certificates.crt",
    ):
        if cand and Path(cand).is_file():
            return cand
    return None


class Podman:
    """podman and buildah on a storage of their own (``<cache>/containers``).

    Every method raises :class:`ImageError` when its command fails (with ``check``);
    ``timeout`` is in seconds.
    """

    def __init__(self, root: Path | None = None, runroot: Path | None = None) -> None:
        root = root or cache_dir() / "containers"
        runroot = runroot or Path(tempfile.gettempdir()) / f"kelastic-test-runroot-{os.geteuid()}"
        self.opts = ["--root", str(root), "--runroot", str(runroot)]

    def podman(self, *args: str, timeout: float = 300, check: bool = True) -> str:
        """``podman <args>`` on this storage; its stdout."""
        return run(["podman", *self.opts, *args], timeout, check=check).stdout

    def buildah(self, *args: str, timeout: float = 300, check: bool = True) -> str:
        """``buildah <args>`` on this storage; its stdout."""
        return run(["buildah", *self.opts, *args], timeout, check=check).stdout

    def inspect(self, image: str) -> dict[str, object] | None:
        """``podman image inspect`` of ``image`` (name or id), or None if it is not here."""
        proc = run(["podman", *self.opts, "image", "inspect", image], 120, check=False)
        if proc.returncode != 0:
            return None
        data: list[dict[str, object]] = json.loads(proc.stdout)
        return data[0]


def podman() -> Podman:
    """The :class:`Podman` of the test cache, after checking the tools and root.

    Raises :class:`ToolMissing` without podman, buildah or debootstrap, and
    :class:`ImageError` when not root (debootstrap and ``--isolation chroot`` need it).
    """
    need_tools("podman", "buildah", "debootstrap")
    if os.geteuid() != 0:
        raise ImageError("building the test images needs root (debootstrap, --isolation chroot)")
    return Podman()


# ---- the base: debootstrapped Debian under the Dockerfile's FROM name ----


def from_image(dockerfile: Path = ROOT_DOCKERFILE) -> str:
    """The default ``ARG PYTHON_IMAGE`` of ``dockerfile``, qualified as Docker does.

    ``python:3.11-slim-bookworm`` becomes ``docker.io/library/python:3.11-slim-bookworm``,
    the name the base is imported as, so podman finds it without a registry. Raises
    :class:`ImageError` when the Dockerfile has no such ARG.
    """
    m = re.search(r"^ARG\s+PYTHON_IMAGE=(\S+)", dockerfile.read_text(), re.MULTILINE)
    if not m:
        raise ImageError(f"{dockerfile} has no `ARG PYTHON_IMAGE=<image>` to build FROM")
    name = m.group(1)
    if "/" not in name:
        name = f"library/{name}"
    if "." not in name.split("/")[0] and name.split("/")[0] != "localhost":
        name = f"docker.io/{name}"
    return name


def base_tarball_path() -> Path:
    """Where :func:`base_tarball` keeps the base: ``<cache>/debian-bookworm-python-<key>.tar``.

    ``<key>`` hashes the suite, mirror, packages and variant; the file may not exist yet.
    """
    key = hashlib.sha256(
        json.dumps([SUITE, MIRROR, BASE_PACKAGES, "minbase", 1]).encode()
    ).hexdigest()[:12]
    return cache_dir() / f"debian-{SUITE}-python-{key}.tar"


def base_tarball() -> Path:
    """The debootstrapped Debian with python, as a tarball; made once, then cached.

    At :func:`base_tarball_path`. Raises :class:`ImageError` when debootstrap fails (~3 min
    the first time; needs Debian's mirror).
    """
    tarball = base_tarball_path()
    cache = tarball.parent
    if tarball.is_file():
        return tarball
    with _locked(cache / ".base.lock"):
        if tarball.is_file():  # another process made it meanwhile
            return tarball
        with tempfile.TemporaryDirectory(dir=cache, prefix="debootstrap-") as tmp:
            root = Path(tmp) / "rootfs"
            started = time.monotonic()
            run(
                [
                    "debootstrap",
                    "--variant=minbase",
                    f"--include={','.join(BASE_PACKAGES)}",
                    SUITE,
                    str(root),
                    MIRROR,
                ],
                timeout=1800,
            )
            # Slim it as the Debian slim images are: no apt lists, no caches, no docs.
            for pattern in (
                "var/lib/apt/lists/*",
                "var/cache/apt/*",
                "var/cache/debconf/*-old",
                "var/log/*",
                "usr/share/doc/*",
                "usr/share/man/*",
                "usr/share/info/*",
            ):
                for path in root.glob(pattern):
                    if path.is_dir() and not path.is_symlink():
                        shutil.rmtree(path)
                    else:
                        path.unlink()
            part = Path(tmp) / "base.tar"
            run(["tar", "-C", str(root), "--numeric-owner", "-cf", str(part), "."], timeout=600)
            os.replace(part, tarball)
            for stale in cache.glob(f"debian-{SUITE}-python-*.tar"):
                if stale != tarball:
                    stale.unlink()
            TIMINGS["debootstrap"] = time.monotonic() - started
    return tarball


def base_image(pm: Podman, dockerfile: Path = ROOT_DOCKERFILE) -> tuple[str, Path]:
    """Import the base tarball under ``dockerfile``'s FROM name unless podman has it already.

    Returns (that name, the tarball). The image carries the tarball's name as a label, so
    a new tarball is imported again. Raises :class:`ImageError` when a step fails.
    """
    name = from_image(dockerfile)
    tarball = base_tarball()
    info = pm.inspect(name)
    labels = (info or {}).get("Labels") or {}
    if not isinstance(labels, dict) or labels.get(BASE_LABEL) != tarball.name:
        changes = [*BASE_CHANGES, f"LABEL {BASE_LABEL}={tarball.name}"]
        pm.podman("import", *(f"--change={c}" for c in changes), str(tarball), name, timeout=600)
    return name, tarball


# ---- the build context, as the .dockerignore lets it in ----


def _ignore_patterns(context: Path) -> list[tuple[bool, re.Pattern[str], str]]:
    """``context/.dockerignore`` as (negated, regex, literal prefix) rules, in order."""
    ignore = context / ".dockerignore"
    rules: list[tuple[bool, re.Pattern[str], str]] = []
    if not ignore.is_file():
        return rules
    for raw in ignore.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        pattern = os.path.normpath(line.lstrip("!").strip()).lstrip("/")
        regex = ""
        i = 0
        while i < len(pattern):
            if pattern.startswith("**", i):
                regex += ".*"
                i += 2
                if pattern.startswith("/", i):  # "**/" also matches no folder at all
                    regex = regex[:-2] + "(?:.*/)?"
                    i += 1
            elif pattern[i] == "*":
                regex += "[^/]*"
                i += 1
            elif pattern[i] == "?":
                regex += "[^/]"
                i += 1
            else:
                regex += re.escape(pattern[i])
                i += 1
        prefix = re.split(r"[*?\[]", pattern, maxsplit=1)[0]
        rules.append((negated, re.compile(regex + r"\Z"), prefix))
    return rules


def _ignored(rel: str, rules: list[tuple[bool, re.Pattern[str], str]]) -> bool:
    """Whether ``rel`` (or a folder above it) is left out, Docker's way: the last match wins."""
    parts = rel.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for negated, regex, _ in rules:
        if any(regex.match(p) for p in prefixes):
            ignored = not negated
    return ignored


def context_files(context: Path) -> list[str]:
    """The files (relative POSIX paths, sorted) that a build of ``context`` is sent.

    Follows ``context/.dockerignore`` (patterns with ``*``, ``?``, ``**``, ``!``; a pattern
    that matches a folder takes its contents); ``.git`` is never sent.
    """
    rules = _ignore_patterns(context)
    reincluding = [prefix for negated, _, prefix in rules if negated]
    files: list[str] = []
    for dirpath, dirnames, filenames in os.walk(context):
        base = Path(dirpath).relative_to(context).as_posix()
        base = "" if base == "." else base + "/"
        keep = []
        for d in sorted(dirnames):
            rel = base + d
            if rel == ".git":
                continue
            # Prune a left-out folder unless a `!` rule could bring something inside back.
            if _ignored(rel, rules) and not any(
                p == "" or p.startswith(rel + "/") or rel.startswith(p) for p in reincluding
            ):
                continue
            keep.append(d)
        dirnames[:] = keep
        files.extend(base + f for f in filenames if not _ignored(base + f, rules))
    return sorted(files)


def _hash_context(digest: hashlib._Hash, context: Path) -> None:
    """Feed each context file's path, mode and content (a link's target) into ``digest``."""
    for rel in context_files(context):
        path = context / rel
        st = path.lstat()
        if stat.S_ISLNK(st.st_mode):
            data = os.readlink(path).encode()
        elif stat.S_ISREG(st.st_mode):
            data = hashlib.sha256(path.read_bytes()).digest()
        else:
            continue
        digest.update(f"{rel}\0{st.st_mode & 0o7777:o}\0".encode() + data + b"\0")


# ---- the trainer's wheelhouse ----


def _torch_requirement() -> str:
    """The torch requirement of ``examples/digits/Dockerfile``'s ``ARG TORCH_PIP`` default."""
    m = re.search(r'^ARG\s+TORCH_PIP="?([^"\n]+)"?', DIGITS_DOCKERFILE.read_text(), re.MULTILINE)
    if not m or not re.fullmatch(r"torch==[\w.+]+", m.group(1).strip()):
        raise ImageError(f'{DIGITS_DOCKERFILE} has no `ARG TORCH_PIP="torch==<version>"`')
    return m.group(1).strip()


def _dist_name(wheel: Path) -> tuple[str, str]:
    """(normalized distribution name, version) of a wheel file."""
    name, version = wheel.name.split("-")[:2]
    return re.sub(r"[-_.]+", "-", name).lower(), version


def torch_lean_pip(house: Path) -> str:
    """The ``TORCH_PIP`` build argument of the trainer built here.

    ``--no-deps`` and the Dockerfile's torch pin with each of torch's requirements as the
    wheelhouse resolved them (``name==version``), less :data:`TORCH_LEFT_OUT`.
    """
    pins = []
    for wheel in sorted((house / "torch").glob("*.whl")):
        name, version = _dist_name(wheel)
        if name not in TORCH_LEFT_OUT:
            pins.append(f"{name}=={version}")
    torch = _torch_requirement()
    if torch not in pins:
        raise ImageError(f"the wheelhouse {house} has no {torch}: {pins}")
    return " ".join(["--no-deps", *pins])


def _pip_platform_args() -> list[str]:
    """``pip download`` options for wheels that run in the bookworm base (glibc 2.36)."""
    machine = platform.machine()
    platforms = [f"manylinux_2_{n}_{machine}" for n in range(36, 16, -1)]
    platforms += [f"manylinux2014_{machine}", f"linux_{machine}"]
    args = ["--only-binary=:all:", "--python-version", "3.11", "--implementation", "cp"]
    args += ["--abi", "cp311", "--abi", "abi3", "--abi", "none"]
    for plat in platforms:
        args += ["--platform", plat]
    return args


def wheelhouse() -> Path:
    """The trainer build's wheels, fetched once with ``pip download`` into the cache.

    ``<cache>/wheelhouse/torch``: the Dockerfile's torch pin with all its requirements
    (the CUDA ones too: ~3 GB); ``<cache>/wheelhouse/other``: the example's
    ``requirements.txt`` and hatchling (the kelastic wheel's build backend) with theirs;
    all for CPython 3.11 on glibc <= 2.36. A stamp file keyed by those requirements marks
    it complete; pip asks PyPI only when the stamp is missing. Raises :class:`ImageError`
    when pip fails.
    """
    house = cache_dir() / "wheelhouse"
    reqs = {
        "torch": [_torch_requirement()],
        "other": ["--requirement", str(DIGITS_REQUIREMENTS), "hatchling"],
    }
    key = hashlib.sha256(
        json.dumps([reqs, DIGITS_REQUIREMENTS.read_text(), _pip_platform_args()]).encode()
    ).hexdigest()[:16]
    stamp = house / f".complete-{key}"
    if stamp.is_file():
        return house
    with _locked(cache_dir() / ".wheelhouse.lock"):
        if stamp.is_file():
            return house
        started = time.monotonic()
        for folder, req in reqs.items():
            dest = house / folder
            dest.mkdir(parents=True, exist_ok=True)
            cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--dest", str(dest)]
            run([*cmd, *_pip_platform_args(), *req], timeout=3600)
        for old in house.glob(".complete-*"):
            old.unlink()
        stamp.touch()
        TIMINGS["wheelhouse"] = time.monotonic() - started
    return house


def _hash_wheelhouse(digest: hashlib._Hash, house: Path) -> None:
    """Feed the wheelhouse's file names and sizes into ``digest``."""
    for path in sorted(house.glob("*/*.whl")):
        digest.update(f"{path.relative_to(house)}\0{path.stat().st_size}\0".encode())


# ---- the pause binary ----


def pause_binary() -> Path:
    """The static ``pause`` of ``tests/k8s/pause.c``.

    The node's (``pause`` in :func:`tests.k8s.node.node_bin`, built by
    ``scripts/build-node.sh``, or in ``$KELASTIC_NODE_BIN``) when present, else built
    here with ``gcc -Os -static`` into ``<cache>/pause-<sha256(pause.c)[:12]>/pause``.
    Raises :class:`ToolMissing` without gcc, :class:`ImageError` when it does not compile.
    """
    from tests.k8s.cluster import ClusterUnavailable
    from tests.k8s.node import node_bin

    try:
        node: Path | None = node_bin()
    except ClusterUnavailable:  # not built (yet): build pause alone
        node = None
    if node and (node / "pause").is_file() and os.access(node / "pause", os.X_OK):
        return node / "pause"
    key = hashlib.sha256(PAUSE_SOURCE.read_bytes()).hexdigest()[:12]
    out = cache_dir() / f"pause-{key}" / "pause"
    if out.is_file():
        return out
    need_tools("gcc")
    out.parent.mkdir(parents=True, exist_ok=True)
    part = out.with_name(f".pause.{os.getpid()}")
    run(["gcc", "-Os", "-static", "-o", str(part), str(PAUSE_SOURCE)], timeout=300)
    os.replace(part, out)
    return out


# ---- one image ----


@dataclass
class _Recipe:
    """How to build one image: a Dockerfile, its context, its build args and extras."""

    name: str
    dockerfile_text: str
    context: Path
    dockerfile: Path | None = None  # None: dockerfile_text is written into the context
    build_args: dict[str, str] = field(default_factory=dict)
    base: Path | None = None  # the base tarball, for builds FROM python
    wheels: Path | None = None  # a wheelhouse: pip in the build is offline, from it
    extra: list[str] = field(default_factory=list)  # more inputs for the key

    def outside_key(self) -> str:
        """The SHA-256 (hex) of the inputs that podman's layer cache does not see.

        The layer cache keys each step by its instruction, build args, parent and the
        content a COPY copies, but not by what a ``--volume`` brings (the wheelhouse) nor by
        how this module drives the build (:data:`RECIPE`).
        """
        digest = hashlib.sha256(json.dumps([RECIPE, self.name]).encode() + b"\0")
        if self.wheels:
            _hash_wheelhouse(digest, self.wheels)
        return digest.hexdigest()

    def key(self) -> str:
        """The SHA-256 (hex) of every input of the build."""
        digest = hashlib.sha256()
        head = [RECIPE, self.name, self.dockerfile_text, sorted(self.build_args.items())]
        head += [self.base.name if self.base else None, self.extra]
        digest.update(json.dumps(head).encode() + b"\0")
        _hash_context(digest, self.context)
        if self.wheels:
            _hash_wheelhouse(digest, self.wheels)
        return digest.hexdigest()


def _label(info: dict[str, object] | None, label: str) -> str:
    """The value of ``label`` in an inspected image's config ("" when absent)."""
    config = (info or {}).get("Config")
    labels = config.get("Labels") if isinstance(config, dict) else None
    return str(labels.get(label, "")) if isinstance(labels, dict) else ""


def _slug(name: str) -> str:
    """A file name for an image name: ``registry.k8s.io/pause:3.10.1`` ->
    ``registry.k8s.io_pause_3.10.1``."""
    return re.sub(r"[^A-Za-z0-9.-]+", "_", name)


def _recipe(name: str, stage: Path) -> _Recipe:
    """The :class:`_Recipe` of image ``name``; ``stage`` is a scratch folder for a context."""
    if name == PAUSE:
        binary = pause_binary()
        shutil.copy2(binary, stage / "pause")
        return _Recipe(name, PAUSE_CONTAINERFILE, stage)
    base = base_tarball_path()
    if name == KELASTIC:
        return _Recipe(name, ROOT_DOCKERFILE.read_text(), REPO, ROOT_DOCKERFILE, base=base)
    if name == DIGITS:
        house = wheelhouse()
        return _Recipe(
            name,
            DIGITS_DOCKERFILE.read_text(),
            REPO,
            DIGITS_DOCKERFILE,
            build_args={"TORCH_PIP": torch_lean_pip(house)},
            base=base,
            wheels=house,
        )
    raise ValueError(f"unknown image {name!r}: known are {', '.join(ALL)}")


def _offline_home(wheels: Path, stage: Path) -> Path:
    """A home folder for the build's root user that makes its pip offline, from ``wheels``.

    Mounted over ``/root`` (which the base has), it holds ``.config/pip/pip.conf`` (pip's
    user config: ``no-index``, ``find-links = /root/wheels``) and ``wheels/``, hard links
    to the wheelhouse's files (copies across file systems). Nothing of it lands in the
    image, and the Dockerfile is built unchanged.
    """
    home = stage / "home"
    (home / ".config" / "pip").mkdir(parents=True)
    (home / ".config" / "pip" / "pip.conf").write_text(
        "[global]\nno-index = true\nfind-links = /root/wheels\n"
    )
    (home / "wheels").mkdir()
    for whl in wheels.glob("*/*.whl"):
        try:
            os.link(whl, home / "wheels" / whl.name)
        except OSError:
            shutil.copy2(whl, home / "wheels" / whl.name)
    return home


def _clean_storage(pm: Podman) -> None:
    """Remove what builds leave in the test storage: the working containers of a build that
    was killed (named ``<image>-working-container``: the tests name theirs otherwise) and
    dangling images (earlier builds' layers; without this the storage grows by the
    trainer's 4 GB per torch change). Call it holding the build lock."""
    names = pm.buildah("containers", "--format", "{{.ContainerName}}", check=False).split()
    left = [n for n in names if re.search(r"-working-container(-\d+)?$", n)]
    if left:
        pm.buildah("rm", *left, check=False)
    pm.podman("image", "prune", "--force", timeout=600, check=False)


def _build(pm: Podman, recipe: _Recipe, key: str, archive: Path, stage: Path) -> None:
    """Build ``recipe`` into podman's storage, then save it to ``archive`` (docker-archive)."""
    dockerfile = recipe.dockerfile
    if recipe.base:  # the Dockerfile's FROM, imported from the debootstrapped tarball
        base_image(pm, dockerfile or ROOT_DOCKERFILE)
    if dockerfile is None:
        dockerfile = stage / "Containerfile"
        dockerfile.write_text(recipe.dockerfile_text)
    cmd = [
        "build",
        "--isolation",
        "chroot",
        "--format",
        "docker",  # the OCI format has no HEALTHCHECK
        "--pull=never",  # FROM names the imported base: never look for a registry
        "--layers",
        "--tag",
        recipe.name,
        "--label",
        f"{KEY_LABEL}={key}",
        "--label",
        f"{OUTSIDE_LABEL}={recipe.outside_key()}",
        "--file",
        str(dockerfile),
    ]
    for arg, value in sorted(recipe.build_args.items()):
        cmd += ["--build-arg", f"{arg}={value}"]
    bundle = ca_bundle()
    if bundle:
        cmd += ["--secret", f"id=pip-cert,src={bundle}"]
    if recipe.wheels:
        cmd += ["--volume", f"{_offline_home(recipe.wheels, stage)}:/root"]
    _clean_storage(pm)
    old = pm.inspect(recipe.name)
    if _label(old, OUTSIDE_LABEL) != recipe.outside_key():
        cmd.append("--no-cache")  # cached layers may hold what an older wheelhouse put in
    started = time.monotonic()
    pm.podman(*cmd, str(recipe.context), timeout=3600)
    TIMINGS[f"build {recipe.name}"] = time.monotonic() - started
    new = pm.inspect(recipe.name)
    if old and new and old["Id"] != new["Id"]:  # keep the storage from growing per edit
        pm.podman("rmi", str(old["Id"]), check=False)
        _clean_storage(pm)
    started = time.monotonic()
    part = archive.with_name(f".{archive.name}.{os.getpid()}.part")
    part.unlink(missing_ok=True)
    try:
        pm.podman(
            "save", "--format", "docker-archive", "--output", str(part), recipe.name, timeout=1200
        )
        os.replace(part, archive)
    finally:
        part.unlink(missing_ok=True)
    TIMINGS[f"save {recipe.name}"] = time.monotonic() - started


def build_images(names: Iterable[str] = ALL) -> dict[str, Path]:
    """Build (or reuse) the images ``names`` and return {name: docker-archive tarball}.

    ``names`` are image names from :data:`ALL` (:data:`PAUSE`, :data:`KELASTIC`,
    :data:`DIGITS`). Each archive is ``<cache>/images/<name>-<key16>.tar``, ``<key>``
    hashing every input of its build (see the module's doc): an archive that exists is
    returned without building; otherwise the image is built with ``podman build
    --isolation chroot`` (cold: the base ~3 min, the kelastic image ~2 min, the trainer
    ~4 min; then podman's layer cache) and saved, and the older archives of that name are
    removed. Builds run under an exclusive lock on ``<cache>/images/.lock``, so a second
    process waits and then reuses what the first built. Each result is appended to
    :data:`BUILDS`.

    Raises ValueError for an unknown name, :class:`ToolMissing` when podman, buildah,
    debootstrap (or gcc, for pause) is missing, and :class:`ImageError` when not root or
    when a build, save, debootstrap or pip download fails.
    """
    wanted = list(dict.fromkeys(names))
    for name in wanted:
        if name not in ALL:
            raise ValueError(f"unknown image {name!r}: known are {', '.join(ALL)}")
    pm = podman()
    out: dict[str, Path] = {}
    folder = images_dir()
    with _locked(folder / ".lock"):
        sweep_unfinished(folder)
        for name in wanted:
            started = time.monotonic()
            with tempfile.TemporaryDirectory(dir=folder, prefix=".stage-") as tmp:
                stage = Path(tmp)
                recipe = _recipe(name, stage)
                key = recipe.key()
                archive = folder / f"{_slug(name)}-{key[:16]}.tar"
                built = not archive.is_file()
                if built:
                    _build(pm, recipe, key, archive, stage)
                    for stale in folder.glob(f"{_slug(name)}-*.tar"):
                        if stale != archive:
                            stale.unlink()
            BUILDS.append(Build(name, key, archive, built, time.monotonic() - started))
            out[name] = archive
    return out


def sweep_unfinished(folder: Path) -> list[Path]:
    """Remove what a killed build left in the archive folder ``folder``: its staging
    folders (``.stage-*``) and half-saved archives (``.<name>.tar.<pid>.part``, up to
    4.4 GB each); return them. Call it holding ``<folder>/.lock``: no build runs then, so
    every such file is a dead one's."""
    left = sorted([*folder.glob(".stage-*"), *folder.glob(".*.part")])
    for path in left:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    return left


def ensure_in_podman(name: str, archive: Path, pm: Podman | None = None) -> str:
    """Make image ``name`` in podman's test storage the one saved in ``archive``.

    Loads ``archive`` (``podman load``) unless the storage's ``name`` already carries the
    archive's key label; returns ``name``. Raises :class:`ImageError` when loading fails.
    """
    pm = pm or podman()
    key16 = archive.stem.rsplit("-", 1)[-1]
    with _locked(images_dir() / ".lock"):  # no build's clean-up meanwhile
        if not _label(pm.inspect(name), KEY_LABEL).startswith(key16):
            pm.podman("load", "--input", str(archive), timeout=1200)
    return name


# ---- containerd ----

#: Room kept free beside an import's own need (bytes): containerd's metadata, the node's
#: logs and the Pods' writable layers.
IMPORT_SLACK_BYTES = 1 << 30


def import_disk_need(archives: Iterable[Path]) -> int:
    """Bytes of free disk that importing ``archives`` one after another (unpacked, the
    layer blobs discarded) needs at its peak: every image's snapshots (about an archive's
    size each) plus, while the largest is unpacked, its blobs a second time, plus
    :data:`IMPORT_SLACK_BYTES`. Raises FileNotFoundError for a missing archive."""
    sizes = [archive.stat().st_size for archive in archives]
    return sum(sizes) + max(sizes, default=0) + IMPORT_SLACK_BYTES


def check_disk_for_import(root: Path, archives: Iterable[Path]) -> None:
    """Fail before an import that would fill the disk holding ``root`` (containerd's
    root; its nearest existing parent is measured).

    Raises :class:`ImageError` naming the need, the free space and where a killed test run
    leaves its nodes (its containerd roots are ~4.5-8.8 GB each), instead of containerd's
    ``no space left on device`` half-way through a 4.4 GB archive.
    """
    need = import_disk_need(archives)
    probe = root
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < need:
        raise ImageError(
            f"importing the images into {root} needs {need / 1e9:.1f} GB free, "
            f"{probe} has {free / 1e9:.1f} GB: free some (a killed test run leaves its "
            "nodes' containerd roots, pytest-*/node*/containerd under pytest's temporary "
            "folder; the next run removes those of dead runs)"
        )


def import_images(
    ctr: Path,
    address: Path,
    archives: Iterable[Path],
    namespace: str = "k8s.io",
    timeout: float = 1200,
    unpack: bool = True,
) -> None:
    """Import ``archives`` into the running containerd at socket ``address``.

    Runs ``ctr --address <address> -n <namespace> images import --local --all-platforms
    <archive>`` for each (docker-archive or OCI tarballs; the images keep the names they
    were saved under). ``--local``: ctr writes the content itself instead of going through
    containerd 2's transfer service (the 4.4 GB trainer: 47 s instead of 63 s once, on a
    quiet machine; 63-65 s either way while the machine's 2 cores were busy).
    With ``unpack`` (the default) the layers are unpacked for containerd's default
    snapshotter (overlayfs, the CRI's), so a Pod's first start does not pay for it, and
    ``--discard-unpacked-layers`` lets containerd's garbage collector drop the layer blobs
    once unpacked (within a second or so): a node keeps the snapshots only, ~4.5 GB with
    the trainer image instead of ~8.8 GB, as a kubelet with the CRI's
    ``discard_unpacked_layers`` does after a pull. ``unpack=False`` passes
    ``--no-unpack``. ``timeout`` is in seconds, per archive. The
    time each took goes to :data:`TIMINGS` (``import <file>``).

    Raises :class:`ImageError` with ctr's output when an import fails or times out, and
    FileNotFoundError when ``ctr`` or an archive does not exist.
    """
    if not ctr.is_file():
        raise FileNotFoundError(f"no ctr at {ctr} (scripts/build-node.sh builds it)")
    archives = list(archives)
    for archive in archives:
        if not archive.is_file():
            raise FileNotFoundError(f"no image archive at {archive}")
        started = time.monotonic()
        cmd = [str(ctr), "--address", str(address), "--namespace", namespace, "images"]
        cmd += ["import", "--local", "--all-platforms"]
        cmd.append("--discard-unpacked-layers" if unpack else "--no-unpack")
        run([*cmd, str(archive)], timeout)
        TIMINGS[f"import {archive.name}"] = time.monotonic() - started
