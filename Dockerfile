# Build: docker build -t raahi .
FROM rust:1-bookworm AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY src src
COPY ui ui
COPY migrations migrations
COPY benches benches
RUN cargo build --release --locked --bin raahi

FROM debian:bookworm-slim
# curl serves the container health check on /readyz.
RUN apt-get update && apt-get install -y --no-install-recommends curl ca-certificates \
    && rm -rf /var/lib/apt/lists/*
# A fixed numeric id, so volume permissions and runAsNonRoot policies can name it.
RUN groupadd --system --gid 10001 raahi \
    && useradd --system --uid 10001 --gid 10001 --home /var/lib/raahi raahi \
    && mkdir -p /var/lib/raahi/data /etc/raahi && chown -R 10001:10001 /var/lib/raahi
COPY --from=build /src/target/release/raahi /usr/local/bin/raahi
COPY config/raahi.toml /etc/raahi/raahi.toml
USER 10001:10001
WORKDIR /var/lib/raahi
ENV RAAHI_ADMIN_LISTEN=0.0.0.0:9080
EXPOSE 8080 9080
HEALTHCHECK --interval=5s --timeout=2s --retries=3 CMD curl -fsS http://127.0.0.1:9080/readyz >/dev/null || exit 1
ENTRYPOINT ["raahi", "--config", "/etc/raahi/raahi.toml"]
CMD ["serve"]
