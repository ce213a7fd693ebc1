"""Which user owns the other end of a TCP connection, when that end is on this machine.

The kernel answers an exact socket lookup over netlink (sock_diag), the same query `ss` makes:
the peer's socket is named by its own address and port and by ours, and the reply carries the
user that owns it. A peer on another machine (or in another network namespace) is not found."""

from __future__ import annotations

import socket
import struct

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST = 1
NLMSG_ERROR = 2
ALL_STATES = 0xFFFFFFFF
TCP_ESTABLISHED = 1
NO_COOKIE = 0xFFFFFFFF
HEADER = struct.Struct("=IHHII")  # nlmsghdr: length, type, flags, sequence, port id
REQUEST = struct.Struct("=BBBxI")  # inet_diag_req_v2: family, protocol, extensions, states
SOCKET_ID = struct.Struct(">HH16s16s")  # inet_diag_sockid: ports and addresses, network order
SOCKET_ID_TAIL = struct.Struct("=III")  # interface and cookie, host order
UID_OFFSET = HEADER.size + 4 + SOCKET_ID.size + SOCKET_ID_TAIL.size + 12  # inet_diag_msg's idiag_uid


def peer_uid(connection: socket.socket) -> int | None:
    """The uid owning the socket at the other end of `connection`, or None where the kernel does
    not know it here (a remote peer, an end already closed, no sock_diag)."""
    try:
        family = connection.family
        peer, local = connection.getpeername(), connection.getsockname()
        request = (
            REQUEST.pack(family, socket.IPPROTO_TCP, 0, ALL_STATES)
            + SOCKET_ID.pack(peer[1], local[1], _address(family, peer[0]), _address(family, local[0]))
            + SOCKET_ID_TAIL.pack(0, NO_COOKIE, NO_COOKIE)
        )
        with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG) as netlink:
            netlink.settimeout(0.5)
            netlink.send(HEADER.pack(HEADER.size + len(request), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST, 1, 0) + request)
            reply = netlink.recv(8192)
    except (OSError, ValueError, IndexError):
        return None
    if len(reply) < UID_OFFSET + 4 or HEADER.unpack_from(reply)[1] != SOCK_DIAG_BY_FAMILY:
        return None  # NLMSG_ERROR: no such socket here
    if reply[HEADER.size + 1] != TCP_ESTABLISHED:
        return None  # a closed end lingers owned by nobody in particular (its uid reads 0)
    uid: int = struct.unpack_from("=I", reply, UID_OFFSET)[0]
    return uid


def _address(family: int, text: str) -> bytes:
    return socket.inet_pton(family, text.split("%")[0]).ljust(16, b"\x00")
