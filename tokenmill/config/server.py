"""Settings of `tokenmill serve` beyond the engine's (flags and TOKENMILL_* variables alike)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.config.fields import parse_size
from tokenmill.errors import ConfigError


@dataclass
class ServerConfig:
    """Settings of `tokenmill serve` beyond the engine's (flags and TOKENMILL_* variables alike)."""

    host: str = field(default="127.0.0.1", metadata={"help": "Address to bind (loopback by default)."})
    port: int = field(default=8000, metadata={"help": "Port to listen on."})
    api_key: str | None = field(default=None, metadata={
        "help": "Require 'Authorization: Bearer KEY' on the API (health, metrics and version stay open)."})
    max_queue_len: int = field(default=512, metadata={
        "help": "Waiting requests (those in flight beyond --max-num-seqs) beyond which new ones get 429 "
                "with Retry-After."})
    request_timeout: float | None = field(default=600.0, metadata={
        "help": "Seconds after which a request is aborted (none: no limit)."})
    shutdown_grace: float = field(default=30.0, metadata={
        "help": "On SIGTERM/SIGINT, seconds to let in-flight requests finish before exiting."})
    slo: str | None = field(default=None, metadata={
        "help": "SLO-aware admission by ttft and/or tpot bounds, e.g. ttft=1s,tpot=100ms (bare numbers are ms): "
                "a request predicted to miss either bound under the current load gets 429 with Retry-After at "
                "once, instead of queueing and making everyone after it miss too. Predictions come from this "
                "machine's calibration profile (tokenmill calibrate), else the roofline model (a warning says "
                "so)."})
    profile: str | None = field(default=None, metadata={
        "help": "Calibration profile for --slo (default: the one `tokenmill calibrate` saved for this machine "
                "and model)."})
    disable_dashboard: bool = field(default=False, metadata={
        "help": "Do not serve the live dashboard page (GET /dashboard) and its data endpoint."})
    exclude_tools_when_tool_choice_none: bool = field(default=False, metadata={
        "help": "Leave a chat request's tools out of its prompt when its tool_choice is \"none\" (vLLM's flag). "
                "By default the model sees them, as with any other tool_choice, but no call is parsed or "
                "enforced; kept, they also keep the prompt's prefix the same for the prefix cache."})
    max_request_body_bytes: int | str = field(default=16 * 2**20, metadata={
        "help": "Largest request body accepted, in bytes or with a unit (16MiB); larger ones get 413."})

    def __post_init__(self):
        if not 0 < self.port < 65536:
            raise ConfigError(f"port must be in 1..65535, got {self.port}", param="port")
        if self.max_queue_len < 1:
            raise ConfigError("max_queue_len must be >= 1", param="max_queue_len")
        self.max_request_body_bytes = parse_size(self.max_request_body_bytes)
        if self.max_request_body_bytes < 1:
            raise ConfigError("max_request_body_bytes must be >= 1", param="max_request_body_bytes")
        if self.request_timeout is not None and self.request_timeout <= 0:
            self.request_timeout = None
        if self.slo is not None:
            from tokenmill.planning.admission import parse_admission_slo

            parse_admission_slo(self.slo)
