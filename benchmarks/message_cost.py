"""What one message costs on this host: the floor under every hop of the split.

Each case sends ``--messages`` small messages (120 bytes) from a sender process to a
receiver process over loopback TCP and prints the CPU microseconds per message of each
side (user + system, every thread of the process, from /proc), once back to back and once
``--gap-us`` apart (the receiver has gone to sleep before each message arrives, as a
client stream between two engine steps has):

- ``socket``: a plain ``send`` on a TCP socket (what the kernel and a wake-up cost);
- ``grpc.aio client stream``: ``await call.write()`` on a stream-stream call, as the
  frontend writes adds and acknowledgements to an engine;
- ``grpc sync client stream``: the same call with grpcio's thread-based API, fed from a
  queue;
- ``grpc.aio server stream``: a server handler yielding messages to a reading client, as
  the frontend answers a DELTA stream.

The sender's spin between spaced messages is measured per thread and taken off. On the
2-core KVM Xeon of issue 32 a spaced socket send costs ~20 us (waking the receiver), a
back-to-back one ~1 us, and a grpc.aio message 50-90 us: every message of the split pays
that, which is why the split merges steps and ``--stream-interval`` exists.

    python -m benchmarks.message_cost                  # 3,000 messages a case
    python -m benchmarks.message_cost --smoke          # a few (tests)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import queue
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import grpc

MESSAGE = b"x" * 120
METHOD = "/tandem.bench.Messages/Stream"
TICKS = os.sysconf("SC_CLK_TCK")


def process_cpu(pid: int) -> float:
    """Seconds of CPU (user + system, all threads) of process ``pid`` so far (another
    process's from /proc, in clock ticks)."""
    if pid == os.getpid():
        return time.process_time()
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def spin(seconds: float) -> float:
    """Busy-wait ``seconds``; the calling thread's CPU spent doing it."""
    start = time.thread_time()
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass
    return time.thread_time() - start


def _identity(data: bytes) -> bytes:
    return data


# ---- receivers (child processes) ---------------------------------------------------------


def _socket_receiver(port_queue: Any, total: int) -> None:
    srv = socket.create_server(("127.0.0.1", 0))
    port_queue.put(srv.getsockname()[1])
    conn, _ = srv.accept()
    got = 0
    while got < total:
        data = conn.recv(1 << 16)
        if not data:
            break
        got += len(data)


def _grpc_server(port_queue: Any, count: int, gap: float, serve_stream: bool) -> None:
    """A server that reads a client stream to its end (``serve_stream`` False), or
    writes ``count`` messages ``gap`` apart to the client (True)."""

    async def consume(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
        if serve_stream:
            await anext(requests)  # the client says go
            for _ in range(count):
                yield MESSAGE
                if gap:
                    spin(gap)  # a burst of work between messages, as the frontend's
            return
        async for _ in requests:
            pass
        yield b"done"

    async def main() -> None:
        server = grpc.aio.server()
        handler = grpc.stream_stream_rpc_method_handler(consume, _identity, _identity)
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("tandem.bench.Messages", {"Stream": handler}),)
        )
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        port_queue.put(port)
        await server.wait_for_termination()

    asyncio.run(main())


def _spawn(target: Callable[..., None], *args: Any) -> tuple[mp.Process, int]:
    ctx = mp.get_context("spawn")
    ports = ctx.Queue()
    proc = ctx.Process(target=target, args=(ports, *args), daemon=True)
    proc.start()
    return proc, ports.get(timeout=60)


# ---- the cases: each returns (sender us/message, receiver us/message) --------------------


def _measure(receiver: mp.Process, count: int, send: Callable[[], float]) -> tuple[float, float]:
    """``send`` sends ``count`` messages and returns the CPU its spinning took."""
    me = os.getpid()
    mine, theirs = process_cpu(me), process_cpu(receiver.pid)  # type: ignore[arg-type]
    spun = send()
    mine, theirs = process_cpu(me) - mine - spun, process_cpu(receiver.pid) - theirs  # type: ignore[arg-type]
    return mine / count * 1e6, theirs / count * 1e6


def socket_case(count: int, gap: float) -> tuple[float, float]:
    proc, port = _spawn(_socket_receiver, count * len(MESSAGE))
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def send() -> float:
        spun = 0.0
        for _ in range(count):
            sock.sendall(MESSAGE)
            if gap:
                spun += spin(gap)
        return spun

    try:
        time.sleep(0.2)
        result = _measure(proc, count, send)
        proc.join(30)
        return result
    finally:
        sock.close()
        proc.kill()


def aio_client_case(count: int, gap: float) -> tuple[float, float]:
    proc, port = _spawn(_grpc_server, count, gap, False)

    async def run() -> tuple[float, float]:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.stream_stream(METHOD, _identity, _identity)()
            for _ in range(20):  # the connection and the call are up
                await call.write(MESSAGE)
            await asyncio.sleep(0.2)
            me = os.getpid()
            mine, theirs = process_cpu(me), process_cpu(proc.pid)  # type: ignore[arg-type]
            spun = 0.0
            for _ in range(count):
                await call.write(MESSAGE)
                if gap:
                    spun += spin(gap)
            await asyncio.sleep(0.1)  # the last completions
            mine, theirs = process_cpu(me) - mine - spun, process_cpu(proc.pid) - theirs  # type: ignore[arg-type]
            await call.done_writing()
            await call.read()
            return mine / count * 1e6, theirs / count * 1e6

    try:
        return asyncio.run(run())
    finally:
        proc.kill()


def sync_client_case(count: int, gap: float) -> tuple[float, float]:
    proc, port = _spawn(_grpc_server, count, gap, False)
    inputs: queue.Queue[bytes | None] = queue.Queue()

    def requests() -> Iterator[bytes]:
        while (item := inputs.get()) is not None:
            yield item

    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    responses = channel.stream_stream(METHOD, _identity, _identity)(requests())
    for _ in range(20):
        inputs.put(MESSAGE)
    time.sleep(0.3)

    def send() -> float:
        spun = 0.0
        for _ in range(count):
            inputs.put(MESSAGE)
            spun += spin(gap) if gap else 0.0
        while not inputs.empty():
            time.sleep(0.01)
        time.sleep(0.1)
        return spun

    try:
        return _measure(proc, count, send)
    finally:
        inputs.put(None)
        list(responses)
        channel.close()
        proc.kill()


def aio_server_case(count: int, gap: float) -> tuple[float, float]:
    """Here the server (child) sends: its CPU is the sender's, this process reads."""
    proc, port = _spawn(_grpc_server, count, gap, True)

    async def run() -> tuple[float, float]:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.stream_stream(METHOD, _identity, _identity)()
            me = os.getpid()
            await call.write(b"go")
            await call.read()  # the first message: the stream is up
            mine, theirs = process_cpu(me), process_cpu(proc.pid)  # type: ignore[arg-type]
            for _ in range(count - 1):
                await call.read()
            mine, theirs = process_cpu(me) - mine, process_cpu(proc.pid) - theirs  # type: ignore[arg-type]
            spun = gap * (count - 1)  # the server's spin (wall time of pure CPU)
            return (theirs - spun) / (count - 1) * 1e6, mine / (count - 1) * 1e6

    try:
        return asyncio.run(run())
    finally:
        proc.kill()


CASES: dict[str, Callable[[int, float], tuple[float, float]]] = {
    "socket": socket_case,
    "grpc.aio client stream": aio_client_case,
    "grpc sync client stream": sync_client_case,
    "grpc.aio server stream": aio_server_case,
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=3000)
    ap.add_argument("--gap-us", type=float, default=500.0, help="spacing of the spaced runs (default 500)")
    ap.add_argument("--smoke", action="store_true", help="50 messages a case")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    count = 50 if args.smoke else args.messages
    print(f"{count} messages of {len(MESSAGE)} bytes a case, loopback TCP; CPU us per message "
          f"(sender / receiver), back to back and {args.gap_us:.0f} us apart", flush=True)
    results: dict[str, dict[str, list[float]]] = {}
    for name, case in CASES.items():
        row = {}
        for label, gap in (("back to back", 0.0), ("spaced", args.gap_us / 1e6)):
            row[label] = list(case(count, gap))
        results[name] = row
        cells = "   ".join(f"{label}: {s:6.1f} / {r:6.1f}" for label, (s, r) in row.items())
        print(f"  {name:26s} {cells}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"messages": count, "gap_us": args.gap_us, "us_per_message": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
