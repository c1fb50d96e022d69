"""Speculative decoding: draft proposers (n-gram prompt lookup, suffix decoding) that guess a
request's next tokens from its own sequence and from recently finished requests."""
