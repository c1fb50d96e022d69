"""``POST /v1/embeddings`` in OpenAI's shape, on ``AsyncLLM.encode``."""

from __future__ import annotations

import asyncio
import base64
import struct
import uuid
from typing import Any

from frontend_service.openai.protocol import EmbeddingRequest

MAX_INPUTS = 2048


async def create(llm: Any, model_name: str, body: EmbeddingRequest) -> dict[str, Any]:
    """One pooling request per input, run concurrently; vectors in input order."""
    from tandem.protocol.sampling_params import InvalidRequestError

    inputs = body.inputs()
    if len(inputs) > MAX_INPUTS:
        raise InvalidRequestError("input", f"<{len(inputs)} inputs>", f"at most {MAX_INPUTS}")
    params = body.pooling_params()
    params.validate()
    request_id = f"embd-{uuid.uuid4().hex}"

    async def one(index: int, kwargs: dict[str, Any]) -> tuple[list[float], int]:
        async for out in llm.encode(params, request_id=f"{request_id}-{index}", priority=body.priority, **kwargs):
            return out.outputs.data, len(out.prompt_token_ids)
        raise RuntimeError("the pooling request ended without an output")

    results = await asyncio.gather(*(one(i, kw) for i, kw in enumerate(inputs)))
    data = []
    for index, (vector, _) in enumerate(results):
        embedding: Any = vector
        if body.encoding_format == "base64":  # little-endian float32, as OpenAI sends it
            embedding = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
        data.append({"object": "embedding", "index": index, "embedding": embedding})
    tokens = sum(n for _, n in results)
    return {
        "id": request_id, "object": "list", "model": model_name, "data": data,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
