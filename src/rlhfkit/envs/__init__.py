"""Multi-turn environments: the episode loop between a policy and an environment, and tool calls.
"""
