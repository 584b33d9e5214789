# CPU test image: Debian bookworm, Python 3.11 and a virtual environment holding the pinned CPU
# build of torch plus the test dependencies. Built offline (`nox -s image`): the pipeline puts
# the wheels and requirements.txt into the build context; the project is mounted at run time.
ARG BASE=qsa-base:bookworm
FROM ${BASE}

# NOTES: g++ and python3-dev are test dependencies: torch.compile's inductor backend compiles
# C++ on CPU (tests/cpu compile the public ops with fullgraph=True); git for tests/pipeline.
RUN apt-get update \
 && apt-get install -y python3 python3-venv python3-dev g++ git \
 && rm -rf /var/lib/apt/lists/*

COPY wheels /tmp/wheels
COPY requirements.txt /tmp/requirements.txt
RUN python3 -m venv /opt/venv \
 && /opt/venv/bin/pip install --no-cache-dir --no-index --find-links /tmp/wheels \
      -r /tmp/requirements.txt \
 && rm -rf /tmp/wheels

ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
