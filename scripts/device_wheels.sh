#!/usr/bin/env bash
# Download the wheels that scripts/device_check.py needs on a GPU machine without a package registry
# (beyond the packages docs/gpu.md lists), for Python 3.12 on manylinux x86-64, into DIR (default
# .device_wheels, git-ignored); fail when together they exceed the 64 MiB that may travel with the
# source tree to such a machine. See docs/gpu.md.
#
#   omegaconf 2.3.1               agl's config
#   antlr4-python3-runtime 4.9.3  omegaconf's parser; only published as a source archive, so its
#                                 pure-Python wheel is built here
#   verl 0.9.1                    for the check's verl section, which records why verl's loss does
#                                 not import there: verl imports Ray, and Ray's wheel (75.6 MiB for
#                                 2.60.0, 64.3 MiB for 2.41.0, the oldest verl accepts) alone exceeds
#                                 the limit; carrying verl's other dependencies would not change that
#   trl 1.16.0, datasets 5.2.0,   the check's trl section (the trl backend); datasets also needs
#   dill, multiprocess, xxhash,   pyarrow and pandas, 67 MiB together, which do not fit: where the
#   fsspec                        machine lacks them, the section records the import error
#
# Usage: bash scripts/device_wheels.sh [DIR]     (PYTHON picks the python whose pip is used)
set -euo pipefail

DIR=${1:-.device_wheels}
PYTHON=${PYTHON:-python3}
LIMIT=$((64 * 1024 * 1024))

mkdir -p "$DIR"
rm -f "$DIR"/*.whl
"$PYTHON" -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    -d "$DIR" omegaconf==2.3.1 verl==0.9.1 trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 \
    xxhash==4.1.0 fsspec==2026.9.0
"$PYTHON" -m pip wheel --no-deps --no-binary=antlr4-python3-runtime -w "$DIR" antlr4-python3-runtime==4.9.3

total=0
for wheel in "$DIR"/*.whl; do
    size=$(stat -c %s "$wheel")
    total=$((total + size))
    printf '%10d  %s\n' "$size" "$(basename "$wheel")"
done
mib=$(awk -v bytes="$total" 'BEGIN { printf "%.2f", bytes / 1048576 }')
echo "device_wheels: $total bytes ($mib MiB) in $DIR; the limit is 64 MiB"
if [ "$total" -gt "$LIMIT" ]; then
    echo "device_wheels: the wheels exceed the 64 MiB that may travel with the source tree" >&2
    exit 1
fi
