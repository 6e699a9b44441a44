# Build: docker build -t raahi .
FROM rust:1-bookworm AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY src src
COPY migrations migrations
COPY benches benches
RUN cargo build --release --locked --bin raahi

FROM debian:bookworm-slim
RUN useradd --system --home /var/lib/raahi raahi && mkdir -p /var/lib/raahi/data /etc/raahi \
    && chown -R raahi /var/lib/raahi
COPY --from=build /src/target/release/raahi /usr/local/bin/raahi
COPY config/raahi.toml /etc/raahi/raahi.toml
USER raahi
WORKDIR /var/lib/raahi
ENV RAAHI_ADMIN_LISTEN=0.0.0.0:9080
EXPOSE 8080 9080
ENTRYPOINT ["raahi", "--config", "/etc/raahi/raahi.toml"]
CMD ["serve"]
