#!/usr/bin/env bash
# GPU check of ppo-trainer on a bare machine: its own Python with torch + transformers + numpy,
# this package's source, a few small wheels; no uv, no network. Under 5 minutes on one GPU.
#
#   1. Here (with PyPI access), fetch the wheels to carry (~5 MiB, several CPython versions):
#        packages/ppo-trainer/gpu_check.sh download-wheels [DIR]   (DIR: packages/ppo-trainer/wheels)
#   2. On the GPU machine, from a copy of the repository (the wheels folder included):
#        packages/ppo-trainer/gpu_check.sh [--out FILE]
#      It runs the `gpu`-marked tests (bf16 step, FSDP2 over one rank, checkpoint round trip
#      on CUDA, loss numerics CUDA vs CPU, steps CUDA vs CPU), then measures the trainer's
#      tokens/s and MFU on the Qwen2.5-0.5B shape against a minimal torch loop. The last line
#      of output is one JSON object (also written to FILE).
#
# Without a GPU the same script runs end to end: the gpu tests skip and the throughput part
# uses a tiny shape on the CPU (CI runs it that way).
#
# Environment: PYTHON (default python3), GPU_CHECK_WHEELS (default packages/ppo-trainer/wheels),
# GPU_CHECK_TIMEOUT_S (per part; default 240).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PYTHON="${PYTHON:-python3}"
WHEELS="${GPU_CHECK_WHEELS:-$HERE/wheels}"
PART_TIMEOUT_S="${GPU_CHECK_TIMEOUT_S:-240}"
# The versions of uv.lock; pure-Python except msgspec (fetched for each CPython below).
PURE_WHEELS="pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 pygments==2.21.0 packaging==26.4
pytest-asyncio==1.5.0 pytest-timeout==2.4.0 typing-extensions==4.16.0"
MSGSPEC="msgspec==0.23.0"
CPYTHONS="3.10 3.11 3.12 3.13"

download_wheels() {
    local dest="${1:-$WHEELS}"
    mkdir -p "$dest"
    # shellcheck disable=SC2086
    "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: -d "$dest" $PURE_WHEELS
    for version in $CPYTHONS; do
        "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: -d "$dest" \
            --python-version "$version" --platform manylinux2014_x86_64 \
            --platform manylinux_2_17_x86_64 "$MSGSPEC"
    done
    du -sh "$dest"
}

# Unpack into $1 each carried wheel whose module this Python cannot import yet (the machine's
# own packages win) and whose tag fits this Python. A wheel is a zip file: no pip needed.
unpack_wheels() {
    "$PYTHON" - "$WHEELS" "$1" <<'PY'
import importlib.util, pathlib, sys, zipfile
wheels, site = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
modules = {"typing_extensions": "typing_extensions", "pygments": "pygments"}
tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
for wheel in sorted(wheels.glob("*.whl")) if wheels.is_dir() else []:
    dist = wheel.name.split("-")[0].lower()
    module = modules.get(dist, dist)
    if importlib.util.find_spec(module) is not None:
        continue
    if "-none-any" not in wheel.name and f"-{tag}-" not in wheel.name:
        continue
    zipfile.ZipFile(wheel).extractall(site)
    print(f"gpu_check: using carried {wheel.name}", file=sys.stderr)
PY
}

main() {
    local out=""
    if [[ "${1:-}" == "--out" ]]; then out="$2"; fi
    GPU_CHECK_SITE="$(mktemp -d)"
    trap 'rm -rf "$GPU_CHECK_SITE"' EXIT
    local site="$GPU_CHECK_SITE"
    unpack_wheels "$site"
    export PYTHONPATH="$site:$HERE/src:$HERE/tests${PYTHONPATH:+:$PYTHONPATH}"
    export HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
    "$PYTHON" -c "import msgspec, numpy, torch, transformers, ppo_trainer, pytest, pytest_asyncio"
    "$PYTHON" -c "import torch; print('gpu_check: torch', torch.__version__, 'cuda', torch.cuda.is_available())"

    local log="$site/pytest.log" rc=0
    (cd "$HERE" && timeout "$PART_TIMEOUT_S" "$PYTHON" -m pytest -q -p no:cacheprovider -m gpu \
        --import-mode=importlib -o asyncio_mode=auto \
        -o asyncio_default_fixture_loop_scope=session -o asyncio_default_test_loop_scope=session \
        tests/test_ppo_gpu_check.py tests/test_ppo_gpu.py) 2>&1 | tee "$log" || rc=$?
    local throughput
    throughput="$(timeout "$PART_TIMEOUT_S" "$PYTHON" "$HERE/tests/gpu_throughput.py" | tail -n 1)"
    local summary
    summary="$(grep -E '^[0-9]+ (passed|failed|skipped|error)' "$log" | tail -n 1 || true)"
    local line
    line="$("$PYTHON" - "$rc" "$summary" "$throughput" <<'PY'
import json, sys
rc, summary, throughput = sys.argv[1:4]
result = {"bench": "ppo_trainer_gpu_check", "tests_rc": int(rc), "tests": summary}
result.update(json.loads(throughput))
print(json.dumps(result))
PY
)"
    echo "$line"
    if [[ -n "$out" ]]; then echo "$line" > "$out"; fi
    return "$rc"
}

case "${1:-}" in
    download-wheels) shift; download_wheels "$@" ;;
    -h|--help) sed -n '2,22p' "$0" ;;
    *) main "$@" ;;
esac
