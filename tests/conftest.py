import os
import pathlib

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
