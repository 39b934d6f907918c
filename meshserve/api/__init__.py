"""The faces of meshserve: the Python `LLM`, the gRPC service `meshserve.v1.Inference`
(health, reflection, auth, TLS, metrics) and the OpenAI-compatible HTTP API (http/).

llm.py      LLM (the public Python API, `from meshserve import LLM`) and the `meshserve generate` command
server.py   ApiServer: the grpc.aio server over any InferenceService
servicer.py the Inference methods: requests in, deltas out, errors as status codes
convert.py  proto messages <-> SamplingParams / CompletionDelta, with the API's own limits
status.py   which meshserve error becomes which status code
auth.py     bearer-token interceptor and TLS credentials
health.py   grpc.health.v1 status that follows the service's health
metrics.py  Prometheus metrics and their HTTP endpoint
serve.py    the `meshserve serve` command
client.py   InferenceClient and AsyncInferenceClient (typed results, retries); client_cli.py: `meshserve client`
http/       the OpenAI-compatible HTTP API (FastAPI + uvicorn) over the same InferenceService
hub.py      `--model org/name`: hub model ids through huggingface_hub's cache
bench/      `meshserve bench`: serving benchmark over gRPC or HTTP
protogen.py regenerates meshserve/v1/inference_pb2*.py from the proto
"""
