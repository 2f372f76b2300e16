"""Inside a workspace: one persistent client each to redis, memcached and nginx (keep-alive)
through the workspace's own address, counting round trips into /tmp/srvstate."""

import os
import socket
import sys
import time

ip = sys.argv[1]


def conn(port):
    s = socket.create_connection((ip, port), timeout=10)
    return s, s.makefile("rb")


redis, rf = conn(6379)
memc, mf = conn(11211)
web, wf = conn(8080)
memc.sendall(b"set c 0 0 1\r\n0\r\n")
assert mf.readline() == b"STORED\r\n"
n = 0
while True:
    redis.sendall(b"*2\r\n$4\r\nINCR\r\n$1\r\nc\r\n")
    r = int(rf.readline()[1:])
    memc.sendall(b"incr c 1\r\n")
    m = int(mf.readline())
    web.sendall(b"GET /who HTTP/1.1\r\nHost: ws\r\n\r\n")
    length = 0
    while (line := wf.readline()) != b"\r\n":
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    wf.read(length)
    n += 1
    with open("/tmp/srvstate.tmp", "w") as f:
        f.write(f"{n} {r} {m}")
    os.rename("/tmp/srvstate.tmp", "/tmp/srvstate")
    time.sleep(0.02)  # the workload's pace
