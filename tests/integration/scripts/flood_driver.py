"""A "worker" (with the job's keys) that floods the driver's ROUTER port with garbage, then checks the driver still answers.

Usage: flood_driver.py N. Sends N garbage frames (most long enough to carry a MAC, every
third one too short), then messages of 2, 3 and 5 frames, then a genuine heartbeat: the
driver handles one connection's messages in order, so its answer means it has handled
every frame before it. Prints what the driver answered and exits 0.
"""

import os
import sys

import zmq

from elasticrun.common import env
from elasticrun.common.auth import secure_client
from elasticrun.common.protocol import MAX_FRAME_BYTES, Codec
from elasticrun.worker.client import job_keys

n = int(sys.argv[1])
ctx = zmq.Context()
sock = ctx.socket(zmq.DEALER)
sock.setsockopt(zmq.LINGER, 0)
sock.setsockopt(zmq.SNDTIMEO, 30_000)
sock.setsockopt(zmq.RCVTIMEO, 30_000)
keys = job_keys()  # a peer with the job's transport keys (past CURVE) but sending garbage
secure_client(sock, keys, MAX_FRAME_BYTES)
sock.connect(os.environ[env.CONTROL_ADDR])
for i in range(n):
    sock.send(b"garbage frame %08d, long enough to be checked for a MAC" % i if i % 3 else b"short")
for parts in (2, 3, 5):  # the ROUTER sees one more frame: the sender's identity
    sock.send_multipart([b"part"] * parts)
codec = Codec(keys.secret, os.environ[env.JOB_ID], "flooder")
sock.send(codec.encode("heartbeat", {"worker": os.environ[env.WORKER_ID], "req": 1}))
print("the driver answered:", codec.decode(sock.recv()).type, flush=True)
sock.close(0)
ctx.term()
