#!/usr/bin/env bash
# The secrets of a fabricwatch deployment: a CA, the gateway's TLS certificate, and one
# token per collector with the tokens file the gateway reads (streams/auth.py).
#
#   deploy/compose/make-secrets.sh [--out DIR] [--host NAME]... [--collector NAME=GLOB[,GLOB]]...
#
#   --out DIR          where to write (default: ./secrets next to this script)
#   --host NAME        a DNS name or IP address the gateway is reached by (repeatable;
#                      localhost, 127.0.0.1 and "gateway" are always in the certificate)
#   --collector N=G    a collector named N allowed to report the sources matching the
#                      fnmatch globs G (repeatable). Default: one collector "local"
#                      for "node-*,leaf-*,spine-*".
#
# Writes (mode 600, except the public certificates):
#   ca.pem, ca-key.pem               the CA; ca.pem is the collectors' gateway.ca_cert
#   gateway-cert.pem, gateway-key.pem  for `fabricwatch gateway --tls-cert/--tls-key`
#   tokens.yaml                      SHA-256 digests only, for `fabricwatch gateway --tokens`
#   <collector>.token                each collector's bearer token, for its gateway.token_file
# Existing files are kept (idempotent); a collector already in tokens.yaml is not re-issued.
# Keep ca-key.pem offline once the certificates are made. Needs openssl and sha256sum.
set -euo pipefail

OUT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/secrets"
HOSTS=()
COLLECTORS=()
while (( $# )); do
    case "$1" in
        --out) OUT="${2:?--out needs a directory}"; shift 2 ;;
        --host) HOSTS+=("${2:?--host needs a name}"); shift 2 ;;
        --collector) COLLECTORS+=("${2:?--collector needs NAME=GLOB}"); shift 2 ;;
        -h|--help) sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}"; exit 0 ;;
        *) echo "make-secrets: unknown argument: $1" >&2; exit 2 ;;
    esac
done
(( ${#COLLECTORS[@]} )) || COLLECTORS=("local=node-*,leaf-*,spine-*")
command -v openssl >/dev/null || { echo "make-secrets: openssl not found" >&2; exit 3; }

umask 077
mkdir -p "$OUT"
cd "$OUT"

if [[ ! -f ca.pem ]]; then
    openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 3650 \
        -keyout ca-key.pem -out ca.pem -subj "/CN=fabricwatch CA" \
        -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
    echo "make-secrets: CA -> $OUT/ca.pem" >&2
fi

if [[ ! -f gateway-cert.pem ]]; then
    san="DNS:localhost,IP:127.0.0.1,DNS:gateway"
    for h in "${HOSTS[@]}"; do
        if [[ "$h" =~ ^[0-9.]+$ || "$h" == *:* ]]; then san+=",IP:$h"; else san+=",DNS:$h"; fi
    done
    openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout gateway-key.pem \
        -out gateway.csr -subj "/CN=fabricwatch gateway" 2>/dev/null
    printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth\nbasicConstraints=CA:FALSE\n' "$san" > gateway.ext
    openssl x509 -req -in gateway.csr -CA ca.pem -CAkey ca-key.pem -CAcreateserial -days 825 \
        -extfile gateway.ext -out gateway-cert.pem 2>/dev/null
    rm -f gateway.csr gateway.ext ca.srl
    echo "make-secrets: gateway certificate ($san) -> $OUT/gateway-cert.pem" >&2
fi

[[ -f tokens.yaml ]] || echo "collectors:" > tokens.yaml
for spec in "${COLLECTORS[@]}"; do
    name="${spec%%=*}"
    globs="${spec#*=}"
    [[ "$name" =~ ^[A-Za-z0-9][A-Za-z0-9._-]*$ && "$spec" == *=* && -n "$globs" ]] \
        || { echo "make-secrets: bad --collector '$spec' (NAME=GLOB[,GLOB])" >&2; exit 2; }
    if grep -q "^  - name: $name\$" tokens.yaml; then
        echo "make-secrets: collector $name already in tokens.yaml; kept" >&2
        continue
    fi
    token="$(openssl rand -base64 32 | tr '+/' '-_' | tr -d '=\n')"
    printf '%s\n' "$token" > "$name.token"
    digest="$(printf '%s' "$token" | sha256sum | cut -d' ' -f1)"
    list=""
    IFS=',' read -ra parts <<< "$globs"
    for g in "${parts[@]}"; do list+="${list:+, }\"$g\""; done
    printf '  - name: %s\n    token_sha256: %s\n    sources: [%s]\n' "$name" "$digest" "$list" >> tokens.yaml
    echo "make-secrets: collector $name ($globs) -> $OUT/$name.token" >&2
done
chmod 644 ca.pem gateway-cert.pem
# The containers run as uid 10001 and must read the gateway key and the tokens file.
if [[ "$(id -u)" == 0 ]]; then
    chown 10001:10001 gateway-key.pem tokens.yaml
    chmod 600 gateway-key.pem tokens.yaml
else
    chmod 644 gateway-key.pem tokens.yaml
    echo "make-secrets: not root, so gateway-key.pem and tokens.yaml are world-readable for the" \
         "container user 10001; as root, run: chown 10001:10001 $OUT/{gateway-key.pem,tokens.yaml}" \
         "&& chmod 600 $OUT/{gateway-key.pem,tokens.yaml}" >&2
fi
