#!/usr/bin/env bash
# Writes .whl/ (ignored by git): the wheels that the lent GPU machines' image lacks, for
# `bash benchmarks/gpu_check.sh --device` to install over it (docs/guides/launch.md). The image has
# Python 3.12, torch, Triton, transformers and the rest of what megacispo needs (the device tool's
# KINDS.md lists its packages), but not megatron-core or math-verify: their cp312 manylinux wheels,
# at the versions the CPU set-up tests (read from .venv), and megacispo's own wheel. At most 48 MiB,
# since a device call carries 64 MiB in all with the working tree.
#
#   bash benchmarks/gpu_bundle.sh
#   PYTHON_VERSION=3.11 bash benchmarks/gpu_bundle.sh   wheels for another Python (default 3.12, the
#       image's): to rehearse gpu_check.sh --device in .venv-image (docs/guides/launch.md)
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup_env.sh >/dev/null
python=.venv/bin/python
limit_mib=48
# What the image lacks: megatron-core, and math-verify with what it needs beyond the image's sympy.
lacking=(megatron-core math-verify latex2sympy2_extended antlr4-python3-runtime)
pins=()
for name in "${lacking[@]}"; do
    pins+=("$name==$("$python" -c "import importlib.metadata, sys; print(importlib.metadata.version(sys.argv[1]))" "$name")")
done
rm -rf .whl
mkdir .whl
"$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version "${PYTHON_VERSION:-3.12}" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    -d .whl "${pins[@]}"
build="$(mktemp -d)"
trap 'rm -rf "$build"' EXIT
# A copy of the sources, so that the wheel's build leaves nothing in the checkout.
git ls-files -z --cached --others --exclude-standard | tar --null -T - -cf - | tar -xf - -C "$build"
"$python" -m pip wheel --quiet --no-deps --no-build-isolation -w .whl "$build"
size_kib="$(du -sk .whl | cut -f1)"
ls -1 .whl
echo ".whl/: $((size_kib / 1024)) MiB (${pins[*]} and megacispo)"
if (( size_kib > limit_mib * 1024 )); then
    echo "gpu_bundle: .whl/ is $((size_kib / 1024)) MiB, over the $limit_mib MiB that leaves a device call room for the working tree" >&2
    exit 1
fi
