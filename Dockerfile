# syntax=docker/dockerfile:1
# pdserve image: CPU by default; CUDA through build arguments.
#
#   docker build -t pdserve:cpu .
#   docker build -t pdserve:cu128 --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
#   docker build -t pdserve:sglang-router --target sglang-router .
#
# The CUDA torch wheels bundle the CUDA runtime, so the python base image works
# on a GPU host with the NVIDIA container toolkit; BASE_IMAGE may name another
# base (for example an nvidia/cuda image) that has python >= 3.10 with venv.

ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS build
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch first, from the chosen index, so `pip install .` keeps it
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY pdserve ./pdserve
RUN pip install --no-cache-dir . \
    && find /opt/venv -name '__pycache__' -type d -prune -exec rm -rf {} +

FROM ${BASE_IMAGE} AS runtime
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PDSERVE_CACHE_DIR=/models/cache \
    PDSERVE_HEALTH_PORT=30000
RUN groupadd --system --gid 10001 pdserve \
    && useradd --system --uid 10001 --gid pdserve --create-home pdserve \
    && mkdir -p /models \
    && chown pdserve:pdserve /models
COPY --from=build /opt/venv /opt/venv
# uid/gid 10001 numerically, so that Kubernetes' runAsNonRoot can verify it;
# a fresh named volume mounted here takes this owner, so the non-root user can write it
VOLUME ["/models"]
USER 10001:10001
WORKDIR /home/pdserve
EXPOSE 30000 8998
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request as u; u.urlopen('http://127.0.0.1:%s/health' % os.environ['PDSERVE_HEALTH_PORT'], timeout=4)"]
ENTRYPOINT ["pdserve"]
CMD ["--help"]

# sglang-router in front of pdserve workers (compose profile `sglang`, deploy/k8s)
FROM runtime AS sglang-router
ARG SGLANG_ROUTER_VERSION=0.3.2
USER 0
RUN pip install --no-cache-dir "sglang-router==${SGLANG_ROUTER_VERSION}"
USER 10001:10001
ENV PDSERVE_HEALTH_PORT=8000
EXPOSE 8000
ENTRYPOINT ["python", "-m", "sglang_router.launch_router"]
CMD ["--help"]

# the default target: `docker build .` gives the pdserve image
FROM runtime
