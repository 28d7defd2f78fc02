#!/usr/bin/env bash
# Build the openconfig/gnmi fake gNMI target that tests/test_switch_collector.py streams from.
#
#   deploy/gnmi/build-fake-server.sh        # prints the path of the binary the tests run
#
# Two binaries, both from github.com/openconfig/gnmi@$FAKE_SERVER_VERSION via the Go module
# proxy, installed once per version under $FABRICWATCH_GO_CACHE (default
# ~/.cache/fabricwatch/go); later runs only print the path (idempotent):
#
#   fake_server           upstream `go install .../testing/fake/gnmi/cmd/fake_server@VERSION`,
#                         unchanged. It listens on ":PORT", i.e. on EVERY interface.
#   fake_server_loopback  the same fake target (gnmi.NewClient(config).Run(stream), exactly
#                         what fake_server's Agent.Subscribe runs), same flags, but it listens
#                         on -listen_addr (default 127.0.0.1) only. The tests use this one.
#
# Needs Go >= 1.22 (Go 1.21 fetches that toolchain through the module proxy by itself).
# Nothing is written into this repository.
set -euo pipefail

FAKE_SERVER_VERSION="${FAKE_SERVER_VERSION:-v0.14.1}"   # github.com/openconfig/gnmi release
CACHE="${FABRICWATCH_GO_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/fabricwatch/go}"
BIN_DIR="$CACHE/bin/gnmi-$FAKE_SERVER_VERSION"
UPSTREAM="$BIN_DIR/fake_server"
LOOPBACK="$BIN_DIR/fake_server_loopback"

if [[ -x "$UPSTREAM" && -x "$LOOPBACK" ]]; then
    echo "$LOOPBACK"
    exit 0
fi
if ! command -v go >/dev/null 2>&1; then
    echo "build-fake-server: 'go' not found; install Go >= 1.22" >&2
    exit 3
fi

mkdir -p "$BIN_DIR"
# Module and build caches under CACHE too, so the build never touches a developer's GOPATH;
# -modcacherw keeps the cache removable with rm -rf.
export GOPATH="$CACHE/gopath"
export GOMODCACHE="$CACHE/gopath/pkg/mod"
export GOCACHE="${GOCACHE:-$CACHE/build}"
export GOFLAGS="-mod=mod -modcacherw"
export GO111MODULE=on

if [[ ! -x "$UPSTREAM" ]]; then
    echo "build-fake-server: go install github.com/openconfig/gnmi/testing/fake/gnmi/cmd/fake_server@$FAKE_SERVER_VERSION" >&2
    GOBIN="$BIN_DIR" go install "github.com/openconfig/gnmi/testing/fake/gnmi/cmd/fake_server@$FAKE_SERVER_VERSION" >&2
fi

if [[ ! -x "$LOOPBACK" ]]; then
    SRC="$CACHE/src/fake_server_loopback-$FAKE_SERVER_VERSION"
    rm -rf "$SRC"
    mkdir -p "$SRC"
    cat > "$SRC/go.mod" <<EOF
module fabricwatch.local/fakeserverloopback

go 1.22.0

require github.com/openconfig/gnmi $FAKE_SERVER_VERSION
EOF
    cat > "$SRC/main.go" <<'EOF'
// fake_server_loopback: the openconfig/gnmi fake target (testing/fake/gnmi) behind the same
// flags as cmd/fake_server, listening on -listen_addr only (fake_server binds every interface).
package main

import (
	"crypto/tls"
	"crypto/x509"
	"flag"
	"fmt"
	"net"
	"os"

	gnmipb "github.com/openconfig/gnmi/proto/gnmi"
	"github.com/openconfig/gnmi/testing/fake/gnmi"
	fpb "github.com/openconfig/gnmi/testing/fake/proto"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/protobuf/encoding/prototext"
	"google.golang.org/protobuf/proto"
)

var (
	configFile        = flag.String("config", "", "configuration file to load (fake.proto Config)")
	text              = flag.Bool("text", false, "the configuration file is a text proto")
	listenAddr        = flag.String("listen_addr", "127.0.0.1", "address to listen on")
	port              = flag.Int("port", -1, "port to listen on (0: any free port)")
	caCert            = flag.String("ca_crt", "", "CA certificate for client certificate validation")
	serverCert        = flag.String("server_crt", "", "TLS server certificate")
	serverKey         = flag.String("server_key", "", "TLS server private key")
	allowNoClientCert = flag.Bool("allow_no_client_auth", false, "request but do not require a client certificate")
)

type target struct {
	gnmipb.UnimplementedGNMIServer
	config *fpb.Config
}

// Subscribe is what the fake's Agent.Subscribe does: a fresh scripted client per stream.
func (t *target) Subscribe(stream gnmipb.GNMI_SubscribeServer) error {
	c := gnmi.NewClient(proto.Clone(t.config).(*fpb.Config))
	defer c.Close()
	return c.Run(stream)
}

func fail(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "fake_server_loopback: "+format+"\n", args...)
	os.Exit(2)
}

func main() {
	flag.Parse()
	if *configFile == "" || *port < 0 {
		fail("-config and -port are required")
	}
	in, err := os.ReadFile(*configFile)
	if err != nil {
		fail("%v", err)
	}
	cfg := &fpb.Config{}
	if *text {
		err = prototext.Unmarshal(in, cfg)
	} else {
		err = proto.Unmarshal(in, cfg)
	}
	if err != nil {
		fail("parse %s: %v", *configFile, err)
	}
	certificate, err := tls.LoadX509KeyPair(*serverCert, *serverKey)
	if err != nil {
		fail("server key pair: %v", err)
	}
	tlsCfg := &tls.Config{ClientAuth: tls.RequireAndVerifyClientCert, Certificates: []tls.Certificate{certificate}}
	if *allowNoClientCert {
		tlsCfg.ClientAuth = tls.RequestClientCert
	}
	if *caCert != "" {
		ca, err := os.ReadFile(*caCert)
		if err != nil {
			fail("%v", err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(ca) {
			fail("no certificate in %s", *caCert)
		}
		tlsCfg.ClientCAs = pool
	}
	lis, err := net.Listen("tcp", net.JoinHostPort(*listenAddr, fmt.Sprint(*port)))
	if err != nil {
		fail("listen: %v", err)
	}
	s := grpc.NewServer(grpc.Creds(credentials.NewTLS(tlsCfg)))
	gnmipb.RegisterGNMIServer(s, &target{config: cfg})
	fmt.Fprintf(os.Stderr, "fake_server_loopback: target %q listening on %s\n", cfg.Target, lis.Addr())
	if err := s.Serve(lis); err != nil {
		fail("serve: %v", err)
	}
}
EOF
    echo "build-fake-server: go build fake_server_loopback (github.com/openconfig/gnmi $FAKE_SERVER_VERSION)" >&2
    (cd "$SRC" && go build -trimpath -o "$LOOPBACK" . >&2)
fi
echo "$LOOPBACK"
