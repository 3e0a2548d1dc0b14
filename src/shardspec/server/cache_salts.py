"""Which requests share the prefix cache: each request's cache salt under `shardspec serve --cache-salt`.

The engine shares cached blocks and saved states only between requests of the same salt, and evicts
first from the salt holding the most (orchestrator.prefix). Without salts every request shares one
pool: a client that guesses another's prompt learns that it was sent from `cached_tokens` and from
its time to first token. Kept free of the server's dependencies, so the CLI reads the modes cheaply.
"""

from __future__ import annotations

import hashlib
import secrets

CACHE_SALT_MODES = ("optional", "required", "from-key")


class CacheSalts:
    """The server's --cache-salt mode, and a secret of its own for the keyed hashes of from-key."""

    def __init__(self, mode: str = "optional"):
        if mode not in CACHE_SALT_MODES:
            raise ValueError(f"--cache-salt must be one of {', '.join(CACHE_SALT_MODES)}, got {mode!r}")
        self.mode = mode
        self.secret = secrets.token_bytes(32)  # per process: a salt tells nothing of its key, and cannot be forged

    def salt(self, authorization: str | None, given: str | None) -> str | None:
        """A request's salt from its Authorization header and its body's cache_salt; an ApiError when
        the mode refuses it."""
        from shardspec.server.api import ApiError  # (here: the CLI reads the modes without pydantic)

        if self.mode == "optional":
            return given
        if self.mode == "required":
            if given is None:
                raise ApiError(400, "this server requires cache_salt (a string naming who may share this "
                               "request's prefix cache) in every request", "cache_salt")
            return given
        if given is not None:
            raise ApiError(400, "this server derives cache_salt from the request's API key (--cache-salt "
                           "from-key): leave it out", "cache_salt")
        scheme, _, key = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise ApiError(401, "this server needs an API key (Authorization: Bearer KEY): its prefix cache "
                           "is shared only between requests of the same key")
        return hashlib.blake2b(key.strip().encode(), key=self.secret, digest_size=16).hexdigest()
