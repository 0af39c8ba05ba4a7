"""Starts a thread when imported: test_rank_server.py's ranks import it (its
RANK_PRELOAD), so that their rank server cannot fork and they are new Pythons."""

import threading
import time

threading.Thread(target=time.sleep, args=(3600,), name="pgd-test-thread", daemon=True).start()
