#!/usr/bin/env bash
# Build this package's wheel, install it alone into an empty venv and process an image there.
# Proves the declared dependencies are enough (qwen-vl-utils imports torch, torchvision and
# numpy without declaring them). Usage, from the repository root:
#   packages/mm-preprocess/scripts/check_lone_install.sh [--offline] [--extra processor]
# torch/torchvision are pinned to the workspace's versions so uv's cache is reused.
set -euo pipefail
offline=()
extra=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --offline) offline=(--offline); shift ;;
    --extra) extra="[$2]"; shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
work="$(mktemp -d /tmp/mm_lone.XXXXXX)"
trap 'rm -rf "$work"' EXIT
uv build --package mm-preprocess --wheel --out-dir "$work/dist" "${offline[@]}" >/dev/null
wheel="$(ls "$work"/dist/mm_preprocess-*.whl)"
uv venv --quiet --python 3.11 "$work/venv"
printf 'torch==2.13.0\ntorchvision==0.28.0\n' > "$work/overrides.txt"
uv pip install --quiet --python "$work/venv/bin/python" --override "$work/overrides.txt" \
  "${offline[@]}" "${wheel}${extra}"
cd "$work"
"$work/venv/bin/python" - <<'PY'
import asyncio, sys
import numpy as np
from PIL import Image
import mm_preprocess
assert "torch" not in sys.modules and "qwen_vl_utils" not in sys.modules, "import not light"
path = "lone.png"
Image.fromarray(np.random.default_rng(0).integers(0, 255, (300, 400, 3), dtype=np.uint8)).save(path)
messages = [{"role": "user", "content": [{"type": "image", "image": path}]}]

async def main():
    async with mm_preprocess.VisionPreprocessor(max_workers=2) as pre:
        return await pre.process_vision_info(messages)

images, videos, metadata = asyncio.run(main())
sync_images, _, _ = mm_preprocess.process_vision_info_sync(messages)
assert images[0].tobytes() == sync_images[0].tobytes()
print("lone install OK:", images[0].size, images[0].mode, "python", sys.version.split()[0])
PY
