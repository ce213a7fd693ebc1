"""The api's listening socket: every connection it accepts sends small writes at once (Nagle's
algorithm off), so a streamed token is never held back waiting for the client's acknowledgement
of the one before."""

import asyncio
import socket

from services.api.__main__ import listen


def test_a_connection_the_api_accepts_has_nagles_algorithm_off():
    async def accepted_nodelay() -> int:
        sock = listen("127.0.0.1", 0)
        sock.listen()
        port = sock.getsockname()[1]
        seen: asyncio.Future = asyncio.get_running_loop().create_future()

        async def on_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            accepted = writer.get_extra_info("socket")
            seen.set_result(accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(on_connection, sock=sock)  # as uvicorn serves the socket
        async with server:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            value = await asyncio.wait_for(seen, 10)
            writer.close()
        return value

    assert asyncio.run(accepted_nodelay()) != 0
