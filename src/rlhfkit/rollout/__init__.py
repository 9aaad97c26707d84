"""Rollout and scoring: sampling responses, scoring them with the reward sources, turning
them into experience (old and reference log-probs, advantages), and evaluation.
"""
