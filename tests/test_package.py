"""The orsd-jax package as users get it, checked from outside the checkout: the wheel's modules
and console scripts, the commands scripts/install.sh installs into .venv, and a quiet console."""

import json
import os
import pathlib
import shutil
import subprocess
import tomllib
import zipfile

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
BIN = REPO / ".venv" / "bin"
SCRIPTS = {
    "orsd-train": "experiments.train_alfworld:main",
    "orsd-train-webshop": "experiments.train_webshop:main",
    "orsd-eval": "experiments.evaluate:main",
    "orsd-warmstart": "experiments.warmstart:main",
    "orsd-credit-report": "experiments.credit_report:main",
    "orsd-study": "experiments.study:main",
}
PACKAGES = ("orsd_jax", "experiments")


def outside(cmd: list[str], cwd: pathlib.Path, drop: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """``cmd`` run from ``cwd`` with .venv's python and no PYTHONPATH, so nothing finds the checkout
    but what is installed."""
    if not (BIN / "python").exists():
        pytest.fail("no .venv: run `bash scripts/install.sh`")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", *drop)}
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def last_json(result: subprocess.CompletedProcess) -> dict:
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


def test_pyproject_declares_the_scripts_and_the_pinned_requirements():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["scripts"] == SCRIPTS
    pinned = [line.split("#")[0].strip() for line in (REPO / "requirements.txt").read_text().splitlines()]
    pinned = [line for line in pinned if line]
    test_only = project["optional-dependencies"]["test"]
    assert {line.split("==")[0] for line in test_only} == {"pytest", "pytest-xdist", "hypothesis", "ruff", "mypy"}
    assert sorted(project["dependencies"] + test_only) == sorted(pinned), "pyproject.toml and requirements.txt differ"


def test_the_wheel_holds_every_module_and_its_scripts_load(tmp_path):
    # A copy of what the build needs, so the build leaves nothing in the checkout.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    for package in PACKAGES:
        shutil.copytree(REPO / package, src / package, ignore=shutil.ignore_patterns("__pycache__"))
    build = outside(
        [
            str(BIN / "python"),
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path / "dist"),
            str(src),
        ],
        tmp_path,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("orsd_jax-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        z.extractall(tmp_path / "site")
    modules = {
        p.relative_to(REPO).as_posix()
        for package in PACKAGES
        for p in (REPO / package).rglob("*.py")
        if "__pycache__" not in p.parts
    }
    assert not sorted(modules - names), "modules missing from the wheel"

    # Every entry point of the wheel's metadata loads to a callable, from the wheel's files.
    probe = """if True:
        import importlib.metadata, json, sys
        site = sys.argv[1]
        sys.path.insert(0, site)
        (dist,) = importlib.metadata.distributions(name="orsd-jax", path=[site])
        scripts = {ep.name: ep.value for ep in dist.entry_points if ep.group == "console_scripts"}
        loaded = {ep.name: callable(ep.load()) for ep in dist.entry_points}
        files = {m.__name__: m.__file__ for m in list(sys.modules.values()) if m.__name__.split(".")[0] in ("orsd_jax", "experiments")}
        print(json.dumps({"scripts": scripts, "loaded": loaded, "files": files}))
    """
    (tmp_path / "elsewhere").mkdir()
    report = last_json(outside([str(BIN / "python"), "-c", probe, str(tmp_path / "site")], tmp_path / "elsewhere"))
    assert report["scripts"] == SCRIPTS
    assert report["loaded"] == dict.fromkeys(SCRIPTS, True)
    site = str(tmp_path / "site")
    assert {"orsd_jax", "experiments", "experiments.train_alfworld"} <= set(report["files"])
    assert [f for f in report["files"].values() if not f.startswith(site)] == []


def test_the_installed_commands_run_from_anywhere(tmp_path):
    missing = [name for name in SCRIPTS if not (BIN / name).exists()]
    if missing:
        pytest.fail(f"{', '.join(missing)} not in .venv/bin: run `bash scripts/install.sh` (it installs the project)")
    probe = """if True:
        import importlib.metadata, json, sys
        import experiments, orsd_jax
        dist = importlib.metadata.distribution("orsd-jax")
        print(json.dumps({"scripts": {ep.name: ep.value for ep in dist.entry_points if ep.group == "console_scripts"},
                          "files": [orsd_jax.__file__, experiments.__file__], "sys.path": sys.path}))
    """
    report = last_json(outside([str(BIN / "python"), "-c", probe], tmp_path))
    assert report["scripts"] == SCRIPTS, "the installed entry points are stale: rerun `bash scripts/install.sh`"
    assert report["files"] == [str(REPO / p / "__init__.py") for p in PACKAGES], "orsd-jax is installed from elsewhere"
    assert str(REPO) not in report["sys.path"], "the checkout itself is on sys.path"

    for name, says in [("orsd-train", "on ALFWorld"), ("orsd-train-webshop", "on WebShop")]:
        result = outside([str(BIN / name), "--help"], tmp_path)
        assert result.returncode == 0, result.stderr[-3000:]
        assert result.stdout.startswith(f"usage: {name} ") and says in result.stdout and "--preset" in result.stdout


def test_the_console_hides_jax_backend_probe(tmp_path):
    # What the training commands do: the console set up, then JAX's backends (probing all of them:
    # no JAX_PLATFORMS) while our own INFO lines still show.
    probe = """if True:
        import logging
        from orsd_jax.metrics_log import console_logging
        console_logging()
        import jax
        jax.devices()
        logging.getLogger("orsd_jax").info("our own line")
    """
    result = outside([str(BIN / "python"), "-c", probe], tmp_path, drop=("JAX_PLATFORMS", "JAX_LOGGING_LEVEL"))
    assert result.returncode == 0, result.stderr[-3000:]
    output = result.stdout + result.stderr
    assert "our own line" in output
    assert "Unable to initialize backend" not in output, output


# The run's composition: the configuration, the resources built from it, the loop and the study
# harness. Every other module is a stage with explicit inputs.
COMPOSITION = {"orsd_jax.config", "orsd_jax.services", "orsd_jax.trainer", "orsd_jax.study"}


def _imports(path: pathlib.Path) -> set[str]:
    """Every orsd_jax module ``path`` imports, at the top or inside a function."""
    import ast

    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return {name for name in names if name.startswith("orsd_jax")}


def test_stages_do_not_import_the_composition():
    sources = {
        ".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__"): p
        for p in (REPO / "orsd_jax").rglob("*.py")
    }
    assert len(sources) > 40 and "orsd_jax.trainer" in sources
    offenders = {
        module: sorted(_imports(path) & COMPOSITION)
        for module, path in sources.items()
        if module not in COMPOSITION and _imports(path) & COMPOSITION
    }
    assert not offenders, f"stage modules import the composition: {offenders}"
    # The check sees what it must: the trainer imports the services, the services the config.
    assert {"orsd_jax.services", "orsd_jax.config"} <= _imports(sources["orsd_jax.trainer"])
    assert "orsd_jax.config" in _imports(sources["orsd_jax.services"])
