"""Per-token credit report of a run: which response tokens the selected rubric credited, and why.

    python -m experiments.credit_report runs/cpu-demo-alfworld-orsd              # -> RUN/credit_report.html
    python -m experiments.credit_report RUN --update 2 --screenshot report.png   # a PNG via headless Chromium

The training command writes the report of the last recorded update itself; this command renders
any recorded update (``credit_every`` in the config decides which are recorded).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import subprocess
import tempfile

from orsd_jax.config import from_json
from orsd_jax.credit import load_credit
from orsd_jax.credit_html import render


def write_report(
    run_dir: str | os.PathLike, update: int | None = None, out: str | os.PathLike | None = None
) -> pathlib.Path:
    """Renders a recorded update of ``run_dir`` (default: the last) to ``out`` (default: RUN/credit_report.html)."""
    run = pathlib.Path(run_dir)
    config = from_json((run / "config.json").read_text()).resolved()
    record = load_credit(run, update)
    title = f"{config.method} on {config.env.name}: per-token credit at update {record.update} of {run.name}"
    path = pathlib.Path(out) if out else run / "credit_report.html"
    path.write_text(render(record, clip=config.loss.clip, title=title), encoding="utf-8")
    return path


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if found := shutil.which(name):
            return found
    raise FileNotFoundError("no Chromium on PATH: install Debian's chromium package (scripts/install.sh does)")


def _browser(page: pathlib.Path, *flags: str, timeout: float = 120) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory() as profile:  # a fresh profile: no state shared between runs
        command = [
            chromium(),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            f"--user-data-dir={profile}",
            *flags,
            page.resolve().as_uri(),
        ]
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=True)


def screenshot(page: str | os.PathLike, png: str | os.PathLike, width: int = 1200, height: int = 1600) -> pathlib.Path:
    """A PNG of ``page`` as headless Chromium renders it."""
    png = pathlib.Path(png).resolve()
    _browser(pathlib.Path(page), f"--screenshot={png}", f"--window-size={width},{height}")
    if not png.is_file():
        raise RuntimeError(f"Chromium wrote no screenshot to {png}")
    return png


def rendered_dom(page: str | os.PathLike) -> str:
    """The page's DOM after Chromium has parsed and laid it out."""
    return _browser(pathlib.Path(page), "--dump-dom").stdout


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", help="run directory")
    p.add_argument("--update", type=int, help="recorded update to show (default: the last)")
    p.add_argument("--out", help="HTML file (default: RUN/credit_report.html)")
    p.add_argument("--screenshot", help="also write a PNG of the page (headless Chromium)")
    args = p.parse_args(argv)
    page = write_report(args.run, args.update, args.out)
    print(f"report: {page}")
    if args.screenshot:
        print(f"screenshot: {screenshot(page, args.screenshot)}")


if __name__ == "__main__":
    main()
