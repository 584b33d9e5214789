# oneAPI build image of the bmg-g21 and bmg-g31 targets (SYCL ahead-of-time through icpx).
# Needs Intel's oneAPI apt repository; `nox -s build -- --target bmg-g21 --container` checks
# that it is reachable before building and stops with a clear message when it is not.
ARG BASE=qsa-base:bookworm
FROM ${BASE}
ARG ONEAPI_REPO=https://apt.repos.intel.com/oneapi
ARG ONEAPI_KEY=https://apt.repos.intel.com/intel-gpg-keys/GPG-PUB-KEY-INTEL-SW-PRODUCTS.PUB
# The DPC++/C++ compiler and the offline GPU compiler (ocloc) that spir64_gen AOT needs.
ARG ONEAPI_PACKAGES="intel-oneapi-compiler-dpcpp-cpp intel-ocloc"

RUN apt-get update \
 && apt-get install -y curl gpg g++ python3 python3-dev python3-venv git \
 && curl -fsSL "$ONEAPI_KEY" | gpg --dearmor -o /usr/share/keyrings/oneapi.gpg \
 && echo "deb [signed-by=/usr/share/keyrings/oneapi.gpg] $ONEAPI_REPO all main" \
      > /etc/apt/sources.list.d/oneapi.list \
 && apt-get update \
 && apt-get install -y $ONEAPI_PACKAGES \
 && rm -rf /var/lib/apt/lists/*

COPY wheels /tmp/wheels
COPY requirements.txt /tmp/requirements.txt
RUN python3 -m venv /opt/venv \
 && /opt/venv/bin/pip install --no-cache-dir --no-index --find-links /tmp/wheels \
      -r /tmp/requirements.txt \
 && rm -rf /tmp/wheels

# setvars.sh is Intel's documented environment; BASH_ENV sources it in every `bash -c` the
# pipeline runs in this image.
RUN echo '. /opt/intel/oneapi/setvars.sh >/dev/null 2>&1' > /etc/oneapi-env.sh
ENV BASH_ENV=/etc/oneapi-env.sh \
    PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1
