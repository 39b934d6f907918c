"""The OpenAI-compatible HTTP face of `meshserve serve`, over the same InferenceService as gRPC.

app.py                 the routes (FastAPI): /health, /v1/models, /v1/completions, /v1/chat/completions, /v1/embeddings
vllm_routes.py         vLLM's utility routes: /tokenize, /detokenize, /version, /metrics, /openapi.json
protocol.py            request bodies (pydantic) and their SamplingParams
responses.py           OpenAI's response bodies and SSE chunks from the service's deltas
streams.py             opening, merging and closing the service's streams; disconnects abort requests
chat.py                chat templates rendered as HF transformers renders them
errors.py              OpenAI's error shape; statuses from api/status.py
request_id.py          x-request-id on every response (echoed or made)
protocol_errors.py     the connection protocols (httptools, else h11): protocol errors in OpenAI's JSON shape
protocol_httptools.py  uvicorn's httptools protocol with those errors and h11's 16 KiB head limit
server.py              HttpServer: uvicorn on the serving event loop
"""
