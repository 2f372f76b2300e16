"""A workspace with a network, for the fork tests: an internal client-server pair through the
workspace's own eth0 address, a persistent connection to a fake internet host, and a server
on port 8000 that answers with this workspace's name (/tmp/who) and the pair's counter.

State goes to /tmp/netstate: "<count> <external: alive N | closed:ERROR>".
argv: ws_ip fake_ip fake_port
"""

import os
import socket
import sys
import threading
import time

ws_ip, fake, fport = sys.argv[1], sys.argv[2], int(sys.argv[3])
count = 0


def listener(addr, port):
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((addr, port))
    s.listen(16)
    return s


def echo(c):
    while data := c.recv(64):
        c.sendall(data)


def serve(srv, handler):
    while True:
        c, _ = srv.accept()
        threading.Thread(target=handler, args=(c,), daemon=True).start()


def answer(c):
    try:
        with open("/tmp/who") as f:
            who = f.read().strip()
    except FileNotFoundError:
        who = "source"
    c.sendall(f"{who} {count}\n".encode())
    c.close()


internal_srv = listener(ws_ip, 7000)
public_srv = listener("0.0.0.0", 8000)
threading.Thread(target=serve, args=(internal_srv, echo), daemon=True).start()
threading.Thread(target=serve, args=(public_srv, answer), daemon=True).start()
internal = socket.create_connection((ws_ip, 7000), timeout=10)
ext = socket.create_connection((fake, fport), timeout=10)
ext.settimeout(10)  # a hang would show as "closed:timeout"
ext_state, ext_n = "alive", 0
while True:
    internal.sendall(b"p")
    assert internal.recv(1) == b"p"
    count += 1
    if ext_state == "alive":
        try:
            ext.sendall(b"x")
            if ext.recv(1) == b"x":
                ext_n += 1
            else:
                ext_state = "closed:EOF"
        except OSError as e:
            ext_state = "closed:" + type(e).__name__
    shown = f"alive {ext_n}" if ext_state == "alive" else ext_state
    with open("/tmp/netstate.tmp", "w") as f:
        f.write(f"{count} {shown}")
    os.rename("/tmp/netstate.tmp", "/tmp/netstate")
    time.sleep(0.02)  # the workload's pace
