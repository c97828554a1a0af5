# One image for every genq service: producer, consumers, monitor, the simulator, rq-dashboard.
#   docker build -t genq .
# A machine that cannot pull from a registry builds on a local Python/Debian image instead:
#   docker build --build-arg BASE_IMAGE=genq-base:bookworm -t genq .   (.ci/docker-engine.sh)
ARG BASE_IMAGE=python:3.12-slim
FROM ${BASE_IMAGE}

ENV VIRTUAL_ENV=/opt/genq \
    PATH=/opt/genq/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# genq runs as an unprivileged user; /data (data sets) and /out (shards, exports) belong to it,
# so named volumes mounted there start out writable.
RUN python3 -m venv "$VIRTUAL_ENV" \
 && useradd --system --uid 10001 --user-group --create-home --home-dir /home/genq genq \
 && mkdir -p /data /out \
 && chown genq:genq /data /out

WORKDIR /src
# Dependencies first, from pyproject.toml alone: they change rarely, so editing genq's code
# rebuilds only the last small layer.
COPY pyproject.toml ./
RUN python3 -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
print('\n'.join(p['dependencies'] + p['optional-dependencies']['dashboard']))" >/tmp/req.txt \
 && pip install -r /tmp/req.txt "setuptools>=68" wheel \
 && rm /tmp/req.txt

COPY README.md ./
COPY common common
COPY consumer consumer
COPY genq genq
COPY monitor monitor
COPY producer producer
COPY simulator simulator
RUN pip install --no-deps --no-build-isolation . && rm -rf /src/build

USER genq
WORKDIR /out
# compose runs it with `init: true`, so SIGTERM reaches genq and `docker compose down` is quick.
CMD ["genq", "--help"]
