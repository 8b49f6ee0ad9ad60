# A GPU workstation image: Python 3.11 plus requirements.txt, the runtime set (the test and lint
# tools of requirements-dev.txt stay out of it). PyPI's torch wheels bundle CUDA, so the host
# needs only the NVIDIA driver and the container toolkit (docker run --gpus all).
# Build: ./run build     Run: ./run docker train.py ...   (the same entry points as ./run)
# Check: ./run check-image (builds it, trains in it, checks what lands in outputs/)
# BASE_IMAGE: any Debian bookworm image whose python3 is 3.11 with pip (deploy/check-image.sh
# passes a stand-in where no registry can be reached).
ARG BASE_IMAGE=python:3.11-slim-bookworm

# ---- runtime: what the final image needs; the jpegcrop stage starts from it too, so the large
# pip layer is built once and shared.
FROM ${BASE_IMAGE} AS runtime

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    WDSDIST_SYSTEM_PYTHON=1 \
    WDSDIST_BUILD=/app/.build

# curl: for pipe:curl shard URLs. libjpeg62-turbo: the library jpegcrop is linked against (its
# compiler and headers stay in the jpegcrop stage). Versions follow the base image's Debian release.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends curl ca-certificates libjpeg62-turbo \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app
# Dependencies first: this layer is rebuilt only when requirements.txt changes. python3 -m pip,
# not pip: a base image need not have a command named pip.
COPY requirements.txt ./
RUN python3 -m pip install -r requirements.txt

# ---- jpegcrop: wdsdist/data/decode/jpegcrop.c compiled by the code's own loader (the same file name
# and flags it would use at run time), so the final image needs no compiler. Into WDSDIST_BUILD:
# wdsdist alone, with no checkout around it, would build into the user's cache folder.
FROM runtime AS jpegcrop
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev libjpeg62-turbo-dev \
    && rm -rf /var/lib/apt/lists/*
COPY wdsdist ./wdsdist
RUN python3 -m wdsdist.tools.jpegcheck

# ---- the image
FROM runtime
# ./run docker runs as your uid:gid, which has no account here: HOME is somewhere any uid can
# write (caches of torch, matplotlib, ...).
ENV HOME=/tmp
COPY . .
# Read-only for the user: jpegcrop.load() only opens the prebuilt library.
COPY --from=jpegcrop /app/.build ./.build
# data/ and outputs/ for the default user when nothing is mounted over them.
RUN mkdir -p data outputs && chown 1000:1000 data outputs
USER 1000:1000

# ./run inside the image uses the image's Python (WDSDIST_SYSTEM_PYTHON=1), not a venv.
ENTRYPOINT ["./run"]
CMD ["train.py"]
