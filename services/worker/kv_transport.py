"""KV blocks between engines (prefill/decode disaggregation), over ZeroMQ.

A producer's worker runs a `KVServer`: a thread that answers each fetch with the bytes of the blocks an export
names, every layer's keys and values, as the cache holds them. Exports are named by a one-time random token
that only the scheduler, the api and the consumer it hands the request to ever see. A consumer's worker
fetches with `fetch_blocks` (off the step, in its own thread) straight into the blocks its scheduler allocated.

With a secret (`key_file`), both ends speak CURVE: the server's and the client's key pairs are derived from
the secret, and the server's authenticator admits the one client key, so a peer without the secret completes no
handshake and is never answered. Without one, the 128-bit token is all that guards an export: the docs say to
give a key file to engines on different hosts.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
import warnings

import msgpack
import torch
import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

log = logging.getLogger("pagedserve.worker.kv_transport")

# A producer that answers nothing this long is taken for dead, and the prompt is computed. An export is announced
# with the producer's next step, which may trail the consumer's fetch by a step: an unknown token is asked again.
FETCH_TIMEOUT_SECONDS = 10.0
MAX_REQUEST_BYTES = 1 << 20  # a token and block numbers; nothing larger is read


def layout_of(cache: torch.Tensor) -> str:
    """The shape of one block of every layer and the dtype: what a fetch's bytes must fit."""
    layers, pair, _, *block = cache.shape
    return "x".join(str(n) for n in (layers, pair, *block)) + f":{str(cache.dtype).removeprefix('torch.')}"


def read_secret(key_file: str) -> bytes:
    with open(key_file, "rb") as f:
        secret = f.read().strip()
    if len(secret) < 16:
        raise ValueError(f"the KV transfer key file {key_file} holds {len(secret)} bytes; it needs at least 16")
    return secret


def key_pair(secret: bytes, side: str) -> tuple[bytes, bytes]:
    """A CURVE (public, secret) pair derived from the shared secret, one per side."""
    private = z85.encode(hashlib.sha256(side.encode() + b"\0" + secret).digest())
    return zmq.curve_public(private), private


class _OneClient:
    """The authenticator's rule: only the client key derived from the secret."""

    def __init__(self, public: bytes):
        self.public = public

    def callback(self, domain: str, key: bytes) -> bool:
        return z85.encode(key) == self.public if len(key) == 32 else key == self.public


class KVServer:
    def __init__(self, cache: torch.Tensor, endpoint: str, secret: bytes | None, context: zmq.Context):  # type: ignore[type-arg]
        self.cache = cache
        self.exports: dict[bytes, list[int]] = {}
        self.lock = threading.Lock()  # an export ends only between two answers
        self.auth: ThreadAuthenticator | None = None
        self.socket = context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
        self.socket.setsockopt(zmq.LINGER, 0)
        if secret is not None:
            self.auth = ThreadAuthenticator(context)
            self.auth.start()
            self.auth.configure_curve_callback("*", credentials_provider=_OneClient(key_pair(secret, "client")[0]))
            public, private = key_pair(secret, "server")
            self.socket.curve_server = True
            self.socket.curve_publickey, self.socket.curve_secretkey = public, private
        self.socket.bind(endpoint)
        self.address = endpoint
        self.served_bytes = 0
        # The socket is the thread's alone (ZeroMQ sockets are not thread-safe): `close` asks it to stop.
        stop_endpoint = f"inproc://kv-server-stop-{id(self)}"
        self._stop = context.socket(zmq.PAIR)
        self._stop.bind(stop_endpoint)
        self._stopped = context.socket(zmq.PAIR)
        self._stopped.connect(stop_endpoint)
        self._thread = threading.Thread(target=self._serve, name="kv-server", daemon=True)
        self._thread.start()

    def export(self, token: bytes, block_ids: list[int]) -> None:
        with self.lock:
            self.exports[token] = list(block_ids)

    def end(self, token: bytes) -> None:
        with self.lock:
            self.exports.pop(token, None)

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        poller.register(self._stopped, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())
                if self._stopped in ready:
                    return
                frames = self.socket.recv_multipart()
                identity, body = frames[0], frames[-1]
                try:
                    self.socket.send_multipart([identity, *self._answer(body)], copy=False)
                except zmq.ZMQError:
                    continue
        except zmq.ZMQError:
            return  # the context is closing
        finally:
            self.socket.close(linger=0)
            self._stopped.close(linger=0)

    def _answer(self, body: bytes) -> list[object]:
        try:
            token, indices = msgpack.unpackb(body, raw=True)
            if type(token) is not bytes or not isinstance(indices, list) or not all(type(i) is int for i in indices):
                raise ValueError("malformed")
        except Exception:
            return [b"bad"]
        with self.lock:
            blocks = self.exports.get(token)
            if blocks is None:
                return [b"unknown"]
            if not indices or not all(0 <= i < len(blocks) for i in indices):
                return [b"bad"]
            chosen = torch.tensor([blocks[i] for i in indices], dtype=torch.int64)
            data = self.cache.index_select(2, chosen).contiguous()
        raw = data.view(torch.uint8).numpy()
        self.served_bytes += raw.nbytes
        return [b"ok", raw]

    def close(self) -> None:
        if self._thread.is_alive():
            self._stop.send(b"")
            self._thread.join(timeout=5)
        self._stop.close(linger=0)
        if self.auth is not None:
            self.auth.stop()


def fetch_blocks(
    cache: torch.Tensor,
    address: str,
    token: bytes,
    src_blocks: list[int],
    dst_blocks: list[int],
    secret: bytes | None,
    context: zmq.Context,  # type: ignore[type-arg]
    timeout: float | None = None,
) -> int:
    """Fetch an export's blocks `src_blocks` (indices into it) into this cache's `dst_blocks`; the bytes moved.
    Raises on any failure: no answer in time, an unknown export, bytes that do not fit."""
    timeout = FETCH_TIMEOUT_SECONDS if timeout is None else timeout
    deadline = time.monotonic() + timeout
    request = msgpack.packb([token, src_blocks])
    expected: int = len(dst_blocks) * cache[:, :, 0].numel() * cache.element_size()
    while True:
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, expected + (1 << 16))
        if secret is not None:
            sock.curve_serverkey = key_pair(secret, "server")[0]
            sock.curve_publickey, sock.curve_secretkey = key_pair(secret, "client")
        try:
            sock.connect(address)
            sock.send(request)
            left = deadline - time.monotonic()
            if left <= 0 or not sock.poll(int(left * 1000)):
                raise TimeoutError(f"no answer from {address} in {timeout:g} s")
            status, *rest = sock.recv_multipart(copy=False)
        finally:
            sock.close(linger=0)
        if status.bytes == b"unknown" and time.monotonic() < deadline:
            time.sleep(0.005)
            continue
        if status.bytes != b"ok" or len(rest) != 1:
            raise LookupError(f"the producer answered {status.bytes!r}")
        payload = rest[0].buffer
        if len(payload) != expected:
            raise ValueError(f"{len(payload)} bytes for {len(dst_blocks)} blocks of {expected // len(dst_blocks)}")
        with warnings.catch_warnings():  # read-only bytes, copied into the cache at once
            warnings.simplefilter("ignore", UserWarning)
            blocks = torch.frombuffer(payload, dtype=torch.uint8).view(cache.dtype)
        shape = (cache.shape[0], cache.shape[1], len(dst_blocks), *cache.shape[3:])
        cache[:, :, torch.tensor(dst_blocks, dtype=torch.int64)] = blocks.view(shape)
        return expected
