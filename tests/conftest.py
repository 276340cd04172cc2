import collections
import os
import pathlib

import jax
import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def webshop_data() -> pathlib.Path:
    """The official 1000-product WebShop files: $WEBSHOP_DATA, else ../shared/webshop."""
    path = pathlib.Path(os.environ.get("WEBSHOP_DATA", REPO.parent / "shared" / "webshop"))
    if not (path / "items_shuffle_1000.json").exists():
        pytest.skip(
            f"WebShop data not found: items_shuffle_1000.json is not in {path}; set WEBSHOP_DATA to the "
            f"directory of the official 1000-product files (default: ../shared/webshop beside the checkout)"
        )
    return path


# Imported models and generated games are cached inside the checkout (ignored by git), so the
# suite never writes to the user's home and a second run reuses them.
os.environ.setdefault("ORSD_JAX_CACHE", str(REPO / ".cache"))
# Unoptimised XLA code for the programs the tests compile in this process: their models are tiny
# and their shapes seldom repeat, so compiling, not running, is their time (test_models 110 s against
# 142, test_warmstart 49 against 104 with its loss checks jitted). Runs the tests start compile as a
# user's do: their programs repeat from run to run and load from the compile cache, and a tiny run
# with a warm cache took 17.3 s unoptimised against 14.6 (python -m experiments.train_alfworld
# --preset tiny --updates 2; from an empty cache 25.5 against 30.6; machine and commits in
# docs/changelog.md, 2026-12-08). helpers.optimized: a test's longer computations.
jax.config.update("jax_disable_most_optimizations", True)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files with the most ``slow`` tests first, the others in file order. ``-n 2 --dist loadfile``
    hands a worker the next file when it runs out of work, so the long files should start at once
    and the short ones fill the end; xdist's own order (most tests first, kept off in pytest.ini)
    put the one-test files of several minutes last and left one worker alone with them."""
    slow = collections.Counter(item.path for item in items if item.get_closest_marker("slow"))
    items.sort(key=lambda item: -slow[item.path])  # stable
