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

# genq runs unprivileged: as user genq (uid 10001), the owner of /data (data sets) and /out
# (shards, exports), so named volumes mounted there start out writable, or as the owner of a
# host directory mounted there (the entrypoint below).
RUN python3 -m venv "$VIRTUAL_ENV" \
 && useradd --system --uid 10001 --user-group --create-home --home-dir /home/genq genq \
 && mkdir -p /data /out \
 && chown genq:genq /data /out

# The container starts as root only to choose whom genq runs as, then drops to that user
# (setpriv, util-linux): one started as another user already (`--user`, compose's GENQ_USER)
# stays that user; otherwise the owner of the working directory (/out; /data for compose's
# dataset service), so files written to a host directory belong to whoever owns it. A
# directory owned by root (Docker makes a missing bind-mount source so) is given to genq first.
RUN printf '%s\n' \
  '#!/bin/sh' \
  '# genq-entrypoint: run the command as the owner of the working directory (see Dockerfile).' \
  'set -e' \
  '[ "$(id -u)" = 0 ] || exec "$@"' \
  'uid=$(stat -c %u .) gid=$(stat -c %g .)' \
  'if [ "$uid" = 0 ]; then' \
  '  uid=10001 gid=10001' \
  '  chown "$uid:$gid" . 2>/dev/null || true  # read-only: genq says so at start-up' \
  'fi' \
  'if [ "$uid" = 10001 ]; then HOME=/home/genq; else HOME=/tmp; fi' \
  'export HOME' \
  'exec setpriv --reuid="$uid" --regid="$gid" --clear-groups -- "$@"' \
  >/usr/local/bin/genq-entrypoint \
 && chmod 755 /usr/local/bin/genq-entrypoint

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

WORKDIR /out
# compose runs it with `init: true`, so SIGTERM reaches genq and `docker compose down` is quick.
ENTRYPOINT ["genq-entrypoint"]
CMD ["genq", "--help"]
