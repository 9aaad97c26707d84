"""What a run keeps and watches: checkpoints and exact resume, data parallelism, metric plots,
per-token trajectories and the reward-hacking watch.
"""
