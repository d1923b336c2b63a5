# Shoal's container image. The entrypoint is the `shoal` command:
#
#   docker run -p 8000:8000 shoal:cpu                     # shoal up: NATS, gateway, a worker
#   docker run shoal:cpu gateway --nats nats://nats:4222  # the gateway alone (0.0.0.0:8000)
#   docker run shoal:cpu worker --nats nats://nats:4222 --model all-MiniLM-L6-v2
#   docker run shoal:cpu worker --nats nats://nats:4222 --fleet
#
# `shoal nats` exists but listens on 127.0.0.1 inside its container, so other containers
# cannot reach it: run the official `nats` image (`nats -js`) for a separate NATS server.
#
# CPU image (the default):  docker build -t shoal:cpu .
# GPU image (CUDA torch):   docker build --build-arg TORCH_INDEX_URL= -t shoal:gpu .
# An empty TORCH_INDEX_URL installs torch from pip's default index, whose Linux wheels are
# the CUDA builds; any other PyTorch wheel index (a CUDA version of your choice) works too.
# llama.cpp stays a portable CPU build in both images.

ARG PYTHON_IMAGE=python:3.12-slim

FROM ${PYTHON_IMAGE} AS build

# llama-cpp-python compiles llama.cpp when it is installed; nothing else needs a compiler.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential cmake \
    && rm -rf /var/lib/apt/lists/*

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# llama.cpp builds for the build machine's CPU (-march=native) by default: an image must run
# on any x86-64 node, so pick the CPU features at run time instead.
ARG LLAMA_CMAKE_ARGS=-DGGML_NATIVE=OFF

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/shoal/bin:$PATH
RUN python -m venv /opt/shoal

# torch first, pinned as in pyproject.toml, from the index chosen above: the project's
# `torch` extra then finds it installed instead of pulling another build.
RUN if [ -n "$TORCH_INDEX_URL" ]; then \
        pip install torch==2.13.0 --index-url "$TORCH_INDEX_URL"; \
    else \
        pip install torch==2.13.0; \
    fi

WORKDIR /src
COPY pyproject.toml README.md ./
COPY src ./src
# The README's install command, without the editable flag and the test extra. The versions
# are pinned where they matter in pyproject.toml, which is what this installs.
# hadolint ignore=DL3013
RUN CMAKE_ARGS="$LLAMA_CMAKE_ARGS" pip install ".[torch,llamacpp,onnx]"

FROM ${PYTHON_IMAGE}

# llama.cpp's OpenMP runtime; torch ships its own.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends libgomp1 \
    && rm -rf /var/lib/apt/lists/*

# A fixed numeric user, so that Kubernetes' runAsNonRoot can check it without a name lookup.
RUN groupadd --gid 10001 shoal \
    && useradd --uid 10001 --gid 10001 --create-home --shell /usr/sbin/nologin shoal \
    && mkdir -p /var/lib/shoal /var/cache/shoal \
    && chown 10001:10001 /var/lib/shoal /var/cache/shoal

COPY --from=build /opt/shoal /opt/shoal

# State (cluster.json, `shoal nats`'s JetStream store) and cache (the Gemma GGUF written on
# first use, converted LoRA adapters, dequantized models, libraries' caches) live on volumes:
# the root file system may be read-only, as in deploy/. Nothing is downloaded from a model
# hub at run time: the models ship in Python packages.
ENV PATH=/opt/shoal/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    SHOAL_STATE_DIR=/var/lib/shoal \
    SHOAL_CACHE_DIR=/var/cache/shoal \
    HF_HOME=/var/cache/shoal/huggingface \
    XDG_CACHE_HOME=/var/cache/shoal/xdg \
    HF_HUB_OFFLINE=1 \
    SHOAL_HOST=0.0.0.0 \
    SHOAL_PORT=8000
VOLUME ["/var/lib/shoal", "/var/cache/shoal"]

USER 10001:10001
WORKDIR /home/shoal
EXPOSE 8000
ENTRYPOINT ["shoal"]
CMD ["up"]
