# syntax=docker/dockerfile:1
# Images of the Trainium Operator. Targets:
#   operator     slim: the kopf operator, no torch          docker build --target operator -t trainium-operator .
#   trainer      the trainer on a Neuron PyTorch training base image (NEURON_BASE_IMAGE)
#   trainer-cpu  the trainer on plain Python with CPU PyTorch, for local runs
# Packages install the way README.md documents: pip with the pins in tools/constraints.txt.

ARG PYTHON_IMAGE=python:3.11.7-slim-bookworm
# The Neuron deep-learning container for your SDK (public.ecr.aws/neuron/pytorch-training-neuronx).
ARG NEURON_BASE_IMAGE=public.ecr.aws/neuron/pytorch-training-neuronx:2.7.0-neuronx-py310-sdk2.24.0-ubuntu22.04

FROM ${PYTHON_IMAGE} AS source
WORKDIR /src
COPY pyproject.toml README.md ./
COPY tools/constraints.txt tools/constraints.txt
COPY trainer trainer
COPY operator operator

FROM ${PYTHON_IMAGE} AS operator
WORKDIR /app
COPY --from=source /src /src
RUN pip install --no-cache-dir "/src[operator]" -c /src/tools/constraints.txt \
    && rm -rf /src \
    && useradd --uid 65532 --no-create-home --shell /usr/sbin/nologin operator
USER 65532
EXPOSE 8080 8081
ENTRYPOINT ["python", "-m", "trainium_operator"]

FROM ${NEURON_BASE_IMAGE} AS trainer
# The base image brings torch + torch-neuronx + neuronx-distributed matched to its SDK; install
# our package and its other dependencies without letting pip replace that torch.
COPY --from=source /src /src
RUN pip install --no-cache-dir --no-deps /src \
    && pip install --no-cache-dir -c /src/tools/constraints.txt \
       tokenizers pyarrow safetensors prometheus-client kubernetes s3fs numpy pyyaml fsspec \
    && rm -rf /src
ENV PYTHONUNBUFFERED=1 MALLOC_ARENA_MAX=64
ENTRYPOINT ["python", "-m", "trainer.launch"]

FROM ${PYTHON_IMAGE} AS trainer-cpu
COPY --from=source /src /src
RUN pip install --no-cache-dir "/src[trainer]" -c /src/tools/constraints.txt \
    && rm -rf /src \
    && useradd --uid 65532 --create-home --shell /usr/sbin/nologin trainer
USER 65532
ENV PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
ENTRYPOINT ["python", "-m", "trainer.launch"]
