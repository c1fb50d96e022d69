"""``vllm.grpc.engine.VllmEngine`` on the engine's port: vLLM's gRPC protocol (from the
PyPI ``smg-grpc-proto`` package), so SMG and other clients of vLLM's gRPC mode can drive
a Tandem engine. ``convert`` is the one edge between that proto and the domain types;
``servicer`` is thin; ``kv_events`` publishes the prefix cache for cache-aware routing.
"""
