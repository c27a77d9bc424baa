#!/usr/bin/env bash
# Wheels for the S3 rows of tools/gpu_loader_28.sh on the GPU machine (Python 3.12, no internet): moto's server,
# boto3/botocore/s3transfer, s3fs/aiobotocore/aiohttp, torchdata (the loader's DataLoader workers), and those of
# their needs that the machine lacks or holds in versions too old for them (its package list:
# /work/.library/device/KINDS.md). Run here, where pip reaches a
# registry, from the repository root; the wheels land in .whl/ beside the ones already there:
#
#   bash tools/gpu_wheels.sh            # then carry .whl, and on the GPU machine, before anything else:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#       .whl/*.whl && export PYTHONPATH=/tmp/site
#
# Versions are the ones this project's tests run with (pyproject's test extra); one version of each, or the
# --no-deps install stops. Present on the machine and left to it (loose requirements): requests, urllib3,
# python-dateutil, jinja2, markupsafe, click, pyyaml, attrs, multidict, frozenlist, propcache, wrapt, idna.
set -euo pipefail
DEST=${DEST:-.whl}
LIMIT_MIB=${LIMIT_MIB:-64}  # what may travel to the device in one call, working tree included
WHEELS=(
    moto==5.2.5 boto3==1.43.117 botocore==1.43.117 s3transfer==0.19.3 jmespath==1.1.0
    s3fs==2026.9.0 fsspec==2026.9.0 aiobotocore==3.10.0 aioitertools==0.13.0
    aiohttp==3.14.5 yarl==1.25.1 aiosignal==1.4.0 aiohappyeyeballs==2.7.1
    xmltodict==1.0.4 responses==0.26.3 cryptography==50.0.2 cffi==2.1.1 pycparser==3.12
    flask==3.1.3 flask-cors==6.0.5 blinker==1.9.0 itsdangerous==2.2.0 werkzeug==3.1.9
    py-partiql-parser==0.6.3
    torchdata==0.11.0  # StatefulDataLoader: the trainer's --workers rows (bench_train --workers N)
)
PLATFORMS=()
for n in 39 35 34 31 28 27 24 17; do PLATFORMS+=(--platform "manylinux_2_${n}_x86_64"); done
PLATFORMS+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
mkdir -p "$DEST"
held() {  # the version of wheel NAME already in $DEST (names compared as pip normalises them), or nothing
    local want f n
    want=$(echo "$1" | tr 'A-Z.-' 'a-z__')
    for f in "$DEST"/*.whl; do
        [[ -e $f ]] || continue
        f=${f##*/}
        n=$(echo "${f%%-*}" | tr 'A-Z.-' 'a-z__')
        if [[ $n == "$want" ]]; then f=${f#*-}; echo "${f%%-*}"; return; fi
    done
}
for spec in "${WHEELS[@]}"; do
    name=${spec%%==*}
    have=$(held "$name")
    if [[ -n $have ]]; then
        [[ $have == "${spec##*==}" ]] || { echo "$DEST already holds $name $have, not $spec: remove one" >&2; exit 1; }
        continue
    fi
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${PLATFORMS[@]}" -d "$DEST" "$spec"
done
total=$(du -sk "$DEST" | cut -f1)
tree=$(git ls-files -z | xargs -0 du -ck 2>/dev/null | tail -1 | cut -f1)
echo "$DEST: $(ls "$DEST" | wc -l) wheels, $((total / 1024)) MiB; with the tracked tree ($((tree / 1024)) MiB):" \
     "$(((total + tree) / 1024)) of $LIMIT_MIB MiB that may travel"
if (( (total + tree) / 1024 >= LIMIT_MIB )); then echo "over the limit: carry fewer wheels" >&2; exit 1; fi
