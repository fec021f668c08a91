#!/usr/bin/env bash
# Installs what nsad needs on Debian 12 (idempotent; fast when everything is present):
#   Debian packages: toolchain, gRPC/protobuf, prometheus-cpp, spdlog, GoogleTest, civetweb,
#                    curl (tests), fortunes (the text of the embedded default dataset)
#   LibTorch:        the torch==2.11.0 wheel from PyPI in a project-local venv (.venv)
# The CUDA 13.0 toolkit is expected at /usr/local/cuda (the machine image provides it).
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_VERSION=2.11.0
PACKAGES=(build-essential cmake ninja-build ccache pkg-config git
          libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
          prometheus-cpp-dev libcivetweb-dev libspdlog-dev prometheus prometheus-alertmanager
          libgtest-dev libgmock-dev libcurl4-openssl-dev fortunes)

sudo_if_needed() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ! python3 -c 'import venv, ensurepip' 2>/dev/null; then missing+=(python3-venv); fi
if [ ${#missing[@]} -gt 0 ]; then
  echo "[install] Debian packages: ${missing[*]}"
  sudo_if_needed apt-get update -q
  sudo_if_needed env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

if ! .venv/bin/python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
  echo "[install] torch==$TORCH_VERSION (LibTorch) into .venv"
  python3 -m venv .venv
  .venv/bin/pip install -q --disable-pip-version-check "torch==$TORCH_VERSION"
fi
echo "[install] ok: $(.venv/bin/python -c 'import torch; print("torch", torch.__version__)' 2>/dev/null)"
