# Build: docker build -t portcullis .
# Run:   docker run -p 8080:8080 portcullis            (default policies)
#        docker run -v ./policies:/etc/portcullis/policies portcullis serve --policies /etc/portcullis/policies
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p portcullis \
 && install -D target/release/portcullis /out/portcullis

FROM debian:bookworm-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /out/portcullis /usr/local/bin/portcullis
COPY policies /etc/portcullis/policies
# Same unprivileged port and user model as the nginx-unprivileged image it replaces.
USER 65532:65532
EXPOSE 8080
ENTRYPOINT ["/usr/local/bin/portcullis"]
CMD ["serve"]
