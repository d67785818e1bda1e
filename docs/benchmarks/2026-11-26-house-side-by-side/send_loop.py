"""3,000 `Producer.send` calls in one process, for comparing two trees' client-side cost:
    PYTHONPATH=<tree> python send_loop.py LABEL
into `delaysvc_micro` on the local server (migrated with levels 1s 2s 3s 5s 8s, and
`ALTER DATABASE delaysvc_micro SET synchronous_commit = off`, so the disk's flush time does
not drown the difference). Works with the flat package's module paths and the packages'."""

import sys
import time

try:
    from delaysvc.config.settings import Settings
    from delaysvc.db.engines import make_engine
    from delaysvc.producer.sending import Producer
except ImportError:  # before the house
    from delaysvc.settings import Settings

    from delaysvc.db import make_engine
    from delaysvc.producer import Producer

URL = "postgresql://root@127.0.0.1:5432/delaysvc_micro"
settings = Settings(database_url=URL, delay_levels="1s 2s 3s 5s 8s")
producer = Producer(settings, make_engine(settings))
for _ in range(200):  # warm: pool, prepared statements
    producer.send("micro", {"n": 1}, delay="5m")
SENDS = 3000
began = time.perf_counter()
for n in range(SENDS):
    producer.send("micro", {"n": n}, delay="5m")
print(sys.argv[1], round(SENDS / (time.perf_counter() - began)))
