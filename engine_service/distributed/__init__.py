"""Tensor parallelism inside one engine: rank 0 is the engine process, ranks 1..N-1
its worker processes (see executor.py for the layout, sharding.py for who holds what)."""
