# A GPU workstation image: Python 3.11 plus requirements.txt. PyPI's torch wheels bundle CUDA,
# so the host needs only the NVIDIA driver and the container toolkit (docker run --gpus all).
# Build: ./run build     Run: ./run docker train.py ...   (the same entry points as ./run)
FROM python:3.11-slim-bookworm

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    WDSDIST_SYSTEM_PYTHON=1

# curl: for pipe:curl shard URLs. gcc and libjpeg-turbo's headers: wdsdist/data/jpegcrop.c, which
# decodes only the training crop's region of a JPEG. Versions follow the base image's Debian release.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends curl ca-certificates gcc libc6-dev libjpeg62-turbo-dev \
    && rm -rf /var/lib/apt/lists/*

RUN useradd --create-home --uid 1000 app
WORKDIR /app

# Dependencies first: this layer is rebuilt only when requirements.txt changes.
COPY requirements.txt ./
RUN pip install -r requirements.txt

COPY --chown=app:app . .
# Build jpegcrop now (into .build/), so the container never needs a writable source tree for it.
RUN python3 -c "import sys; from wdsdist.data import jpegcrop; lib = jpegcrop.load(); sys.exit(lib if isinstance(lib, str) else 0)" \
    && mkdir -p data outputs && chown app:app data outputs
USER 1000:1000

# ./run inside the image uses the image's Python (WDSDIST_SYSTEM_PYTHON=1), not a venv.
ENTRYPOINT ["./run"]
CMD ["train.py"]
