#!/usr/bin/env bash
# Download (here, where pip reaches PyPI) what the lent GPU image lacks for scripts/gpu_check.sh into .whl/
# (git-ignored; carried by the device tool's `carry: [".whl"]`, 64 MiB at most). The image has torch,
# transformers, numpy, scipy, pyarrow, pyyaml, safetensors, tokenizers, ninja, msgpack, einops, psutil,
# py-cpuinfo and nvidia-ml-py (/work/.library/device/KINDS.md); not DeepSpeed, pydantic or bm25s. vLLM's
# CUDA wheel (326 MB) cannot travel, so the check reports vLLM as absent.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir -p .whl
plat=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
python3 -m pip download -q --no-deps "${plat[@]}" -d .whl \
    "pydantic==2.12.5" "pydantic-core==2.41.5" "annotated-types==0.7.0" "typing-inspection==0.4.2" \
    "bm25s==0.2.14" "hjson==3.1.0"
# DeepSpeed ships as an sdist; the check installs it with DS_BUILD_OPS=0 against the image's torch
python3 -m pip download -q --no-deps --no-binary=:all: -d .whl "deepspeed==0.19.8"
du -sh .whl && ls .whl
