"""What one HTTP client may cost the server: the limits of `shardspec serve` and their defaults.

Kept free of the server's dependencies, so the CLI reads the defaults without importing uvicorn;
guard.py enforces those of the transport, jobs.py the size of a response's log-probabilities.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_BODY_BYTES = 4 << 20  # ~4 MB of prompt text, or ~600k token ids as JSON
DEFAULT_READ_TIMEOUT_S = 30.0
DEFAULT_WRITE_TIMEOUT_S = 30.0
DEFAULT_SHUTDOWN_TIMEOUT_S = 5.0  # a signal: how long requests in flight may still run
DEFAULT_MAX_CONNECTIONS = 512  # beyond it uvicorn answers 503; keeps fds below the usual limit of 1024
MAX_HEADER_BYTES = 16 << 10  # h11's own default, stated: a request line and headers beyond it get 400
KEEP_ALIVE_S = 5
# a connection's kernel send buffer (Linux doubles it): fixed, so that a client that does not read holds
# this and the transport's 64 KiB at most (autotuning grows it to megabytes), and its writes pause soon
# enough for --write-timeout to tell; 128 KiB in flight still streams ~1 MB/s at 100 ms round trips
SEND_BUFFER_BYTES = 64 << 10
# choices x tokens x (top + 1): ~60 MB of chat JSON at most (a 22 KB request asked for 10.7M, 306 MB)
DEFAULT_MAX_LOGPROB_ENTRIES = 1_000_000


@dataclass(frozen=True)
class HttpLimits:
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    read_timeout_s: float = DEFAULT_READ_TIMEOUT_S  # for a request's headers, and again for its body
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    max_logprob_entries: int = DEFAULT_MAX_LOGPROB_ENTRIES  # log-probabilities one response may hold
    write_timeout_s: float = DEFAULT_WRITE_TIMEOUT_S  # a response the client does not read: how long it may stall
    shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S  # after a signal, the requests in flight may run this long

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1:
            raise ValueError(f"--max-body-bytes must be positive, got {self.max_body_bytes}")
        if not self.read_timeout_s > 0:
            raise ValueError(f"--read-timeout must be positive, got {self.read_timeout_s}")
        if self.max_connections < 1:
            raise ValueError(f"--max-connections must be positive, got {self.max_connections}")
        if self.max_logprob_entries < 1:
            raise ValueError(f"--max-logprob-entries must be positive, got {self.max_logprob_entries}")
        if not self.write_timeout_s > 0:
            raise ValueError(f"--write-timeout must be positive, got {self.write_timeout_s}")
        if not 0 <= self.shutdown_timeout_s <= 24 * 3600:
            raise ValueError(f"--shutdown-timeout must be in [0, 86400] seconds, got {self.shutdown_timeout_s}")
