import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
# Tiny models gain nothing from intra-op threads, and on a shared 2-core machine a second thread that
# waits for a busy core makes every small op (softmax above all) 10-100x slower.
torch.set_num_threads(1)
