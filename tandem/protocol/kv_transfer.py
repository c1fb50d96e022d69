"""KV transfer between engines (disaggregated prefill and decode): the domain types.

The wire form is ``tandem.v1.KvTransferParams`` (protos/tandem/v1/kv_transfer.proto);
``tandem.protocol.convert`` converts both ways.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.protocol.sampling_params import InvalidRequestError

KV_ROLES = ("producer", "consumer", "both")

# The one cache layout engines speak today: per layer, K and V each
# [num_blocks, block_size, num_kv_heads, head_dim], row-major.
LAYOUT_NHD = "NHD"


@dataclass
class KvTransferParams:
    """Where a request's KV lives and how to pull it (see kv_transfer.proto)."""

    do_remote_decode: bool = False  # to a producer: hold the KV when the request finishes
    do_remote_prefill: bool = False  # to a consumer: pull the KV instead of computing it
    remote_engine_id: str = ""
    remote_address: str = ""  # the producer's KvTransfer service, host:port
    remote_request_id: str = ""
    remote_block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # one per full block
    num_tokens: int = 0  # tokens whose KV the blocks hold
    block_size: int = 0
    expires_at: float = 0.0  # Unix epoch seconds
    transfer_secret: bytes = field(default=b"", repr=False)

    def validate_remote(self) -> None:
        """Raise InvalidRequestError when the consumer-side fields are inconsistent."""
        name = "kv_transfer_params"
        if not self.remote_address:
            raise InvalidRequestError(
                f"{name}.remote_address", "", "is required with do_remote_prefill"
            )
        if not self.remote_request_id:
            raise InvalidRequestError(
                f"{name}.remote_request_id", "", "is required with do_remote_prefill"
            )
        if self.block_size < 1:
            raise InvalidRequestError(f"{name}.block_size", self.block_size, "must be >= 1")
        if self.num_tokens < 1:
            raise InvalidRequestError(f"{name}.num_tokens", self.num_tokens, "must be >= 1")
        want = -(-self.num_tokens // self.block_size)
        if len(self.remote_block_ids) != want:
            raise InvalidRequestError(
                f"{name}.remote_block_ids",
                f"<{len(self.remote_block_ids)} ids>",
                f"{self.num_tokens} tokens in blocks of {self.block_size} need {want} block ids",
            )
        if len(set(self.remote_block_ids)) != len(self.remote_block_ids):
            raise InvalidRequestError(f"{name}.remote_block_ids", "<ids>", "has duplicates")
        if len(self.block_hashes) > self.num_tokens // self.block_size:
            raise InvalidRequestError(
                f"{name}.block_hashes",
                f"<{len(self.block_hashes)} hashes>",
                "has more entries than the transfer has full blocks",
            )
        if len(self.transfer_secret) < 8:
            raise InvalidRequestError(
                f"{name}.transfer_secret", "<secret>", "must hold at least 8 bytes"
            )
