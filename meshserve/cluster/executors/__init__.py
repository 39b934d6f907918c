"""How step plans reach a replica's ranks: in-process, threads, subprocesses, Ray actors, SPMD;
the step channel between driver and ranks, and the rank host that answers on each rank."""
