# tokengate image: one static binary on a distroless base (no shell).
#   docker build -t tokengate .
# The image runs `tokengate serve --config /etc/tokengate/tokengate.yaml` by default
# (mount a configuration there whose listeners bind 0.0.0.0); the compose stack also
# runs it as the mock LLM (`tokengate mock-llm --listen :9000`). /bin/ratelimit is
# `tokengate ratelimit`: envoyproxy/ratelimit's command, configured by its environment.

FROM golang:1.26.8 AS build
WORKDIR /src
# Modules first, so source edits do not invalidate the download layer.
COPY go.mod go.sum ./
RUN go mod download
COPY . .
# CGO_ENABLED=0: a static binary that runs on distroless/static (no libc).
# The tokenizer's encodings are compiled in: the binary needs no network at run time.
RUN CGO_ENABLED=0 go build -trimpath -ldflags="-s -w" -o /out/tokengate ./cmd/tokengate
# /bin/ratelimit, the command Envoy Gateway's rate-limit Deployment runs: a link
# to the binary, which runs `tokengate ratelimit` when called ratelimit. The
# image has no shell to make it, so it is made here and copied as a directory
# (which keeps the link a link).
RUN mkdir -p /out/bin && ln -s /usr/local/bin/tokengate /out/bin/ratelimit

FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /out/tokengate /usr/local/bin/tokengate
COPY --from=build /out/bin/ /bin/
USER nonroot:nonroot
# 50051: ext_proc gRPC and gRPC health (for Envoy). 9090: /metrics, /healthz, /readyz.
EXPOSE 50051 9090
# The image has no shell or curl: tokengate probes its own /readyz.
HEALTHCHECK --interval=10s --timeout=3s --start-period=5s CMD ["/usr/local/bin/tokengate", "health", "--url", "http://127.0.0.1:9090/readyz"]
ENTRYPOINT ["/usr/local/bin/tokengate"]
CMD ["serve", "--config", "/etc/tokengate/tokengate.yaml"]
