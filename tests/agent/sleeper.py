"""A rank that announces itself and sleeps: started by the launcher tests under torchrun."""

import os
import time

print(f"rank {os.environ.get('RANK')} up", flush=True)
time.sleep(600)
