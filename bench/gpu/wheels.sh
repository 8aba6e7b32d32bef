#!/usr/bin/env bash
# Run here, on a machine with the package registries, before a GPU check: downloads into .whl/ the
# wheels a bare GPU machine lacks (its image holds torch, transformers, safetensors, accelerate, peft,
# numpy, scipy, scikit-learn, click, pyyaml, matplotlib, but not mergekit or what it needs), for
# CPython 3.12 on x86-64 Linux. They travel with the working tree (a few MB; keep .whl/ out of git).
set -euo pipefail
cd "$(dirname "$0")/../.."
rm -rf .whl && mkdir -p .whl
# The pins are the versions this project is tested with (pyproject.toml pins mergekit).
PACKAGES=(
  mergekit==0.1.5 immutables==0.21 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0
  typing-inspection==0.4.5 scikit-optimize==0.10.2 pyaml==26.7.0
)
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${PACKAGES[@]}"
du -sh .whl && ls .whl
