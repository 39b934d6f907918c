"""One replica's engine: EngineCore (schedule -> execute -> postprocess), the scheduler, requests,
admission, detokenizer, beam search and sample groups. Runs without Ray or zmq."""
