"""What frontends and engines share, without torch: the domain side of ``tandem.v1``.

``sampling_params`` and ``outputs`` are the domain objects (requests, sampling
parameters, step outputs), ``convert`` maps them to and from protobuf at each edge,
``model_config`` reads a checkpoint's JSON files, ``fingerprint`` identifies a
tokenizer. Nothing here imports torch, so a frontend runs without it.
"""
