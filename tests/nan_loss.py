"""
train.py with a fault injected from outside: the loss of the first policy update is NaN (as an
overflow or a corrupt batch would make it). tests/test_train.py runs it under torchrun, with
train.py's own command line, and checks that the update is skipped and the run goes on.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train  # noqa: E402
from nanoagent import rl  # noqa: E402
from nanoagent.common import exit_now  # noqa: E402

ppo_policy_loss = rl.ppo_policy_loss
poisoned = []


def nan_in_the_first_update(*args, **kwargs):
    per_token, stats = ppo_policy_loss(*args, **kwargs)
    if not poisoned:
        poisoned.append(True)
        per_token = per_token * float("nan")
    return per_token, stats


if __name__ == "__main__":
    rl.ppo_policy_loss = nan_in_the_first_update
    exit_now(train.main())  # as train.py ends
