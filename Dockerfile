# pdserve image: CPU by default; CUDA through build arguments.
#
#   docker build -t pdserve:cpu .
#   docker build -t pdserve:cu128 --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
#   docker build -t pdserve:sglang-router --target sglang-router .
#
# The CUDA torch wheels bundle the CUDA runtime, so the python base image works
# on a GPU host with the NVIDIA container toolkit; BASE_IMAGE may name another
# base (for example an nvidia/cuda image, or one made from Debian packages as
# docs/deploy.md shows) that has python >= 3.10 with venv.
#
# Every dependency but torch comes from deploy/requirements.lock, hash-checked
# (refresh it with `make lock`); torch comes from TORCH_INDEX_URL at TORCH_VERSION,
# since its CPU and CUDA builds are different wheels. No BuildKit-only feature is
# used, so no `# syntax=` line: the builder needs no frontend image from a registry.

ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS build
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0
# optional, unset unless given: a PyPI mirror, and a CA bundle for pip (path inside the build)
ARG PIP_INDEX_URL
ARG PIP_CERT
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY deploy/requirements.lock deploy/model.lock ./deploy/
# the locked wheels first (hash-checked, no resolution), then torch, whose own
# dependencies the lock already holds (for the CUDA build its index adds the CUDA ones)
RUN pip install --no-cache-dir --no-deps --require-hashes \
        -r deploy/requirements.lock -r deploy/model.lock \
    && pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
# Bytecode is compiled here, once, with hashes that need no source mtime: the venv
# is root-owned and read-only for the runtime user, who could not write a .pyc.
# (-x: torch ships test helpers in newer Python syntax, never imported.)
RUN python -m compileall -q -f -j 2 --invalidation-mode unchecked-hash -x 'py31[2-9]' /opt/venv
COPY deploy/pip_check.py ./deploy/
COPY pyproject.toml README.md ./
COPY pdserve ./pdserve
RUN pip install --no-cache-dir --no-deps --no-build-isolation . \
    && python deploy/pip_check.py \
    && python -m compileall -q -f --invalidation-mode unchecked-hash \
        /opt/venv/lib/python3*/site-packages/pdserve

FROM ${BASE_IMAGE} AS runtime
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PDSERVE_CACHE_DIR=/models/cache \
    PDSERVE_HEALTH_PORT=30000
RUN groupadd --system --gid 10001 pdserve \
    && useradd --system --uid 10001 --gid pdserve --create-home pdserve \
    && mkdir -p /models \
    && chown pdserve:pdserve /models
COPY --from=build /opt/venv /opt/venv
# uid/gid 10001 numerically, so that Kubernetes' runAsNonRoot can verify it.
# /models is a plain folder, not a VOLUME: a service that mounts nothing there
# leaves no anonymous volume behind; a fresh named volume mounted on it takes
# this folder's owner, so the non-root user can write it.
USER 10001:10001
WORKDIR /home/pdserve
EXPOSE 30000 8998
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request as u; u.urlopen('http://127.0.0.1:%s/health' % os.environ['PDSERVE_HEALTH_PORT'], timeout=4)"]
ENTRYPOINT ["pdserve"]
CMD ["--help"]

# sglang-router in front of pdserve workers (compose profile `sglang`, deploy/k8s).
# Built from the same stages, so pass it the same build arguments.
FROM runtime AS sglang-router
ARG PIP_INDEX_URL
ARG PIP_CERT
COPY deploy/sglang-router.lock deploy/pip_check.py /tmp/
USER 0
# (pip compiles the bytecode of what it installs, here as root)
RUN pip install --no-cache-dir --no-deps --require-hashes -r /tmp/sglang-router.lock \
    && python /tmp/pip_check.py \
    && rm /tmp/sglang-router.lock /tmp/pip_check.py
USER 10001:10001
ENV PDSERVE_HEALTH_PORT=8000
EXPOSE 8000
ENTRYPOINT ["python", "-m", "sglang_router.launch_router"]
CMD ["--help"]

# the default target: `docker build .` gives the pdserve image
FROM runtime
