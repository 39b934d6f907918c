"""Moving KV between replicas: wire format, capabilities and pins, the rank-side export and pull,
the transports (data planes), the digest kernel and re-shard between (tp, dcp) layouts."""
