"""Trainers: one training loop per command (pretrain, SFT, reward model, DPO, and the RL loop that
serves PPO, GRPO, RLOO and REINFORCE), and the scaffolding they share (``trainers.common``)."""
