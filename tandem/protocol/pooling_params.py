"""Parameters of a pooling (embedding) request, and their validation (vLLM's names)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tandem.protocol.sampling_params import InvalidRequestError

PoolingType = Literal["LAST", "MEAN", "CLS"]
POOLING_TYPES: tuple[str, ...] = ("LAST", "MEAN", "CLS")
SUPPORTED_TASKS: tuple[str, ...] = ("embed",)  # "classify" needs a classification head


@dataclass
class PoolingParams:
    """How to turn a prompt's final hidden states into one vector; the request produces
    no tokens.

    ``pooling_type``: LAST (the last prompt token's state: decoder models' default),
    MEAN (the average over the prompt) or CLS (the first token's state). ``dimensions``:
    keep only the first N values (Matryoshka truncation), before ``normalize`` (L2 to
    unit length).
    """

    task: str = "embed"
    pooling_type: PoolingType = "LAST"
    normalize: bool = True
    dimensions: int | None = None

    def validate(self, hidden_size: int | None = None) -> None:
        """Raise InvalidRequestError naming the first bad field."""
        if self.task not in SUPPORTED_TASKS:
            raise InvalidRequestError(
                "pooling_params.task", self.task, f"supported tasks: {', '.join(SUPPORTED_TASKS)}"
            )
        if self.pooling_type not in POOLING_TYPES:
            raise InvalidRequestError(
                "pooling_params.pooling_type", self.pooling_type, f"one of {', '.join(POOLING_TYPES)}"
            )
        if not isinstance(self.normalize, bool):
            raise InvalidRequestError("pooling_params.normalize", self.normalize, "must be a boolean")
        if self.dimensions is not None:
            if isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int) or self.dimensions < 1:
                raise InvalidRequestError("pooling_params.dimensions", self.dimensions, "must be an integer >= 1")
            if hidden_size is not None and self.dimensions > hidden_size:
                raise InvalidRequestError(
                    "pooling_params.dimensions", self.dimensions, f"at most the model's hidden size ({hidden_size})"
                )

    @property
    def skips_prefix_cache(self) -> bool:
        """MEAN and CLS pooling need the hidden state of every (the first) prompt token,
        which a prefix-cache hit would not compute."""
        return self.pooling_type != "LAST"
