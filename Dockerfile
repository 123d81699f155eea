# Build: docker build -t portcullis .
# Run:   docker run -p 8080:8080 portcullis             (default policies)
#        docker run -v ./my-policies:/etc/portcullis/policies -p 8080:8080 portcullis
FROM rust:1.97-bookworm AS build
WORKDIR /src
COPY . .
ENV CARGO_TARGET_DIR=/src/target
RUN plugins/build.sh \
 && cargo build --release --locked -p portcullis \
 && install -D target/release/portcullis /out/portcullis \
 && mkdir -p /out/policies /out/plugins \
 && cp policies/*.yaml /out/policies/ \
 && cp plugins/dist/*.wasm /out/plugins/ \
 && rm /out/plugins/fixture-*.wasm

FROM debian:bookworm-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /out/portcullis /usr/local/bin/portcullis
# The default policies (their plugin is built in, as every standard
# plugin is: `builtin:NAME`); the standard plugins as files too, for
# policies that pin or copy them.
COPY --from=build /out/policies /etc/portcullis/policies
COPY --from=build /out/plugins /usr/share/portcullis/plugins
# Same unprivileged port and user model as the nginx-unprivileged image it replaces.
USER 65532:65532
EXPOSE 8080
ENTRYPOINT ["/usr/local/bin/portcullis"]
CMD ["serve", "--policies", "/etc/portcullis/policies"]
