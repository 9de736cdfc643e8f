#!/bin/bash
# A Triton wheel for the GPU machine's python3 (3.12; it installs nothing from the network),
# packed small enough to travel in one `run` call's carry (64 MiB): without the AMD backend,
# CUPTI, proton and the bundled ptxas (the machine's CUDA has one), libtriton.so stripped of
# its static symbols. Writes $2 (default triton-<version>.tar.xz in this folder).
#
#   bash benchmarks/pack_triton.sh 3.9.0 .ab/triton39-stripped.tar.xz
#
# On the machine:
#   mkdir -p /tmp/site && xz -dc <archive> | tar -C /tmp/site -xf -
#   P=$(command -v ptxas || ls /usr/local/cuda*/bin/ptxas | head -1)
#   export PYTHONPATH=/tmp/site:$PWD TRITON_PTXAS_PATH=$P TRITON_PTXAS_BLACKWELL_PATH=$P
set -euo pipefail
version=${1:?a Triton version, e.g. 3.9.0}
out=$(realpath -m "${2:-triton-$version.tar.xz}")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download "triton==$version" --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux_2_28_x86_64 -d "$work" -q
mkdir "$work/site"
unzip -q "$work"/triton-*.whl -d "$work/site"
cd "$work/site"
rm -rf triton/backends/amd triton/backends/nvidia/lib/cupti* triton/_C/libproton.so triton/profiler \
    triton/backends/nvidia/bin/ptxas*
# Backend discovery imports every backend the entry points list.
sed -i '/amd/d' triton-"$version".dist-info/entry_points.txt
strip --strip-unneeded triton/_C/libtriton.so
tar -cf - . | xz -9 -T2 > "$out"
ls -l "$out"
