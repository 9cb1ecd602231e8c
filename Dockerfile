FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY rollout_gateway ./rollout_gateway
COPY gateway ./gateway
COPY backends ./backends
COPY bench ./bench
COPY migrations ./migrations
COPY web ./web
RUN pip install --no-cache-dir ".[postgres]"
EXPOSE 8000
ENTRYPOINT ["rollout-gateway"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
