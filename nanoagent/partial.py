"""
A training step's rollout: when it ends, which groups it trains on, which go on into the next step.

By default a step's rollout ends when its last trajectory ends. Agent trajectories are long-tailed (a
search agent answers at once or after four searches; a game is won in 3 moves or wanders for 20), and
while the last few run, the engine decodes a handful of sequences and the trainer waits.

Partial rollouts (rollout.max_staleness > 0). A rank keeps rollout.extra_prompts / ranks groups in
flight beyond its share of rollout.prompts_per_step, and its rollout ends once that share has ended.
The groups still running pause (agent.Rollouts.pause: their turns in the engine aborted, what they
sampled kept) and go on in the next step under the new weights, ahead of it; that step starts as many
groups of spare prompts as it takes to have extra_prompts in flight again. A step trains its share of
groups, the oldest first; groups that ended beyond it are held, ended, for the next step. Every token
records the step whose policy sampled it (Trajectory.versions). A group is paused or held only if its
oldest token will be at most max_staleness steps old when the next step trains: otherwise the rollout
waits for its end and it trains now, beyond the share if need be. The loss weighs stale tokens by
min(pi_old / pi_behaviour, train.tis_cap) (docs/formulation.md: Partial rollouts). A resume starts without the
groups paused or held at the checkpoint.

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
    left, paused or ended; prompts: this step's share of the data; spares: an iterator of spare prompts;
    seed: the sampling seed of this step's first groups; score(t): the task scores a trajectory when its
    group ends; trains(group): whether some trajectory of a scored group trains. Returns (the groups this
    step trains, in start order, the carried ones first; the groups it leaves to the next step; this
    rank's counts of groups: ended in this rollout, kept (that train), carried in, paused, held, refills).
    """
    r, G = cfg.rollout, cfg.rollout.group_size
    share = r.prompts_per_step // world
    extra = r.extra_prompts // world if r.max_staleness else 0
    refills_left = int(cfg.grpo.max_refill * share) if cfg.grpo.refill else 0
    rollouts.version = step
    groups, starts, refills = list(carried), 0, 0
    # id(group) -> whether it trains, for the groups that ended (the carried ones that had were scored then)
    ended = {id(g): trains(g) for g in carried if all(t.finish_reason for t in g)}
    ended_before = len(ended)
    counted = lambda g: ended[id(g)] or not cfg.grpo.refill  # noqa: E731  (refill: the groups that train)

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
        return (sum(counted(g) for g in groups if id(g) in ended) >= share
                and all(can_carry(g, step, r.max_staleness) for g in running))

    start(prompts + [next(spares) for _ in range(max(0, extra - len(carried)))])
    rollouts.run(enough)
    running = [g for g in groups if id(g) not in ended]
    if running:
        rollouts.pause()
    # what trains: the ended groups that cannot wait for the next step (all of them with max_staleness=0)
    # and those that do not count, then the others, oldest first, up to the share; the rest are held
    done = [g for g in groups if id(g) in ended]
    must = {id(g) for g in done if not counted(g) or not can_carry(g, step, r.max_staleness)}
    room = share - sum(counted(g) for g in done if id(g) in must)
    chosen = must | {id(g) for g in [g for g in done if id(g) not in must][:max(room, 0)]}
    train = [g for g in done if id(g) in chosen]
    left = [g for g in groups if id(g) not in chosen]
    tally = {"groups_ended": len(ended) - ended_before, "groups_kept": sum(ended[id(g)] for g in train),
             "carried_in": len({id(g) for g in train} & {id(g) for g in carried}), "paused": len(running),
             "held": len(left) - len(running), "refills": refills}
    return train, left, tally
