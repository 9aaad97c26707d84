"""Models: loading Hugging Face causal LMs and their adapters, the forwards RL reads
(response-aligned log-probs, values, rewards) and the LM head's chunked log-probs.
"""
