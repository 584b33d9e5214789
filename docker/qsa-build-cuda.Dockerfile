# CUDA build image of the cuda-sm90 target: Debian bookworm's g++ and Python 3.11, and nvcc from
# NVIDIA's PyPI wheels (docker/cuda-toolkit.txt) unpacked into /usr/local/cuda-13.0. Built
# offline (`nox -s build -- --target cuda-sm90 --container`): the pipeline puts the wheels,
# cuda-toolkit.txt and requirements.txt into the build context. No GPU is needed to build.
ARG BASE=qsa-base:bookworm
FROM ${BASE}
ARG CUDA_HOME=/usr/local/cuda-13.0

RUN apt-get update \
 && apt-get install -y g++ python3 python3-dev python3-venv unzip git \
 && rm -rf /var/lib/apt/lists/*

COPY wheels /tmp/wheels
COPY cuda-toolkit.txt requirements.txt /tmp/
# NOTES: unzip (not pip) keeps the executable bits and puts bin/, include/, lib/ and nvvm/ side
# by side, which is the layout nvcc.profile expects ($(TOP)/targets/x86_64-linux/{include,lib}).
RUN set -eu; \
    mkdir -p /tmp/cuda "$CUDA_HOME/targets/x86_64-linux"; \
    for pkg in $(grep -v '^#' /tmp/cuda-toolkit.txt | cut -d= -f1 | tr - _); do \
      unzip -q -o /tmp/wheels/"$pkg"-*.whl 'nvidia/cu13/*' -d /tmp/cuda; \
    done; \
    cp -a /tmp/cuda/nvidia/cu13/. "$CUDA_HOME"/; \
    ln -s ../../include "$CUDA_HOME/targets/x86_64-linux/include"; \
    ln -s ../../lib "$CUDA_HOME/targets/x86_64-linux/lib"; \
    rm -rf /tmp/cuda; \
    "$CUDA_HOME/bin/nvcc" --version
RUN python3 -m venv /opt/venv \
 && /opt/venv/bin/pip install --no-cache-dir --no-index --find-links /tmp/wheels \
      -r /tmp/requirements.txt \
 && rm -rf /tmp/wheels

ENV CUDA_HOME=${CUDA_HOME} \
    PATH=/opt/venv/bin:${CUDA_HOME}/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1
