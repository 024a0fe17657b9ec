# qcluster image: one image for the manager and the masters (`qcluster manager|master ...`).
# Build: docker build -t qcluster:0.1.0 .   (no Docker engine on the development machine:
# tests/deploy checks this file's structure, not a build).
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY qcluster ./qcluster
COPY slot ./slot
COPY master ./master
COPY manager ./manager
COPY admin_ui ./admin_ui
COPY demo ./demo
RUN python -m venv /opt/qcluster \
 && /opt/qcluster/bin/pip install --no-cache-dir .

FROM python:3.11-slim
RUN useradd --system --uid 10001 --home-dir /var/lib/qcluster --create-home qcluster
COPY --from=build /opt/qcluster /opt/qcluster
COPY examples /app/examples
ENV PATH=/opt/qcluster/bin:$PATH \
    PYTHONPATH=/app \
    PYTHONUNBUFFERED=1 \
    QCLUSTER_STATE_DIR=/var/lib/qcluster
WORKDIR /var/lib/qcluster
USER 10001
EXPOSE 7300 7301
ENTRYPOINT ["qcluster"]
CMD ["--help"]
