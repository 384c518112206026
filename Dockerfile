# rlpost for NVIDIA GPUs: Python 3.11, Ray 2.60, vLLM's CUDA build and rlpost, run as a non-root user.
#
#   docker build -t REGISTRY/rlpost:0.1.0 .
#   docker run --rm --gpus all --shm-size=16g REGISTRY/rlpost:0.1.0 doctor configs/gsm8k-qwen2.5-1.5b.yaml
#
# The same image runs the Ray head, the GPU workers and the job drivers (deploy/README.md): KubeRay
# and the cluster launcher start `ray start` in it themselves.
#
# Base: NVIDIA's CUDA runtime image. The torch and vLLM wheels carry their own CUDA libraries, so
# the base provides what the NVIDIA container toolkit expects (NVIDIA_* variables, driver mounts)
# and little else. A Ray or vLLM base image would bring its own Ray/torch/vLLM versions, and those
# must match rlpost's pins and each other exactly (`rlpost doctor` checks them); here pip resolves
# them all from pyproject.toml in one install.
FROM nvidia/cuda:12.8.1-runtime-ubuntu22.04

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PATH=/opt/venv/bin:$PATH

# rlpost needs Python 3.11 (Ubuntu 22.04 ships 3.10). Triton, under vLLM, compiles small
# launchers at run time, so the image keeps a C compiler and the Python headers.
RUN apt-get update \
 && apt-get install -y --no-install-recommends software-properties-common gpg-agent \
 && add-apt-repository -y ppa:deadsnakes/ppa \
 && apt-get update \
 && apt-get install -y --no-install-recommends python3.11 python3.11-venv python3.11-dev build-essential git curl \
 && rm -rf /var/lib/apt/lists/* \
 && python3.11 -m venv /opt/venv \
 && echo 'export PATH=/opt/venv/bin:$PATH' > /etc/profile.d/rlpost-venv.sh

WORKDIR /app
COPY pyproject.toml README.md ./
COPY rlpost ./rlpost
RUN pip install --upgrade pip setuptools wheel \
 && pip install ".[gpu]"
COPY configs ./configs
# the shipped tiny models (5.4 MB), so the tiny configs run in the image as they do in a checkout
COPY models ./models

# Non-root. Run directories (logging.run_dir, default runs/ under /app) and the Hugging Face cache
# are written by this user; mount shared storage over them on a cluster (deploy/).
RUN useradd --create-home --uid 1000 rlpost \
 && chown -R rlpost:rlpost /app
USER rlpost
ENV HF_HOME=/home/rlpost/.cache/huggingface

# 8265: Ray dashboard and Jobs API (`rlpost submit | status | logs | stop --address http://HEAD:8265`)
# 6379: Ray GCS on the head (workers join it; `rlpost train --address HEAD:6379`)
# 8080: Prometheus metrics of each node when Ray starts with --metrics-export-port=8080
#       (the rlpost_* metrics, with Ray's ray_ prefix)
EXPOSE 8265 6379 8080

ENTRYPOINT ["rlpost"]
CMD ["--help"]
