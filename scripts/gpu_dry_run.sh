#!/usr/bin/env bash
# CPU dry run of the GPU learning check as the lent machine runs it (issue #43), here, in ~10 minutes:
#   1. a stand-in for the image: a bare interpreter holding only those of the image's packages
#      (scripts/gpu_image_packages.txt) that the check uses, at this environment's versions;
#   2. the pack for that interpreter (scripts/gpu_pack.py pack; binary wheels for this Python, not 3.12);
#   3. its parts unpacked one at a time, as the device calls do, the last with --require-all;
#   4. scripts/gpu_learning_check.sh at tiny sizes with that interpreter and the unpacked site alone.
# A package the check imports and the pack lacks fails step 4 with its ModuleNotFoundError.
#
#   bash scripts/gpu_dry_run.sh            # after make install; GPU_DRY_DIR (default /tmp/gpu-dry) holds it all
set -euo pipefail
cd "$(dirname "$0")/.."
D=${GPU_DRY_DIR:-/tmp/gpu-dry}
PYV=$(python3 -c 'import platform; print(platform.python_version())')
mkdir -p "$D" && rm -rf "$D/carry" "$D/work" "$D/site" "$D/learning"
t0=$(date +%s)

.venv/bin/python scripts/gpu_pack.py image-pins --python-version "$PYV" >"$D/image-pins.new"
if [ -x "$D/image/bin/python" ] && cmp -s "$D/image-pins.new" "$D/image-pins.txt"; then
    echo "gpu_dry_run: the stand-in image of an earlier dry run has these packages: kept"
else
    rm -rf "$D/image" && python3 -m venv "$D/image"
    "$D/image/bin/python" -m pip install -q --no-deps --disable-pip-version-check -r "$D/image-pins.new" 2>&1 \
        | grep -v "^WARNING: Location" || true
fi
mv "$D/image-pins.new" "$D/image-pins.txt"
echo "gpu_dry_run: stand-in image ready ($(wc -l <"$D/image-pins.txt") packages), $(( $(date +%s) - t0 )) s"

.venv/bin/python scripts/gpu_pack.py pack --python-version "$PYV" --out "$D/carry" --xz-level 0 2>&1 \
    | grep -v "^WARNING: Location"
n=$(ls "$D/carry" | wc -l)
for part in $(seq 1 "$n"); do
    flag=()
    [ "$part" -eq "$n" ] && flag=(--require-all)
    "$D/image/bin/python" scripts/gpu_pack.py unpack "$D/carry/$part" --work "$D/work" --site "$D/site" "${flag[@]}"
done

PYTHON="$D/image/bin/python" GPU_SITE="$D/site" GPU_CHECK_SIZE=tiny GPU_LEARNING_DIR="$D/learning" \
    bash scripts/gpu_learning_check.sh | tee "$D/check.log"
rc=${PIPESTATUS[0]}
if [ "$rc" -ne 0 ] || ! grep -q "^gpu_check: learning_full_minus_sft=" "$D/check.log"; then
    echo "gpu_dry_run: FAILED (exit $rc; the logs are in $D/learning)"
    exit 1
fi
echo "gpu_dry_run: passed in $(( $(date +%s) - t0 )) s"
