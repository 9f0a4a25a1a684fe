# tokengate image: one static binary on a distroless base.
#   docker build -t tokengate .
# The image runs `tokengate serve --config /etc/tokengate/tokengate.yaml` by default;
# the compose stack also runs it as the mock LLM (`tokengate mock-llm --listen :9000`).

FROM golang:1.26.8 AS build
WORKDIR /src
# Modules first, so source edits do not invalidate the download layer.
COPY go.mod go.sum ./
RUN go mod download
COPY . .
# CGO_ENABLED=0: a static binary that runs on distroless/static (no libc).
# The tokenizer's encodings are compiled in: the binary needs no network at run time.
RUN CGO_ENABLED=0 go build -trimpath -ldflags="-s -w" -o /out/tokengate ./cmd/tokengate

FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /out/tokengate /usr/local/bin/tokengate
USER nonroot:nonroot
# 50051: ext_proc gRPC and gRPC health (for Envoy). 9090: /metrics, /healthz, /readyz.
EXPOSE 50051 9090
ENTRYPOINT ["/usr/local/bin/tokengate"]
CMD ["serve", "--config", "/etc/tokengate/tokengate.yaml"]
