"""`--kv-transfer-config`, in vLLM's JSON form: an engine's part in prefill/decode disaggregation.

A producer (`kv_producer`) computes prompts and keeps their KV blocks for a consumer to fetch; a consumer
(`kv_consumer`) fetches what it lacks of a prompt's blocks before computing the rest; `kv_both` does either,
as each request asks. The producer's worker answers fetches on `kv_port` (consumers reach it at `kv_ip`), or on an
`ipc://` path in `kv_connector_extra_config.address` on one host. Over tcp:// a `key_file` is required: every fetch
is encrypted and authenticated (ZeroMQ CURVE, keys derived from the file's secret), and a peer without the secret
gets nothing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

ROLES = ("kv_producer", "kv_consumer", "kv_both")
CONNECTORS = ("PagedserveConnector", "NixlConnector", "P2pNcclConnector")  # the others' names map to ours
DEFAULT_PORT = 14579


@dataclass(slots=True, frozen=True)
class KVTransferConfig:
    role: str
    connector: str = "PagedserveConnector"
    ip: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    address: str = ""  # an explicit ZeroMQ endpoint (ipc:// or tcp://) for the producer's KV server
    key_file: str = ""  # a secret shared by the engines: CURVE on every fetch
    hold_seconds: float = 30.0  # a producer frees blocks no consumer fetched after this long

    @property
    def produces(self) -> bool:
        return self.role in ("kv_producer", "kv_both")

    @property
    def consumes(self) -> bool:
        return self.role in ("kv_consumer", "kv_both")

    @property
    def endpoint(self) -> str:
        """Where consumers reach the producer's KV server: `address`, or `kv_ip`:`kv_port`."""
        return self.address or f"tcp://{self.ip}:{self.port}"

    @property
    def bind_endpoint(self) -> str:
        """Where the server listens: `address`, or `kv_port` on every interface (`kv_ip` may be a name)."""
        return self.address or f"tcp://*:{self.port}"

    @staticmethod
    def parse(text: str | None) -> KVTransferConfig | None:
        if not text:
            return None
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--kv-transfer-config is not JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise ValueError("--kv-transfer-config must be a JSON object")
        known = {"kv_connector", "kv_role", "kv_ip", "kv_port", "kv_rank", "kv_parallel_size", "kv_buffer_device"}
        unknown = set(raw) - known - {"kv_connector_extra_config", "engine_id", "kv_buffer_size"}
        if unknown:
            raise ValueError(f"--kv-transfer-config: unknown field(s) {', '.join(sorted(unknown))}")
        role = raw.get("kv_role")
        if role not in ROLES:
            raise ValueError(f"--kv-transfer-config: kv_role must be one of {', '.join(ROLES)}")
        connector = raw.get("kv_connector", "PagedserveConnector")
        if connector not in CONNECTORS:
            raise ValueError(
                f"--kv-transfer-config: kv_connector {connector!r} is not served; one of {', '.join(CONNECTORS)}"
            )
        port = raw.get("kv_port", DEFAULT_PORT)
        if type(port) is not int or not 1 <= port <= 65535:
            raise ValueError("--kv-transfer-config: kv_port must be a port number")
        ip = raw.get("kv_ip", "127.0.0.1")
        if not isinstance(ip, str) or not ip:
            raise ValueError("--kv-transfer-config: kv_ip must be a host address")
        extra = raw.get("kv_connector_extra_config", {})
        if not isinstance(extra, dict) or set(extra) - {"address", "key_file", "hold_seconds"}:
            raise ValueError("--kv-transfer-config: kv_connector_extra_config takes address, key_file and hold_seconds")
        address, key_file = extra.get("address", ""), extra.get("key_file", "")
        if not isinstance(address, str) or (address and not address.startswith(("ipc://", "tcp://"))):
            raise ValueError("--kv-transfer-config: address must be an ipc:// or tcp:// endpoint")
        if not isinstance(key_file, str):
            raise ValueError("--kv-transfer-config: key_file must be a path")
        if not key_file and not address.startswith("ipc://"):
            raise ValueError(
                "--kv-transfer-config: KV blocks over tcp:// need kv_connector_extra_config.key_file, a secret the "
                "engines share (CURVE encrypts and authenticates every fetch); on one host give an ipc:// address"
            )
        hold = extra.get("hold_seconds", 30.0)
        if type(hold) not in (int, float) or not 0 < hold <= 3600:
            raise ValueError("--kv-transfer-config: hold_seconds must be in (0, 3600]")
        return KVTransferConfig(role, "PagedserveConnector", ip, port, address, key_file, float(hold))

    def to_json(self) -> str:
        extra: dict[str, object] = {"hold_seconds": self.hold_seconds}
        if self.address:
            extra["address"] = self.address
        if self.key_file:
            extra["key_file"] = self.key_file
        raw = {"kv_connector": self.connector, "kv_role": self.role, "kv_ip": self.ip, "kv_port": self.port}
        return json.dumps({**raw, "kv_connector_extra_config": extra})
