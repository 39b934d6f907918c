"""`meshserve client`: the command line of api/client.py's InferenceClient.

Kept apart from the client so that building meshserve's CLI parser imports neither grpc nor the
generated stubs: `meshserve generate` and `meshserve backends` run where grpcio is missing or
older than the stubs need (the stubs refuse to import under grpcio < 1.85.1).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_client_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("client", help="stream a completion from a running `meshserve serve`")
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--address", default="127.0.0.1:50051", help="host:port of the server")
    p.add_argument("--model", default="", help="model name (default: the server's first)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    p.add_argument("--auth-token-file", default=None, help="file holding the server's bearer token")
    p.add_argument("--tls-ca", default=None, help="PEM file of the CA that signed the server certificate")
    p.add_argument("--tls", action="store_true", help="TLS with the system's root certificates")
    p.add_argument("--server-name", default=None, help="name to check in the server certificate")
    p.set_defaults(func=client_main)
    return p


def client_main(args: argparse.Namespace) -> int:
    """Print the prompt, then the streamed continuation; the finish reason goes to stderr."""
    import grpc

    from meshserve.api.client import FINISH_NAMES, InferenceClient

    token = None
    if args.auth_token_file:
        from meshserve.api.auth import read_token

        token = read_token(args.auth_token_file)
    roots = Path(args.tls_ca).read_bytes() if args.tls_ca else None
    sampling = {k: v for k, v in dict(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                                      top_p=args.top_p, seed=args.seed).items() if v is not None}
    with InferenceClient(args.address, token=token, tls=args.tls, root_certificates=roots,
                         server_name=args.server_name) as client:
        try:
            sys.stdout.write(args.prompt)
            reason, usage = "", None
            for r in client.stream(args.prompt, model=args.model, timeout=args.timeout, stop=args.stop, **sampling):
                sys.stdout.write(r.text)
                sys.stdout.flush()
                if r.finish_reason:
                    reason, usage = FINISH_NAMES[r.finish_reason], r.usage
            sys.stdout.write("\n")
        except grpc.RpcError as exc:
            sys.stdout.write("\n")
            print(f"meshserve client: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    print(f"[finished: {reason}; {usage.prompt_tokens} prompt + {usage.completion_tokens} completion tokens]",
          file=sys.stderr)
    return 0
