"""
A training step's rollout: when it ends, which groups it trains on, which go on into the next step.

By default a step's rollout ends when its last trajectory ends. Agent trajectories are long-tailed (a
search agent answers at once or after four searches; a game is won in 3 moves or wanders for 20), and
while the last few run, the engine decodes a handful of sequences and the trainer waits.

Partial rollouts (rollout.max_staleness > 0). A rank keeps rollout.extra_prompts / ranks groups in
flight beyond its share of rollout.prompts_per_step, and its rollout ends once that share has ended.
The groups still running pause (agent.Rollouts.pause: their turns in the engine aborted, what they
sampled kept) and go on in the next step under the new weights, ahead of it; that step starts as many
groups of spare prompts as it takes to have extra_prompts in flight again. Every token records the step
whose policy sampled it (Trajectory.versions). A group is paused only if its oldest token will be at
most max_staleness steps old when the next step trains; otherwise the rollout waits for its end. The
loss weighs stale tokens by min(pi_old / pi_behaviour, train.tis_cap) (README: Partial rollouts). A
resume starts without the groups paused at the checkpoint.

Dynamic sampling (grpo.refill, DAPO's). A group that ends with nothing to train on (rewards all equal:
its GRPO advantages are all 0; or every trajectory left out) is replaced at once, within the step, by a
group of a spare prompt, until the rank's share of groups that train is in or it has started
grpo.max_refill x its share of spare prompts. With partial rollouts the two combine: groups keep
starting until enough that train have ended.

Spare prompts come from a seeded stream of their own per (step, rank) (data.spare_prompts): the data
order of the prompts_per_step prompts of each step is the same with them or without.
"""


def can_carry(group, step, max_staleness):
    """Whether a group may pause at the end of `step`: its oldest token, sampled or paused mid-turn, is
    at most max_staleness steps old when step + 1 trains."""
    return all(t.oldest_version() is None or step + 1 - t.oldest_version() <= max_staleness for t in group)


def rollout_step(rollouts, carried, prompts, spares, step, seed, score, trains, cfg, world):
    """
    One step's rollout on this rank. rollouts: its agent.Rollouts; carried: the groups the last step
    paused; prompts: this step's share of the data; spares: an iterator of spare prompts; seed: the
    sampling seed of this step's first groups; score(t): the task scores a trajectory when its group
    ends; trains(group): whether some trajectory of a scored group trains. Returns (the groups that
    ended, in start order: the carried ones first; the groups paused; this rank's counts of groups:
    ended, kept (that train), carried in, paused, refills).
    """
    r, G = cfg.rollout, cfg.rollout.group_size
    share = r.prompts_per_step // world
    extra = r.extra_prompts // world if r.max_staleness else 0
    refills_left = int(cfg.grpo.max_refill * share) if cfg.grpo.refill else 0
    rollouts.version = step
    groups, ended, starts, refills = list(carried), {}, 0, 0  # ended: id(group) -> whether it trains

    def start(rows):
        nonlocal starts
        trajs = rollouts.start([p for p in rows for _ in range(G)], seed + starts * 7_919_993)
        starts += 1
        groups.extend(trajs[i:i + G] for i in range(0, len(trajs), G))

    def enough():
        nonlocal refills_left, refills
        for g in groups:
            if id(g) not in ended and all(t.finish_reason for t in g):
                for t in g:
                    score(t)
                ended[id(g)] = trains(g)
                if not ended[id(g)] and refills_left and sum(ended.values()) < share:
                    refills_left, refills = refills_left - 1, refills + 1
                    start([next(spares)])
        running = [g for g in groups if id(g) not in ended]
        counted = sum(ended.values()) if cfg.grpo.refill else len(ended)  # refill: only the groups that train
        return counted >= share and all(can_carry(g, step, r.max_staleness) for g in running)

    start(prompts + [next(spares) for _ in range(max(0, extra - len(carried)))])
    rollouts.run(enough)
    done = [g for g in groups if id(g) in ended]
    paused = [g for g in groups if id(g) not in ended]
    if paused:
        rollouts.pause()
    counts = {"groups_ended": len(done), "groups_kept": sum(ended.values()),
              "carried_in": sum(any(g is c for c in carried) for g in done), "paused": len(paused),
              "refills": refills}
    return done, paused, counts
