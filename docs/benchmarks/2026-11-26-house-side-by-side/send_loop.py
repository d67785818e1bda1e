import time, sys
import delaysvc
try:
    from delaysvc.config.settings import Settings
    from delaysvc.producer.sending import Producer
    from delaysvc.db.engines import make_engine
except ImportError:
    from delaysvc.settings import Settings
    from delaysvc.producer import Producer
    from delaysvc.db import make_engine
s = Settings(database_url="postgresql://root@127.0.0.1:5432/delaysvc_micro", delay_levels="1s 2s 3s 5s 8s")
e = make_engine(s)
p = Producer(s, e)
for _ in range(200): p.send("micro", {"n": 1}, delay="5m")
t = time.perf_counter(); n = 3000
for i in range(n): p.send("micro", {"n": i}, delay="5m")
print(sys.argv[1], round(n / (time.perf_counter() - t)))
