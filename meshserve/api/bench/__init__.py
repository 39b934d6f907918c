"""`meshserve bench`: a serving benchmark against a running server, over gRPC or the OpenAI HTTP API.

loadgen.py   the requests (random token-id prompts of fixed or ranged lengths), their arrival
             (Poisson at --request-rate, capped at --max-concurrency), one client per backend
             (gRPC, OpenAI completions, OpenAI chat completions)
datasets.py  requests from a ShareGPT-format JSON file instead
report.py    TTFT, TPOT, inter-token latency percentiles and throughputs; the table, JSON and PNG
command.py   the command line
"""
