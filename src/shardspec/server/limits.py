"""What one HTTP client may cost the server: the limits of `shardspec serve` and their defaults.

Kept free of the server's dependencies, so the CLI reads the defaults without importing uvicorn;
guard.py enforces them.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_BODY_BYTES = 4 << 20  # ~4 MB of prompt text, or ~600k token ids as JSON
DEFAULT_READ_TIMEOUT_S = 30.0
DEFAULT_MAX_CONNECTIONS = 512  # beyond it uvicorn answers 503; keeps fds below the usual limit of 1024
MAX_HEADER_BYTES = 16 << 10  # h11's own default, stated: a request line and headers beyond it get 400
KEEP_ALIVE_S = 5


@dataclass(frozen=True)
class HttpLimits:
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    read_timeout_s: float = DEFAULT_READ_TIMEOUT_S  # for a request's headers, and again for its body
    max_connections: int = DEFAULT_MAX_CONNECTIONS

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1:
            raise ValueError(f"--max-body-bytes must be positive, got {self.max_body_bytes}")
        if not self.read_timeout_s > 0:
            raise ValueError(f"--read-timeout must be positive, got {self.read_timeout_s}")
        if self.max_connections < 1:
            raise ValueError(f"--max-connections must be positive, got {self.max_connections}")
