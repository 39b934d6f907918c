"""grpc.health.v1 check for the head pod's exec probes.

The kubelet's native gRPC probe speaks plaintext only, so when the server runs with TLS the
chart probes through this script instead: it connects to 127.0.0.1 over TLS, trusting the
mounted secret's ca.crt (or tls.crt when the certificate is self-signed), checks the server
certificate against --server-name, and sends the bearer token when one is mounted.

Exit status: 0 when the service reports SERVING, 1 otherwise (the reason goes to stderr).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--service", default="", help='health service name; "" is the whole server')
    p.add_argument("--timeout", type=float, default=5.0, help="seconds for connect + call")
    p.add_argument("--tls-dir", type=Path, default=None, help="folder with ca.crt or tls.crt")
    p.add_argument("--server-name", default=None, help="name the server certificate must carry")
    p.add_argument("--token-file", type=Path, default=None, help="bearer token to send")
    return p.parse_args(argv)


def trust_root(tls_dir: Path) -> bytes:
    """The CA bundle to verify the server with: ca.crt when the secret has one, else tls.crt."""
    for name in ("ca.crt", "tls.crt"):
        path = tls_dir / name
        if path.is_file():
            return path.read_bytes()
    raise FileNotFoundError(f"neither ca.crt nor tls.crt in {tls_dir}")


def open_channel(args: argparse.Namespace) -> grpc.Channel:
    target = f"{args.host}:{args.port}"
    if args.tls_dir is None:
        return grpc.insecure_channel(target)
    creds = grpc.ssl_channel_credentials(root_certificates=trust_root(args.tls_dir))
    # The probe dials 127.0.0.1, but the certificate names the Service; check it against that.
    options = [("grpc.ssl_target_name_override", args.server_name)] if args.server_name else []
    return grpc.secure_channel(target, creds, options=options)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    metadata = None
    if args.token_file is not None:
        # the file's first token: one per line, blank and # lines skipped (as the server reads it)
        lines = [line.strip() for line in args.token_file.read_text().splitlines()]
        token = next((line for line in lines if line and not line.startswith("#")), "")
        metadata = [("authorization", f"Bearer {token}")]
    try:
        with open_channel(args) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            reply = stub.Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout, metadata=metadata
            )
    except grpc.RpcError as exc:
        print(f"unhealthy: service {args.service!r}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"unhealthy: {exc}", file=sys.stderr)
        return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"service {args.service!r}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main())
