# syntax=docker/dockerfile:1
# Images of the Trainium Operator. Targets:
#   operator     slim: the kopf operator, no torch          docker build --target operator -t trainium-operator .
#   trainer      the trainer on a Neuron PyTorch training base image (NEURON_BASE_IMAGE): trn1,
#                and trn2 on SDK 2.29, through torch-xla + NxD
#   trainer-torchneuron  the trainer on TorchNeuron's training image (TORCHNEURON_BASE_IMAGE):
#                trn2 on SDK 2.33 and later, the native `neuron` device
#   trainer-cpu  the trainer on plain Python with CPU PyTorch, for local runs
# Packages install the way README.md documents: pip with the pins in tools/constraints.txt.
# The operator and trainer-cpu targets install their dependencies (named by pyproject.toml, pinned
# by the constraints) in a layer of their own before the code is copied: a change to the code
# rebuilds from the layer cache without installing torch again. pip's download cache is a build
# cache mount (never in the image). tools/images builds those two with podman on a local Debian
# base (docs/images.md).

ARG PYTHON_IMAGE=python:3.11.7-slim-bookworm
# The Neuron deep-learning container (public.ecr.aws/neuron/pytorch-training-neuronx). The Neuron
# backend is written against SDK 2.29: torch 2.9.0 + torch-xla 2.9 + torch-neuronx 2.9 + NxD
# (release 2.29), the last SDK that trains through PyTorch/XLA (2.30 drops it for training).
ARG NEURON_BASE_IMAGE=public.ecr.aws/neuron/pytorch-training-neuronx:2.9.0-neuronx-py312-sdk2.29.0-ubuntu24.04

# TorchNeuron, Neuron's native PyTorch backend (SDK 2.33: PyTorch 2.13 or 2.14 with torch-neuronx
# 2.13.3 / 2.14.3, Ubuntu 26.04, Python 3.14). AWS publishes its training image as
# public.ecr.aws/neuron/pytorch-training-neuronx; the tag below follows SDK 2.33's naming and was
# not confirmed (no registry reachable here): set this to the tag AWS lists at
# https://github.com/aws-neuron/deep-learning-containers. The build fails if the base is not it.
ARG TORCHNEURON_BASE_IMAGE=public.ecr.aws/neuron/pytorch-training-neuronx:2.14.0-neuronx-py314-sdk2.33.0-ubuntu26.04

FROM ${PYTHON_IMAGE} AS source
WORKDIR /src
COPY pyproject.toml README.md ./
COPY tools/constraints.txt tools/constraints.txt
COPY api api
COPY trainer trainer
COPY operator operator

# The operator and trainer extras' dependencies as pip requirement files (pyproject.toml names them)
FROM ${PYTHON_IMAGE} AS requirements
COPY pyproject.toml tools/constraints.txt /deps/
RUN python -c "import tomllib; p = tomllib.load(open('/deps/pyproject.toml', 'rb'))['project']; [open(f'/deps/{e}.txt', 'w').write('\n'.join(p['dependencies'] + p['optional-dependencies'][e]) + '\n') for e in ('operator', 'trainer')]"

FROM ${PYTHON_IMAGE} AS operator
WORKDIR /app
# The dependencies first, in a layer of their own: only a change to their list or pins rebuilds it
COPY --from=requirements /deps/operator.txt /deps/constraints.txt /deps/
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install -r /deps/operator.txt -c /deps/constraints.txt \
    && rm -rf /deps
COPY --from=source /src /src
# UID and GID 65532, as the chart's securityContext (Debian has a group named operator, GID 37,
# so the user is not named operator: useradd would refuse to make its group)
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install "/src[operator]" -c /src/tools/constraints.txt \
    && rm -rf /src \
    && groupadd --gid 65532 trainium-operator \
    && useradd --uid 65532 --gid 65532 --no-create-home --shell /usr/sbin/nologin trainium-operator
USER 65532
EXPOSE 8080 8081
ENTRYPOINT ["python", "-m", "trainium_operator"]

FROM ${NEURON_BASE_IMAGE} AS trainer
# The base image brings torch, torch-xla, torch-neuronx, neuronx-distributed (and numpy) matched
# to its SDK; install our package and only our other dependencies, never replacing those, and
# fail the build if the base lacks one of them.
COPY --from=source /src /src
RUN pip install --no-cache-dir --no-deps /src \
    && pip install --no-cache-dir -c /src/tools/constraints.txt \
       tokenizers sentencepiece pyarrow safetensors prometheus-client kubernetes s3fs pyyaml fsspec xxhash tensorboard \
    && rm -rf /src \
    && python -c "import torch, torch_xla, torch_neuronx, neuronx_distributed; print('torch', torch.__version__, 'torch-neuronx', torch_neuronx.__version__)"
ENV PYTHONUNBUFFERED=1 MALLOC_ARENA_MAX=64
ENTRYPOINT ["python", "-m", "trainer.launch"]

FROM ${TORCHNEURON_BASE_IMAGE} AS trainer-torchneuron
# As the trainer target: the base's torch and torch-neuronx are never replaced. Our other
# dependencies are not held to tools/constraints.txt here: its pins are tested on Python 3.11
# and 3.12, and this base is 3.14. The check imports torch-neuronx (it registers the `neuron`
# device and process group backend, as trainer.model.backends does) and needs PyTorch past 2.9.
COPY --from=source /src /src
RUN pip install --no-cache-dir --no-deps /src \
    && pip install --no-cache-dir \
       "tokenizers>=0.19" "sentencepiece>=0.2" "pyarrow>=15" "safetensors>=0.4" "prometheus-client>=0.20" "kubernetes>=29" \
       "s3fs>=2024.6" "pyyaml>=6" "fsspec>=2024.6" "xxhash>=3" "tensorboard>=2.16" \
    && rm -rf /src \
    && python -c "import torch, torch_neuronx; assert tuple(map(int, torch.__version__.split('+')[0].split('.')[:2])) > (2, 9), torch.__version__; print('torch', torch.__version__, 'torch-neuronx', torch_neuronx.__version__)"
ENV PYTHONUNBUFFERED=1 MALLOC_ARENA_MAX=64
ENTRYPOINT ["python", "-m", "trainer.launch"]

FROM ${PYTHON_IMAGE} AS trainer-cpu
# The dependencies first, in a layer of their own: only a change to their list or pins rebuilds it
COPY --from=requirements /deps/trainer.txt /deps/constraints.txt /deps/
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install -r /deps/trainer.txt -c /deps/constraints.txt \
    && rm -rf /deps
COPY --from=source /src /src
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install "/src[trainer]" -c /src/tools/constraints.txt \
    && rm -rf /src \
    && useradd --uid 65532 --create-home --shell /usr/sbin/nologin trainer
USER 65532
ENV PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
ENTRYPOINT ["python", "-m", "trainer.launch"]
