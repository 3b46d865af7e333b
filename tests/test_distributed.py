"""The trainer's update under real torchrun with gloo and FSDP2: the gradient, the logged loss and
the batch-wide statistics (whitening, the loss's units) do not depend on the number of ranks or
the micro-batch size."""

import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import padded
import procs
from dist_grad import batch, grad_of
from dist_whiten import batch as whiten_batch
from nanoagent import rl
from nanoagent.batch import pad_rows

pytestmark = pytest.mark.slow
HERE = os.path.dirname(os.path.abspath(__file__))


def torchrun_grad(model_dir, nproc, micro_tokens, out, keep=None, on_policy=False):
    cmd = [*procs.torchrun(nproc), os.path.join(HERE, "dist_grad.py"), "--model", model_dir,
           "--micro-tokens", str(micro_tokens), "--out", str(out),
           *(["--keep", *map(str, keep)] if keep is not None else []), *(["--on-policy"] if on_policy else [])]
    env = {**os.environ, "PYTHONPATH": HERE + os.pathsep + os.path.dirname(HERE), "OMP_NUM_THREADS": "1"}
    proc = procs.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out)


def test_fsdp2_gradient_of_packed_micro_batches_matches_the_padded_rows_in_one_process(tiny_model_dir, tmp_path):
    """fp32: one policy update over packed micro-batches (a group's prompt once, the LM head on the
    action tokens only), on 1 and 2 ranks, has the gradient and loss of the padded computation in one
    process; and on-policy (old logprobs from the update's own forward), the gradient and old
    logprobs of ratio 1."""
    rows, masks, advantages = batch(padded.load_causal_lm(tiny_model_dir).config.vocab_size)
    references = {}
    for on_policy in (False, True):
        plain = padded.plain_lm(tiny_model_dir)
        loss = grad_of(plain, rows, masks, advantages, list(range(len(rows))), sum(sum(m) for m in masks), on_policy)
        references[on_policy] = loss, {n: p.grad for n, p in plain.named_parameters()}
    # small token budgets give the ranks different numbers of micro-batches; the runs go side by side
    runs = [(1, 10_000, False), (2, 50, False), (2, 120, False), (2, 50, True)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        outs = pool.map(lambda run: torchrun_grad(tiny_model_dir, run[0], run[1], tmp_path / f"g{run}.pt", on_policy=run[2]), runs)
    for (nproc, micro_tokens, on_policy), out in zip(runs, outs):
        loss, reference = references[on_policy]
        assert out["grads"].keys() == reference.keys()
        for name, g in out["grads"].items():
            torch.testing.assert_close(g, reference[name], atol=2e-6, rtol=1e-4, msg=f"{name} nproc={nproc} micro_tokens={micro_tokens}")
        # the logged loss is the global loss, not one rank's share of it
        assert out["metrics"]["pg_loss"] == pytest.approx(loss, rel=1e-5), (nproc, micro_tokens)
        if on_policy:  # the update wrote the old logprobs it used: the current ones, on the action tokens
            with torch.no_grad():
                current = padded.logprobs(padded.plain_lm(tiny_model_dir), rows)[0] * pad_rows(masks, 0, torch.float32)
            torch.testing.assert_close(out["old_logprobs"], current, atol=1e-5, rtol=1e-5)


def test_a_rank_left_with_no_rows_trains_on_the_others(tiny_model_dir, tmp_path):
    """Dropped trajectories (uniform groups, overlong) leave rank 1 with nothing to train on: it
    still runs every collective, and the update is the one of the kept rows alone."""
    plain = padded.plain_lm(tiny_model_dir)
    rows, masks, advantages = batch(plain.config.vocab_size)
    keep = [0, 2, 4]  # rank 0 holds rows 0, 2, 4, 6; rank 1 holds 1, 3, 5, 7
    loss = grad_of(plain, rows, masks, advantages, keep, sum(sum(masks[i]) for i in keep))
    reference = {n: p.grad for n, p in plain.named_parameters()}
    out = torchrun_grad(tiny_model_dir, 2, 50, tmp_path / "kept.pt", keep)
    for name, g in out["grads"].items():
        torch.testing.assert_close(g, reference[name], atol=2e-6, rtol=1e-4, msg=name)
    assert out["metrics"]["pg_loss"] == pytest.approx(loss, rel=1e-5)


def test_a_world_of_one_serves_its_store_on_loopback_only():
    """`python train.py` (no torchrun) serves the process group's store on 127.0.0.1, not on every
    interface: what each socket listening on its port is bound to, from /proc/net/tcp{,6}."""
    code = ("import os; from nanoagent.common import init_distributed; init_distributed(); port = int(os.environ['MASTER_PORT'])\n"
            "for table in ('/proc/net/tcp', '/proc/net/tcp6'):\n"
            "    for line in open(table).readlines()[1:]:\n"
            "        address, hex_port = line.split()[1].split(':')\n"
            "        if int(hex_port, 16) == port and line.split()[3] == '0A':  # 0A: LISTEN\n"
            "            print(address)\n")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    proc = procs.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env={**env, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["0100007F"], proc.stdout  # 127.0.0.1, and nothing else listens on the store's port


def test_whitening_and_loss_units_are_the_whole_batchs_on_every_rank(tmp_path):
    """REINFORCE++ (and PPO) whiten advantages with the mean and std of the whole batch, and the loss's
    denominators count the whole mini-batch's tokens and units: on 2 ranks, each with half the rows,
    the same numbers as one process over all of them (a rank's own statistics would give others)."""
    out = tmp_path / "whiten"
    cmd = [*procs.torchrun(2), os.path.join(HERE, "dist_whiten.py"), str(out)]
    env = {**os.environ, "PYTHONPATH": os.path.dirname(HERE), "OMP_NUM_THREADS": "1"}
    proc = procs.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    advantages, mask, units = whiten_batch()
    whole = rl.whiten(advantages, mask)
    tokens, count, unit_tokens = rl.unit_counts(mask, units, list(range(len(mask))))
    for rank in range(2):
        got = torch.load(f"{out}.{rank}")
        torch.testing.assert_close(got["whitened"], whole[got["rows"]], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got["unit_tokens"], unit_tokens[got["rows"]])
        assert (got["tokens"], got["units"]) == (tokens, count)
    assert not torch.allclose(rl.whiten(advantages[0::2], mask[0::2]), whole[0::2], atol=1e-3)  # one rank's own statistics differ


BALANCE_SCRIPT = """
import json, sys
import torch.distributed as dist
from nanoagent.agent import Trajectory
from nanoagent.batch import balance_groups

dist.init_process_group("gloo")
rank = dist.get_rank()
costs = json.loads(sys.argv[1])[rank]
trajs = [Trajectory(sample={"id": f"{rank}-{g}-{i}"}, prompt_ids=[rank, g], messages=[], env=object(), reward=float(i))
         for g in range(len(costs)) for i in range(2)]  # groups of 2
mine = balance_groups(trajs, costs, 2)
with open(f"{sys.argv[2]}.{rank}", "w") as f:
    json.dump([[t.sample["id"], t.prompt_ids, t.reward, t.env is None] for t in mine], f)
dist.destroy_process_group()
"""


def test_whole_groups_move_between_ranks_until_their_tokens_are_about_even(tmp_path):
    """train.balance_ranks: rank 0 holds groups of 900, 500 and 100 trained tokens, rank 1 of 100,
    100 and 0 (left out). The 500 moves (it evens 1,500 against 200 best), then a 100 (1,000 against
    700): 900 against 800, where nothing lighter than the gap is left. Each group arrives whole, in
    order, without its environment; the groups that stay keep theirs."""
    script = tmp_path / "balance.py"
    script.write_text(BALANCE_SCRIPT)
    cmd = [*procs.torchrun(2), str(script),
           json.dumps([[900, 500, 100], [100, 100, 0]]), str(tmp_path / "trajs")]
    proc = procs.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": os.path.dirname(HERE), "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = [json.loads((tmp_path / f"trajs.{rank}").read_text()) for rank in range(2)]  # [id, prompt ids, reward, env dropped]
    group = lambda rank, g, moved: [[f"{rank}-{g}-{i}", [rank, g], float(i), moved] for i in range(2)]  # noqa: E731
    assert got[0] == group(0, 0, False)
    assert got[1] == group(1, 0, False) + group(1, 1, False) + group(1, 2, False) + group(0, 1, True) + group(0, 2, True)
