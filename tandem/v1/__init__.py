"""Generated protobuf and gRPC stubs of the ``tandem.v1`` wire contract.

Sources: ``protos/tandem/v1/*.proto``; regenerate with ``python scripts/gen_protos.py``.
Import the modules directly (``from tandem.v1 import engine_pb2``): this package
imports nothing itself, so that importing one contract does not load the others.
"""
